"""Peers that exited, seen by a wait before the timeout (issue 22 item 12): the probe
itself, on processes of this machine (a live one, a reaped one, a zombie), and what the
engine does with its answer. The 2-rank cases where a peer really dies are in
tests/faults/plan.py (crash_*: CommFailedError before MCRDL_TIMEOUT, 3 s)."""
import subprocess
import sys
import time

import pytest

from mcrdl_core.world import bootstrap as bs
from mcrdl_core.base.errors import BrokenGroupError, CommFailedError
from mcrdl_core.world.group import Group
from mcrdl_core.engine.progress import ProgressEngine
from mcrdl_core.engine.work import Work

ME = bs.process_identity()
pytestmark = pytest.mark.skipif(ME is None, reason="needs Linux /proc")


def _boot(*idents, rank=0):
    b = bs.Bootstrap()
    b.rank, b.size = rank, len(idents)
    b._set_hosts([("h", i) for i in idents])
    return b


def test_exited_names_only_dead_processes_of_this_machine():
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: no /proc entry left
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while bs._pid_alive(zombie.pid):  # exited but not reaped: state Z
        time.sleep(0.01)
    try:
        elsewhere = ("another boot id", ME[1], done.pid)
        b = _boot(ME, ME[:2] + (live.pid,), ME[:2] + (done.pid,), ME[:2] + (zombie.pid,),
                  elsewhere, None)
        assert b.exited(range(6)) == [2, 3]
        assert b.exited([0, 1, 4, 5]) == []
    finally:
        live.kill()
        live.wait()
        zombie.wait()


def test_no_probe_without_identities():
    assert bs.Bootstrap().exited([0]) == []
    assert _boot(None, ME, rank=0).exited([0, 1]) == []


class _Never(Work):
    def poll(self):
        return False


def test_wait_raises_the_checks_error_before_the_timeout():
    eng = ProgressEngine()
    eng.timeout = 30.0
    g = Group(1, [0, 1], 0, "g")
    gone = CommFailedError("rank 1 exited")
    seen = []
    eng.peer_check = lambda works: gone if works and works[0].group is g else None
    eng.on_timeout = lambda works, err: seen.append((works, err))
    w = _Never("test", "op", g)
    t0 = time.perf_counter()
    with pytest.raises(CommFailedError, match="rank 1 exited"):
        eng.wait([w])
    assert time.perf_counter() - t0 < 5.0
    assert seen and seen[0][0] == [w] and seen[0][1] is gone


def test_runtime_check_fails_work_of_a_group_broken_meanwhile():
    from mcrdl_core.dispatch.runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt.rank, rt.bootstrap = 0, _boot(ME, ME)
    g = Group(1, [0, 1], 0, "g")
    w = _Never("mpi", "all_reduce", g)
    assert rt.peers_gone([w]) is None
    g.mark_broken(CommFailedError("gloo: connection closed by peer"))
    err = rt.peers_gone([w])
    assert isinstance(err, BrokenGroupError) and "connection closed" in str(err)
