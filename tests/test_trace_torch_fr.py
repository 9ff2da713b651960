"""The flight recorder's dump in torch's format (``observe/torch_fr.py``, issue 50): dumps
of 3 ranks built by hand, written by ``torch_fr.write``, read by the venv's real
``torchfrtrace`` (torch's own analyzer), which must find nothing wrong with a consistent
job and name the mismatch of a job where one rank skipped a call or made it with another
size; one rank's real dump through ``dump_trace()``; and ``write`` on a directory that
cannot be written (None, one line on stderr, no exception). No MPI: the runs of the
analyzer go in parallel, each a process of its own."""
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcrdl_core.observe import torch_fr

ROOT = Path(__file__).resolve().parent.parent
FRTRACE = Path(sys.executable).parent / "torchfrtrace"
pytestmark = pytest.mark.skipif(not FRTRACE.exists(), reason="torchfrtrace is not installed")

GROUPS = {"world": {"name": "world", "ranks": [0, 1, 2], "calls": 9, "p2p_calls": 0}}
PAIR = {"name": "pair", "ranks": [0, 1], "calls": 1, "p2p_calls": 0}
#: all_to_all's split counts: SPLITS[i][j] elements go from rank i to rank j
SPLITS = [[1, 2, 3], [2, 2, 2], [3, 1, 0]]


def _entry(seq, op="all_reduce", count=4, dtype="float32", group="world", **kw):
    t = 1000.0 + (seq or 0)
    e = {"group": group, "seq": seq, "p2p": op in ("send", "recv"), "op": op, "dtype": dtype,
         "count": count, "bytes": None if dtype is None else count * 4, "backend": "gloo",
         "algorithm": None, "codec": None, "rule": "explicit: backend='gloo'",
         "async": False, "state": "completed", "t_issue": t, "t_end": t + 0.01,
         "frame": f"train.py:{10 + (seq or 0)} in step"}
    e.update(kw)
    return e


def _calls(rank) -> list:
    """One rank's calls of the consistent job: every collective kind on the world group,
    one on a group of ranks 0 and 1, a JAX call that was lowered and a send, both left
    out of torch's format."""
    out_counts = [SPLITS[j][rank] for j in range(3)]
    calls = [_entry(1, reduce_op="sum"),
             _entry(2, "broadcast", dtype="int32", root=0),
             _entry(3, "all_gather"),
             _entry(4, "reduce_scatter", count=2, reduce_op="sum"),
             _entry(5, "gather", root=1),
             _entry(6, "scatter", root=0),
             _entry(7, "barrier", count=1, dtype=None),
             _entry(8, "all_to_all", count=sum(SPLITS[rank]),
                    counts=[out_counts, SPLITS[rank]]),
             _entry(9, "all_reduce", count=16, dtype="bfloat16", reduce_op="max"),
             _entry(None, "all_reduce", backend="mpi", state="lowered", t_end=None)]
    if rank < 2:
        calls.insert(3, _entry(1, group="pair", backend="mpi"))
        calls.append(_entry(1, "send" if rank == 0 else "recv", peer=1 - rank, tag=0))
    return calls


def _dump(rank, entries) -> dict:
    groups = dict(GROUPS, **({"pair": PAIR} if rank < 2 else {}))
    return {"job": "host-1", "schema": "mcrdl.trace/1", "rank": rank, "world_size": 3,
            "reason": "test", "capacity": 4096, "groups": groups, "entries": entries,
            "complete": True}


def _case(folder: Path, per_rank) -> list:
    folder.mkdir()
    paths = []
    for rank, entries in enumerate(per_rank):
        json_path = folder / f"rank-{rank}.json"
        json_path.write_text("{}")  # (the JSON dump that recorder.dump writes first)
        paths.append(torch_fr.write(_dump(rank, entries), str(json_path)))
    return paths


def _analyze(folders) -> dict:
    """torchfrtrace's output (stdout and stderr) per folder, the runs side by side."""
    procs = {f: subprocess.Popen([str(FRTRACE), str(f), "--prefix", torch_fr.PREFIX],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for f in folders}
    out = {}
    for f, p in procs.items():
        text, _ = p.communicate(timeout=60)
        assert p.returncode == 0, text
        out[f.name] = text
    return out


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_fr")
    good = [_calls(r) for r in range(3)]
    missing = [good[0], good[1], [e for e in good[2] if e["seq"] != 3]]  # rank 2: no all_gather
    sizes = [good[0], good[1], [dict(e, count=8) if e["seq"] == 2 else e for e in good[2]]]
    written = {}
    for name, per_rank in (("ok", good), ("missing", missing), ("sizes", sizes)):
        written[name] = _case(tmp / name, per_rank)
    return tmp, written, _analyze([tmp / n for n in written])


def test_files_are_torchs_layout(analyzed):
    tmp, written, _ = analyzed
    assert written["ok"] == [str(tmp / "ok" / f"nccl_trace_rank_{r}") for r in range(3)]
    assert sorted(os.listdir(tmp / "ok")) == [f"nccl_trace_rank_{r}" for r in range(3)] + [
        f"rank-{r}.json" for r in range(3)]  # (no temporary file left)
    with open(written["ok"][0], "rb") as f:
        d = pickle.load(f)
    assert d["version"] == "2.10"
    assert d["pg_config"] == {"world": {"name": "world", "desc": "world", "ranks": "[0, 1, 2]"},
                              "pair": {"name": "pair", "desc": "pair", "ranks": "[0, 1]"}}
    e = d["entries"]
    assert [x["profiling_name"] for x in e] == [
        "gloo:all_reduce", "gloo:broadcast", "gloo:all_gather", "gloo:all_reduce",
        "gloo:reduce_scatter", "gloo:gather", "gloo:scatter", "gloo:barrier",
        "gloo:all_to_all", "gloo:all_reduce"]  # (no lowered call, no send; mpi as gloo)
    assert [x["record_id"] for x in e] == list(range(10))
    assert [x["process_group"] for x in e][2:4] == [("world", "world"), ("pair", "pair")]
    assert [x["collective_seq_id"] for x in e if x["process_group"][0] == "world"] == \
        list(range(1, 10))
    first = e[0]
    assert (first["input_sizes"], first["output_sizes"], first["input_dtypes"]) == \
        ([[4]], [[4]], ["Float"])
    assert (first["state"], first["retired"], first["is_p2p"]) == ("completed", True, False)
    assert first["time_created_ns"] == first["time_discovered_started_ns"] == 1001 * 10**9
    assert first["time_discovered_completed_ns"] == 1001_010_000_000
    assert first["frames"] == [{"name": "step", "filename": "train.py", "line": 11}]
    assert (e[2]["input_sizes"], e[2]["output_sizes"]) == ([[4]], [[12]])  # all_gather
    assert (e[4]["input_sizes"], e[4]["output_sizes"]) == ([[6]], [[2]])  # reduce_scatter
    assert (e[5]["output_sizes"], e[6]["input_sizes"]) == ([], [[12]])  # gather root 1, scatter root 0
    assert (e[7]["input_dtypes"], e[8]["input_sizes"], e[8]["output_sizes"]) == ([], [[6]], [[6]])
    assert e[9]["input_dtypes"] == ["BFloat16"]
    assert d["pg_status"]["0"] == {"last_enqueued_collective": 9, "last_started_collective": 9,
                                   "last_completed_collective": 9}


def test_torchfrtrace_finds_nothing_wrong_with_a_consistent_job(analyzed):
    _, _, out = analyzed
    text = out["ok"]
    for phrase in ("Not all ranks", "has errors", "mismatch", "Traceback", "Error"):
        assert phrase not in text, text


def test_torchfrtrace_names_the_call_a_rank_skipped(analyzed):
    _, _, out = analyzed
    text = out["missing"]
    assert "Not all ranks joining collective, sequence number: 3" in text, text
    assert "collective: gloo:all_gather" in text and "missing ranks: {2}" in text, text
    assert "group info: world:world" in text, text


def test_torchfrtrace_names_the_rank_with_another_size(analyzed):
    _, _, out = analyzed
    text = out["sizes"]
    assert "Collective sequence number: 2 has errors" in text, text
    assert "collective: gloo:broadcast" in text, text
    assert ("Culprit rank 2; Error type: SIZE_OR_SYNTAX_MISMATCH, Expected input sizes: "
            "'[[4]]' does not match found input sizes: '[[8]]'") in text, text


def test_states_torch_lacks(tmp_path):
    """A call that timed out on one rank, completed on the others: torch's entry of a
    call its watchdog gave up on stays 'started', and its analyzer says so."""
    good = [_calls(r) for r in range(3)]
    late = [dict(e, state="timed out", t_end=None) if e["seq"] == 9 else e for e in good[2]]
    _case(tmp_path / "timeout", [good[0], good[1], late])
    text = _analyze([tmp_path / "timeout"])["timeout"]
    assert "Collective sequence number: 9 has errors" in text, text
    assert "Expected state: 'completed' does not match found state: 'started'" in text, text


def test_a_real_dump_writes_both(tmp_path):
    """``dump_trace()`` of one rank: ``rank-0.json`` and ``nccl_trace_rank_0`` side by
    side, which torchfrtrace reads without --prefix."""
    env = dict(os.environ, MCRDL_TUNING_TABLE="none", MCRDL_TRACE_DIR=str(tmp_path))
    for k in ("MCRDL_DEBUG", "MCRDL_BACKEND", "MCRDL_COMPRESSION", "PMI_RANK"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import numpy as np, mcrdl_core as core
        core.all_reduce(np.ones(4, np.float32), backend="gloo")
        core.broadcast(np.ones(3, np.int32), 0, backend="gloo")
        print("DUMP", core.dump_trace())
    """)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["nccl_trace_rank_0", "rank-0.json"]
    with open(tmp_path / "nccl_trace_rank_0", "rb") as f:
        d = pickle.load(f)
    assert [(x["profiling_name"], x["collective_seq_id"], x["input_sizes"], x["state"])
            for x in d["entries"]] == [("gloo:all_reduce", 1, [[4]], "completed"),
                                       ("gloo:broadcast", 2, [[3]], "completed")]
    run = subprocess.run([str(FRTRACE), str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Not all ranks" not in run.stdout + run.stderr


def test_write_never_raises(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert torch_fr.write(_dump(0, _calls(0)), str(blocker / "rank-0.json")) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "mcrdl: rank 0: could not write the torch-format flight-recorder dump"), err
    assert torch_fr.write({"rank": "one"}, str(tmp_path / "r.json")) is None
    assert torch_fr.write(None, str(tmp_path / "r.json")) is None
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["a-file"]
