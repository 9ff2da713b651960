"""The emulated cluster (``mcrdl cluster``): its description and refusals (everywhere),
and, where network namespaces can be created (root, as in CI), building and removing
clusters, the topology a program sees, bytes really crossing the links, the op,
mixing and deadlock tests of tests/mpi on 2 hosts x 1 rank and 2 hosts x 2 ranks, and
the compression and resharding tests on 2 hosts x 2 ranks.

Where namespaces cannot be created the cluster tests skip with the reason.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcrdl_core.cluster import (Cluster, ClusterPermissionError, ClusterSpec, ClusterSpecError,
                                existing, parse_delay, parse_rate, system)
from mcrdl_core.cluster.launch import mpiexec_argv

ROOT = Path(__file__).resolve().parent.parent
MCRDL = [sys.executable, "-m", "mcrdl_core.tools.cli"]


# --- everywhere -----------------------------------------------------------------------------
def test_rates_delays_names_and_addresses():
    assert [parse_rate(x) for x in ("1gbit", "10gbit", "500mbit", "1gbps", "none", None)] == \
           [10**9, 10**10, 5 * 10**8, 8 * 10**9, None, None]
    assert parse_delay("50us") == pytest.approx(50e-6) and parse_delay("2ms") == pytest.approx(2e-3)
    for bad in ("fast", "10 parsecs", "1gb"):
        with pytest.raises(ClusterSpecError, match="tc"):
            parse_rate(bad)
    with pytest.raises(ClusterSpecError, match="50us"):
        parse_delay("50")
    s = ClusterSpec(hosts=3, ranks_per_host=2, rate_bits=10**9, name="t1")
    assert s.host_names == ["h0", "h1", "h2"] and s.world_size == 6
    assert [s.address(h) for h in s.host_names] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert s.address("switch") == "198.19.255.254"
    assert "198.18.0.2\th1" in s.hosts_file() and s.netns("h2") == "t1-h2"
    assert ClusterSpec().name != ClusterSpec().name  # two clusters never share names
    for kw in ({"hosts": 0}, {"ranks_per_host": 0}, {"name": "Bad-Name"}):
        with pytest.raises(ClusterSpecError):
            ClusterSpec(**kw)
    with pytest.raises(ClusterSpecError, match="hosts are h0, h1, h2"):
        s.host_index("h7")


def test_block_placement_on_the_command_line():
    c = Cluster(ClusterSpec(hosts=2, ranks_per_host=2, name="t2"))
    argv = mpiexec_argv(c, ["python", "x.py"], mpiexec="mpiexec")
    assert argv == ["mpiexec", "-launcher", "ssh", "-launcher-exec", c.launcher, "-hosts",
                    "h0,h1", "-ppn", "2", "-n", "4", "python", "x.py"]


def test_refuses_without_privileges_before_creating_anything(monkeypatch):
    monkeypatch.setattr(system, "_effective_caps", lambda: 0)
    spec = ClusterSpec(hosts=2, name="t3")
    with pytest.raises(ClusterPermissionError, match="root .*CAP_NET_ADMIN.*sudo"):
        Cluster(spec).build()
    assert "t3" not in existing()
    r = subprocess.run(MCRDL + ["cluster", "run", "--hosts", "2"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no command given" in r.stderr, r.stderr


# --- where namespaces can be created ---------------------------------------------------------
def _why_no_cluster():
    reason = system.why_not_allowed()
    if reason:
        return reason
    try:  # the kernel or a container may still refuse: try a one-host cluster
        with Cluster(ClusterSpec(hosts=1, rate_bits=None)):
            pass
    except Exception as exc:  # noqa: BLE001 - any refusal is the reason to skip
        return f"cannot build a test cluster here: {exc}"
    return None


REASON = _why_no_cluster()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")


def _run(args, program, timeout=240, env=None, **kw):
    """`mcrdl cluster run ARGS -- PROGRAM`; (completed process, report dict)."""
    report = Path(kw.pop("tmp_path")) / f"report{time.monotonic_ns()}.json"
    cmd = MCRDL + ["cluster", "run", *args, "--report", str(report), "--", *program]
    full_env = dict(os.environ, MCRDL_TUNING_TABLE="none", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # a timeout (ours or pytest's): SIGTERM lets it remove the cluster
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    rep = json.loads(report.read_text()) if report.exists() else None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), rep


def _running(name, command):
    """Ids of the processes named ``command`` inside cluster ``name``'s namespaces."""
    found = []
    for ns in system.netns_list():
        if ns.startswith(name + "-"):
            for pid in system.netns_pids(ns):
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        if f.read().strip() == command:
                            found.append(pid)
                except OSError:  # ended meanwhile
                    pass
    return found


def _ours_gone(name):
    left = [ns for ns in system.netns_list() if ns.startswith(name + "-")]
    assert not left, left
    assert not os.path.exists(os.path.join(system.NETNS_ETC, f"{name}-h0"))
    assert name not in existing()


@needs_netns
def test_hosts_names_addresses_and_teardown_of_two_clusters_side_by_side():
    with Cluster(ClusterSpec(hosts=2, rate_bits=10**9)) as a, \
            Cluster(ClusterSpec(hosts=3, rate_bits=None)) as b:
        assert a.spec.name != b.spec.name and {a.spec.name, b.spec.name} <= set(existing())
        probe = ("import os, socket; print(socket.gethostname(), socket.gethostbyname('h0'), "
                 "os.environ['MCRDL_CLUSTER_HOST'], os.environ['GLOO_SOCKET_IFNAME'])")
        out = subprocess.run(a.host_argv("h1", [sys.executable, "-c", probe]), text=True,
                             capture_output=True, env=dict(os.environ, **a.env("h1")), check=True)
        assert out.stdout.split() == ["h1", "198.18.0.1", "h1", "eth0"]
        tbf = system.sh("tc", "-n", a.spec.netns("h1"), "qdisc", "show", "dev", "eth0").stdout
        assert "tbf" in tbf and "rate 1Gbit" in tbf, tbf
        assert "tbf" not in system.sh("tc", "-n", b.spec.netns("h1"), "qdisc", "show", "dev",
                                      "eth0").stdout
        names = a.spec.name, b.spec.name
    for name in names:
        _ours_gone(name)


@needs_netns
def test_ctrl_c_ends_the_program_and_removes_the_cluster(tmp_path):
    before = set(existing())
    # SIGINT as at a terminal, even where this suite runs with it ignored (a shell's
    # background job under nohup, as CI may be): a Python started with SIGINT ignored
    # installs no KeyboardInterrupt handler, and the Ctrl-C would never arrive
    proc = subprocess.Popen(MCRDL + ["cluster", "run", "--hosts", "2", "--", "sleep", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    name, deadline = None, time.monotonic() + 60
    while name is None and time.monotonic() < deadline:
        for n in set(existing()) - before:
            with open(os.path.join("/run/mcrdl/cluster", n, "state.json")) as f:
                if json.load(f)["pid"] == proc.pid:
                    name = n
        time.sleep(0.1)
    assert name, "the cluster never came up"
    # Ctrl-C once the program runs on both hosts (a fixed 1 s was too short in a fresh
    # CI clone: the signal then came while mpiexec was still starting, see issue notes)
    while len(_running(name, "sleep")) < 2 and time.monotonic() < deadline + 60:
        time.sleep(0.1)
    assert len(_running(name, "sleep")) >= 2, "the program never started on both hosts"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err
    _ours_gone(name)


@needs_netns
def test_tune_on_the_cluster_writes_entries_for_ranks_and_hosts_and_info_shows_them(tmp_path):
    """2 hosts x 1 rank tune writes a (2 ranks, 2 hosts) entry; on 2 hosts x 2 ranks
    `mcrdl info` prints the topology, and says the table holds no entry for that shape."""
    table = tmp_path / "t.json"
    proc, _ = _run(["--hosts", "2", "--rate", "10gbit"],
                   [sys.executable, "-m", "mcrdl_core.tools.cli", "tune", "--ops", "all_reduce",
                    "--sizes", "4", "64K", "--trials-scale", "0.01", "--output", str(table)],
                   tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all_reduce      n=2 hosts=2" in proc.stdout, proc.stdout
    data = json.loads(table.read_text())
    assert data["schema"] == "mcrdl.tuning/2" and data["machine"]["hosts"] == ["h0", "h1"]
    assert [(e["op"], e["world_size"], e["hosts"]) for e in data["entries"]] == \
           [("all_reduce", 2, 2)]
    proc, rep = _run(["--hosts", "2", "--ranks-per-host", "2", "--rate", "10gbit"],
                     [sys.executable, "-m", "mcrdl_core.tools.cli", "info"], tmp_path=tmp_path,
                     env={"MCRDL_TUNING_TABLE": str(table)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "topology: 2 hosts x 2 ranks (h0: ranks 0-1; h1: ranks 2-3)" in out, out
    assert "emulated cluster" in out and "links 10gbit" in out
    assert f"tuning table in force: {table}" in out, out
    assert "no entries for 4 ranks on 2 host(s)" in out and "also holds 2 ranks on 2 host(s)" in out
    assert rep["returncode"] == 0 and sorted(rep["links"]) == ["h0", "h1"]


CROSS = textwrap.dedent("""
    import numpy as np, mcrdl_core as mc
    rt = mc.init(); n, me = rt.world_size, rt.rank
    mode = "{mode}"
    count = (4 << 20) // 4  # 4 MiB of float32 per rank
    if mode == "between":   # 2 hosts x 1 rank: every all-gather crosses the links
        for be in ("mpi", "gloo"):
            x = np.full(count, me + 1, np.float32); out = np.empty(count * n, np.float32)
            mc.all_gather_into_tensor(out, x, backend=be)
            assert (out == np.repeat(np.arange(1, n + 1, dtype=np.float32), count)).all(), be
    else:                   # 2 hosts x 2 ranks: rank 0 -> 1 stays on host h0
        x = np.arange(count * 8, dtype=np.float32) if me == 0 else np.zeros(count * 8, np.float32)
        if me == 0:
            mc.send(x, 1, backend="mpi")
        elif me == 1:
            mc.recv(x, 0, backend="mpi")
            assert (x == np.arange(count * 8, dtype=np.float32)).all()
        mc.barrier(backend="mpi")
    print("rank", me, "ok", flush=True)
""")


@needs_netns
def test_bytes_cross_the_links_between_hosts_and_not_within_one(tmp_path):
    """A run that silently fell back to shared memory between hosts fails here: 2 hosts
    exchange two 4 MiB all-gathers (mpi, gloo), so each host sends >= 8 MiB on its link;
    32 MiB between two ranks of one host stay off the links (MPICH's shared memory)."""
    script = tmp_path / "cross.py"
    script.write_text(CROSS.format(mode="between"))
    proc, rep = _run(["--hosts", "2", "--rate", "10gbit"], [sys.executable, str(script)],
                     tmp_path=tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stdout + proc.stderr
    for host, c in rep["links"].items():
        assert c["sent_bytes"] >= 8 << 20 and c["received_bytes"] >= 8 << 20, (host, c)
    script.write_text(CROSS.format(mode="within"))
    proc, rep = _run(["--hosts", "2", "--ranks-per-host", "2", "--rate", "10gbit"],
                     [sys.executable, str(script)], tmp_path=tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("ok") == 4, proc.stdout + proc.stderr
    assert rep["links"]["h0"]["sent_bytes"] < 4 << 20, rep["links"]


GROUPS = textwrap.dedent("""
    import numpy as np, mcrdl_core as mc
    rt = mc.init(); n, me = rt.world_size, rt.rank
    groups = [mc.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]  # every rank, in order
    for g in groups:
        if me in g.ranks:
            x = np.full(4, me + 1, np.float32)
            mc.all_reduce(x, group=g, backend="gloo")
            assert (x == sum(r + 1 for r in g.ranks)).all(), (g.ranks, x)
    print("rank", me, "ok", flush=True)
""")


@needs_netns
def test_gloo_groups_led_by_a_rank_on_another_host_than_rank_0(tmp_path):
    """The Megatron-style groups of 2 hosts x 2 ([2, 3] and [1, 3] are led by ranks off
    rank 0's host) on Gloo, with MASTER_ADDR set as a torch launch sets it: each group's
    store is on its first member, so its address is that member's, not MASTER_ADDR's
    (which sent ranks to a port on h0 where nothing listened, until the store timed out)."""
    script = tmp_path / "groups.py"
    script.write_text(GROUPS)
    proc, rep = _run(["--hosts", "2", "--ranks-per-host", "2", "--rate", "10gbit",
                      "--timeout", "100"], [sys.executable, str(script)], tmp_path=tmp_path,
                     env={"MASTER_ADDR": "h0", "MCRDL_TIMEOUT": "30"})
    assert proc.returncode == 0 and proc.stdout.count("ok") == 4, proc.stdout + proc.stderr


# The op tests cover 8 dtypes; between hosts what changes is the transport, not the
# per-rank dtype handling, so make test runs float32 and int32 (with the bitwise
# reductions; -k "float16" also drops bfloat16) to stay within its time: a run's cost
# is mostly starting the ranks and the mixing tests, so fewer dtypes would save little.
# The full runs (every dtype) are in docs/cluster.md.
SUBSET = "not (float64 or float16 or int64 or int8 or uint8)"


def _suite_on_two_hosts(ranks_per_host, files, k, tmp_path):
    """Run tests/mpi FILES (pytest -k K) on 2 hosts x RANKS_PER_HOST at 10 Gbit/s; assert
    a clean exit and a tally from every rank; return (tallies, link report)."""
    results = tmp_path / "tallies"
    results.mkdir()
    program = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=120",
               "-o", "addopts=", "-k", k, *files]
    env = {"MCRDL_MPI_TESTS": "1", "MCRDL_TIMEOUT": "60", "MCRDL_RESULTS_DIR": str(results),
           "MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD": "2147483647"}
    proc, rep = _run(["--hosts", "2", "--ranks-per-host", str(ranks_per_host), "--rate",
                      "10gbit", "--timeout", "400"], program, timeout=480, env=env,
                     cwd=ROOT / "tests" / "mpi", tmp_path=tmp_path)
    out = proc.stdout + proc.stderr
    tallies = {int(p.stem[4:]): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    print(f"2 hosts x {ranks_per_host}: " + "; ".join(
        f"rank {r}: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped"
        for r, t in sorted(tallies.items())) + f"; links {rep and rep['links']}")
    assert proc.returncode == 0, out[-12000:]
    assert sorted(tallies) == list(range(2 * ranks_per_host)), out[-4000:]
    for r, t in tallies.items():
        assert t["failed"] == 0 and t["error"] == 0, (r, t)
    return tallies, rep


@needs_netns
@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_op_mixing_deadlock_tests_on_two_hosts(ranks_per_host, tmp_path):
    tallies, rep = _suite_on_two_hosts(
        ranks_per_host, ["test_ops.py", "test_mixing.py", "test_deadlock.py"],
        os.environ.get("MCRDL_CLUSTER_TEST_K", SUBSET), tmp_path)
    for r, t in tallies.items():
        assert t["passed"] > 100, (r, t)
        ids = t["passed_ids"]
        assert any("test_mixing.py::" in i for i in ids), (r, "mixing tests did not pass")
        deadlock = [i for i in ids if "test_deadlock.py::" in i]
        assert len(deadlock) == (2 if ranks_per_host == 1 else 0), (r, deadlock)
    for host, c in rep["links"].items():  # the tests' traffic went over the links
        assert c["sent_bytes"] > 1 << 20, (host, c)


@needs_netns
@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_compression_and_resharding_tests_on_two_hosts_of_two_ranks(tmp_path):
    """Issues 12 and 13 ask for their tests on the emulated cluster too: the compressed
    collectives (ring and a2a, the int8/fp16/none codecs, mpi and gloo) and every
    resharding test, on 2 hosts x 2 ranks, against NumPy on every rank."""
    k = ("(not test_all_gather and not test_reduce_scatter and not test_all_reduce) or "
         "((int8 or fp16 or none) and not p2p)")
    tallies, rep = _suite_on_two_hosts(2, ["test_compress.py", "test_reshard.py"], k, tmp_path)
    for r, t in tallies.items():
        ids = t["passed_ids"]
        assert any("test_compress.py::test_all_gather[int8-ring" in i for i in ids), (r, t)
        assert any("test_compress.py::test_reduce_scatter[fp16-a2a" in i for i in ids), (r, t)
        assert sum("test_reshard.py::" in i for i in ids) > 10, (r, t)
    for host, c in rep["links"].items():
        assert c["sent_bytes"] > 1 << 20, (host, c)
