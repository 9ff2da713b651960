"""The progress engine and the torch frontend's future machinery under threads, in one
process, with works that complete when the test says so (issue 22, items 5, 6, 10, 11).
The multi-rank counterparts are in tests/mpi/test_pg_threads.py."""
import datetime
import threading

import pytest
import torch.distributed as dist

from mcrdl_core.base.errors import BrokenGroupError, CommTimeoutError
from mcrdl_core.world.group import Group
from mcrdl_core.engine.progress import engine
from mcrdl_core.engine.work import Work
from mcrdl_torch import pg_work

HANG_S = 60  # reached only by a hang


class Gate(Work):
    """A work that completes once ``open`` is set; in flight in the engine, as an
    issued call's work is."""

    def __init__(self, group=None):
        super().__init__("test", "gate", group)
        self.open = threading.Event()
        self.keep = ("buffer",)
        engine().add(self)

    def poll(self) -> bool:
        return self.open.is_set()


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("outer", [False, True], ids=["plain", "lock-held-by-caller"])
def test_a_wait_lets_other_threads_take_the_engine_between_polls(outer):
    """Thread A waits on a work that only thread B can complete, and B needs the
    engine's lock to do it (as issuing a call does). A wait that held the lock for its
    whole length -- also when A's caller holds it, as a process group issuing a call
    does -- would keep B out until the timeout."""
    eng = engine()
    w = Gate()

    def waiter():
        if outer:
            with eng.lock:
                eng.wait([w], 30.0)
                assert eng.lock._is_owned()  # the caller's hold is back
        else:
            eng.wait([w], 30.0)

    a, box = _in_thread(waiter)

    def opener():
        with eng.lock:  # as a thread issuing a call
            w.open.set()

    b, _ = _in_thread(opener)
    a.join(HANG_S)
    b.join(HANG_S)
    assert not a.is_alive() and not b.is_alive(), "the waiter kept the engine for its whole wait"
    assert "error" not in box, box
    assert w.done and w not in eng.inflight


def test_abandon_fails_the_work_at_once_and_keeps_its_buffers():
    eng = engine()
    w = Gate()
    err = BrokenGroupError("given up")
    assert eng.abandon([w], err) == [w]
    assert w.done and w not in eng.inflight
    assert any(x is w and kept == ("buffer",) for x, kept in eng.abandoned)
    with pytest.raises(BrokenGroupError, match="given up"):
        w.wait()


@pytest.mark.parametrize("how,grace", [("aborted", 0.0), ("destroyed", 0.2)])
def test_close_group_gives_up_pending_work_without_raising(how, grace):
    """shutdown/abort of a process group whose work will never complete: returns
    after at most the grace, marks the group broken, and the work's wait raises."""
    g = Group(900, [0], 0, key=f"close-{how}")
    w = Gate(g)
    left = pg_work.close_group(g, how, grace)
    assert left == [w]
    assert g.broken is not None and how in str(g.broken)
    with pytest.raises(BrokenGroupError, match=how):
        w.wait()


def test_close_group_after_a_failure_does_not_wait():
    """A broken group's pending work is given up with no grace at all."""
    g = Group(901, [0], 0, key="close-broken")
    g.mark_broken(CommTimeoutError("earlier"))
    w = Gate(g)
    t, box = _in_thread(lambda: pg_work.close_group(g, "destroyed", HANG_S))
    t.join(HANG_S / 2)
    assert not t.is_alive() and box.get("value") == [w]


def test_close_group_lets_finishing_work_finish():
    g = Group(902, [0], 0, key="close-done")
    w = Gate(g)
    w.open.set()
    assert pg_work.close_group(g, "destroyed", 5.0) == []
    assert g.broken is None and w.is_success()


def test_a_blocked_callback_does_not_hold_up_the_next_completion():
    pool = pg_work._Callbacks()
    release, second = threading.Event(), threading.Event()
    pool.submit(lambda: release.wait(HANG_S))
    pool.submit(second.set)
    try:
        assert second.wait(HANG_S / 2), "the second job waited behind the blocked one"
    finally:
        release.set()
    # an idle thread is reused
    third = threading.Event()
    pool.submit(third.set)
    assert third.wait(HANG_S / 2)


def test_future_deadline_fires_while_a_callback_blocks():
    """A PGWork future whose work never completes fails at its deadline even though a
    callback of another future is blocked meanwhile."""
    blocked_work = pg_work.PGWork([Gate()], ["a"], timeout=30.0)
    stuck = pg_work.PGWork([Gate()], ["b"], timeout=0.5)
    release, entered = threading.Event(), threading.Event()
    first = blocked_work.get_future().then(lambda f: (entered.set(), release.wait(HANG_S)))
    blocked_work._works[0].open.set()
    try:
        assert entered.wait(HANG_S / 2)
        fut = stuck.get_future()
        t, box = _in_thread(fut.wait)
        t.join(HANG_S / 2)
        assert not t.is_alive(), "the deadline never fired"
        err = box.get("error")
        assert isinstance(err, dist.DistBackendError) and "within 0.5 s" in str(err), box
    finally:
        release.set()
        stuck._works[0].open.set()
    first.wait()


def test_wait_completes_the_future_before_it_returns():
    w = pg_work.PGWork([Gate()], ["value"], timeout=30.0)
    fut = w.get_future()
    w._works[0].open.set()
    w.wait()
    assert fut.done() and fut.value() == ["value"]


def test_explicit_wait_timeout_is_a_dist_backend_error_and_leaves_the_work():
    w = pg_work.PGWork([Gate()], [], timeout=None)
    with pytest.raises(dist.DistBackendError) as info:
        w.wait(datetime.timedelta(seconds=0.2))
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, TimeoutError)
    assert isinstance(err, CommTimeoutError) and "within 0.2 s" in str(err)
    assert not w.is_completed()
    w._works[0].open.set()
    assert w.wait() and w.is_success()


def test_comm_timeout_error_is_a_runtime_error():
    assert issubclass(CommTimeoutError, RuntimeError) and issubclass(CommTimeoutError, TimeoutError)


def test_dist_error_keeps_type_and_message():
    err = pg_work.dist_error(CommTimeoutError("late"))
    assert isinstance(err, CommTimeoutError) and isinstance(err, dist.DistBackendError)
    assert str(err) == "late"
    plain = ValueError("not ours")
    assert pg_work.dist_error(plain) is plain


def test_which_timeout_a_process_group_gets(monkeypatch):
    """The user's explicit timeout, then MCRDL_TIMEOUT, then torch's default (which
    torch passes when the user gave none)."""
    default = dist.constants.default_pg_timeout
    monkeypatch.setenv("MCRDL_TIMEOUT", "45")
    assert pg_work.seconds(default) is None  # MCRDL_TIMEOUT wins over torch's default
    assert pg_work.seconds(datetime.timedelta(seconds=5)) == 5.0
    assert pg_work.seconds(None) is None and pg_work.seconds(datetime.timedelta(0)) is None
    monkeypatch.delenv("MCRDL_TIMEOUT")
    assert pg_work.seconds(default) == default.total_seconds()


def test_the_engine_takes_a_groups_timeout(monkeypatch):
    eng = engine()
    monkeypatch.setattr(eng, "on_timeout", None)  # no runtime's fault handling here
    g = Group(903, [0], 0, key="timeout-of")
    g.timeout = 0.3
    w = Gate(g)
    assert eng.timeout_of([w]) == 0.3
    assert eng.timeout_of([Gate()]) == eng.timeout
    with pytest.raises(CommTimeoutError, match="within 0.3 s"):
        w.wait()
    w.open.set()
    w.test()
