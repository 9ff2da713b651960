"""The flight recorder in one process (issue 50): its entries and rules on the general
path, dumps by ``dump_trace()`` and SIGUSR1, ``Runtime.explain`` and ``mcrdl explain``,
and ``mcrdl trace`` on good and bad input (no dumps, a truncated file, dumps of two
jobs: a message and exit status 2, no traceback). Each case runs a small program in a
process of its own (a runtime of one rank), so the test process keeps no runtime."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _py(code: str, tmp: Path, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, MCRDL_TUNING_TABLE="none", MCRDL_TRACE_DIR=str(tmp), **env)
    for k in ("MCRDL_DEBUG", "MCRDL_BACKEND", "MCRDL_COMPRESSION"):
        if k not in env:
            e.pop(k, None)
    e.pop("PMI_RANK", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _trace(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mcrdl_core.tools.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


CALLS = """
    import json, numpy as np, mcrdl_core as core
    x = np.ones(4, np.float32)
    core.all_reduce(x, backend="gloo")
    w = core.all_reduce(x, backend="gloo", async_op=True)
    w.wait()
    core.broadcast(np.ones(3, np.int32), 0, backend="gloo")
    g = core.new_group([0], backend="gloo")
    core.all_reduce(x, group=g)
    print("DUMP", core.dump_trace())
"""


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dump")
    res = _py(CALLS, tmp)
    assert res.returncode == 0, res.stderr
    path = res.stdout.split("DUMP ")[1].strip()
    with open(path) as f:
        return tmp, Path(path), json.load(f)


def test_entries_of_the_general_path(dumped):
    _, path, d = dumped
    assert path.name == "rank-0.json" and d["rank"] == 0 and d["world_size"] == 1
    assert d["reason"] == "dump_trace()" and d["complete"] is True
    e = [x for x in d["entries"] if x["group"] == "world"]
    assert [(x["op"], x["seq"], x["dtype"], x["count"], x["bytes"], x["backend"], x["async"],
             x["state"]) for x in e] == [
        ("all_reduce", 1, "float32", 4, 16, "gloo", False, "completed"),
        ("all_reduce", 2, "float32", 4, 16, "gloo", True, "completed"),
        ("broadcast", 3, "int32", 3, 12, "gloo", False, "completed")]
    assert all(x["rule"] == "explicit: backend='gloo'" for x in e)
    assert e[0]["reduce_op"] == "sum" and e[2]["root"] == 0
    assert all(x["t_issue"] <= x["t_end"] for x in e)
    sub = [x for x in d["entries"] if x["group"] != "world"]
    assert len(sub) == 1 and sub[0]["seq"] == 1
    assert sub[0]["rule"].startswith("group default: backend='gloo'")
    assert d["groups"]["world"]["calls"] == 3


def test_trace_of_ranks_that_agree(dumped):
    tmp, _, _ = dumped
    res = _trace("trace", str(tmp))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("the ranks agree: 4 collective entries of 1 ranks")
    js = _trace("trace", "--json", str(tmp))
    assert js.returncode == 0 and json.loads(js.stdout)["verdict"]["kind"] == "ok"


def _bad(res, *phrases):
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and res.stderr.startswith("mcrdl trace: ")
    for p in phrases:
        assert p in res.stderr, res.stderr


def test_bad_input(dumped, tmp_path):
    _, path, d = dumped
    _bad(_trace("trace", str(tmp_path)), "no flight-recorder dumps")
    _bad(_trace("trace", str(tmp_path / "nowhere")), "is not a directory")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "rank-0.json").write_text(path.read_text()[:200])
    _bad(_trace("trace", str(cut)), "rank-0.json is not a complete dump", "remove it")
    two = tmp_path / "two"
    two.mkdir()
    (two / "rank-0.json").write_text(json.dumps(d))
    (two / "rank-1.json").write_text(json.dumps(dict(d, rank=1, job="another-1")))
    _bad(_trace("trace", str(two)), "dumps of 2 jobs", "--job")
    ok = _trace("trace", "--job", d["job"], str(two))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (two / "rank-1.json").write_text(json.dumps({"schema": "something else"}))
    _bad(_trace("trace", str(two)), "not a flight-recorder dump")


def test_sigusr1_dumps_and_chains_the_programs_handler(tmp_path):
    res = _py("""
        import os, signal, time, numpy as np, mcrdl_core as core
        seen = []
        signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
        core.all_reduce(np.ones(2), backend="gloo")
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("SEEN", seen)
    """, tmp_path)
    assert res.returncode == 0, res.stderr
    assert "SEEN [" in res.stdout and "SEEN []" not in res.stdout
    d = json.loads((tmp_path / "rank-0.json").read_text())
    assert d["reason"] == "SIGUSR1" and d["entries"][-1]["op"] == "all_reduce"


def test_off_writes_nothing(tmp_path):
    res = _py("""
        import numpy as np, mcrdl_core as core
        core.all_reduce(np.ones(2), backend="gloo")
        print("DUMP", core.dump_trace())
    """, tmp_path, MCRDL_TRACE_ENTRIES="0")
    assert res.returncode == 0 and "DUMP None" in res.stdout, res.stderr
    assert not list(tmp_path.iterdir())


TABLE = {"schema": "mcrdl.tuning/2", "machine": {}, "entries": [
    {"op": "all_reduce", "world_size": 1, "hosts": 1, "device": "cpu", "dtype_class": "float",
     "ranges": [[64, "gloo"], [None, "mpi"]]}]}


def test_explain_says_the_rule(tmp_path):
    res = _py(f"""
        import json, numpy as np, mcrdl_core as core
        from mcrdl_core.dispatch.selection import TuningTable
        rt = core.init()
        small, big = np.ones(4, np.float32), np.ones(1024, np.float32)
        out = {{"policy": rt.explain("all_reduce", small),
                "explicit": rt.explain("all_reduce", small, backend="gloo"),
                "default": rt.explain("all_reduce", small, group=core.new_group([0],
                                                                           backend="gloo"))}}
        rt.set_table(TuningTable({TABLE!r}))
        out["table_small"] = rt.explain("all_reduce", small)
        out["table_big"] = rt.explain("all_reduce", big)
        rt.set_override("all_reduce=gloo")
        out["env"] = rt.explain("all_reduce", big)
        print("OUT", json.dumps(out))
    """, tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.split("OUT ")[1])
    assert out["policy"]["rule"].startswith("policy: cpu buffers prefer mpi, gloo")
    assert out["explicit"]["backend"] == "gloo"
    assert out["explicit"]["rule"] == "explicit: backend='gloo'"
    assert out["default"]["rule"].startswith("group default: backend='gloo'")
    assert out["table_small"]["backend"] == "gloo"
    assert "all_reduce 1 ranks 1 host cpu float, range 0 B-64 B" in out["table_small"]["rule"]
    assert out["table_big"]["backend"] == "mpi" and "range 65 B-inf" in out["table_big"]["rule"]
    assert out["table_big"]["table"]["range"] == [65, None]
    assert out["env"]["backend"] == "gloo" and out["env"]["rule"] == "MCRDL_BACKEND: all_reduce=gloo"


def test_mcrdl_explain_reads_a_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))
    res = _trace("explain", "--table", str(path), "--ranks", "1", "--bytes", "16,1K")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ["all_reduce", "16", "B:", "gloo"]
    assert lines[1].split()[:4] == ["all_reduce", "1", "KiB:", "mpi"]
    none = _trace("explain", "--table", str(path), "--ranks", "3", "--bytes", "16")
    assert "policy (no range of the table)" in none.stdout
