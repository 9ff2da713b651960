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


class _Clock:
    """A stand-in for the engine's ``time``: ``perf_counter`` advances 10 µs a read, and
    by ``stop`` seconds once at the ``stop_at``-th nap (the process stopped while it
    slept); ``sleep`` advances by what it is asked."""

    def __init__(self, stop_at=None, stop=0.0):
        self.t, self.naps, self.stop_at, self.stop = 1000.0, 0, stop_at, stop

    def perf_counter(self):
        self.t += 1e-5
        return self.t

    def sleep(self, s):
        self.naps += 1
        self.t += s + (self.stop if self.naps == self.stop_at else 0.0)


class _DoneAfter(Work):
    """Completes at its ``n``-th poll."""

    def __init__(self, n, *a):
        super().__init__(*a)
        self.n = n

    def poll(self):
        self.n -= 1
        return self.n <= 0


def _timed_wait(monkeypatch, clock, work, timeout, broken):
    """``work`` waited under ``clock`` with the runtime's own ``timeout``; each timeout
    that would break the group is appended to ``broken``."""
    from mcrdl_core.engine import progress

    eng = ProgressEngine()
    eng.spin_s, eng.timeout = 0.0, timeout
    eng.on_timeout = lambda works, err: broken.append(err)
    with monkeypatch.context() as m:
        m.setattr(progress, "time", clock)
        eng.wait([work])


def test_time_the_process_was_stopped_is_not_counted_against_the_timeout(monkeypatch):
    """A wait whose process is stopped for 100 s in one of its naps (a paused VM: every
    rank stopped alike) still has its 2 s once it runs again; a stop the timeout
    counted would break a group whose peers did nothing wrong. Completion comes at the
    400th poll, after the stop and about 0.4 s of naps."""
    g = Group(1, [0, 1], 0, "g")
    w = _DoneAfter(400, "test", "op", g)
    clock, broken = _Clock(stop_at=20, stop=100.0), []
    _timed_wait(monkeypatch, clock, w, 2.0, broken)
    assert w.done and broken == [] and clock.t > 1100.0  # the stop did happen inside the wait


def test_a_stop_does_not_stretch_the_timeout_beyond_the_time_left(monkeypatch):
    """The same stop in a wait that never completes: the timeout fires after 2 s of the
    time the process ran, with the group broken as for any timeout."""
    from mcrdl_core.base.errors import CommTimeoutError

    g = Group(1, [0, 1], 0, "g")
    clock, broken = _Clock(stop_at=20, stop=100.0), []
    with pytest.raises(CommTimeoutError, match="did not complete within 2 s") as exc:
        _timed_wait(monkeypatch, clock, _Never("test", "op", g), 2.0, broken)
    assert broken == [exc.value]
    assert 1102.0 < clock.t < 1103.0  # 100 s stopped + 2 s counted (+ the passes' reads)
