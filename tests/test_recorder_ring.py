"""The flight recorder's two rings, side by side (observe/ring.c and recorder.PyRing):
the same calls give the same slots (ticks, sequence numbers, counts, extras, outcomes,
which entries ended), through a wrap-around, a refused call, a call not done within its
spin, stale ticks and the wrapped issuer the fast path records through. No MPI: the
groups are plain objects with the two counters."""
import pytest

from mcrdl_core.observe import recorder as rec


class _Group:
    def __init__(self):
        self.trace_seq = 0
        self.trace_p2p = 0


def _native(size):
    ring = rec.native(size)
    if ring is None:
        pytest.skip("observe/ring.c is not built (python -m mcrdl_core.tools.build_ring)")
    return ring


@pytest.fixture
def rings():
    """(the compiled ring made anew with 4 slots, a PyRing of 4); the process's ring is
    made anew afterwards (its entries are a test's, none of this one's)."""
    yield _native(4), rec.PyRing(4)
    if rec.NATIVE is not None:
        rec.NATIVE.init(rec.SIZE)


def _script(ring):
    """One sequence of calls on ``ring``; returns (its slots without times, which
    ended, the groups' counters)."""
    g, h = _Group(), _Group()
    coll = rec.describe(g, "all_reduce", None, "mpi")
    p2p = rec.describe(h, "send", None, "mpi")
    t0 = ring.note(coll, 4)
    ring.end(t0)
    t1 = ring.note(p2p, 2, (1, 7))
    ring.outcome(t1, "work")
    t2 = ring.note(coll, 8)
    ring.forget(t2, coll)  # taken back: g's count too
    done = ring.recorded(lambda spin, ptr, count: None, coll, 2, 3, ())
    assert done(0.0, 123, 5) is None  # count 15, ended
    refused = ring.recorded(lambda spin, ptr, count: False, coll, 2, 1, ())
    assert refused(0.0, 1, 9) is False  # no entry, g's count back
    source = ring.recorded(lambda spin, ptr, count, peer, tag: 1, p2p, 2, 1, (3, 4))
    assert source(0.0, 1, 6, 1, 9) == 1  # a receive's source: ended
    pending = object()
    slow = ring.recorded(lambda spin: pending, coll, -1, 1, ())
    assert slow(0.0) is pending  # not done within the spin: issued
    open_slots = [s for s in _slots(ring) if s[1] is coll and s[4] < s[3]]
    assert len(open_slots) == 1
    ring.end_of(coll)  # its wait returned
    ring.end(t0)  # stale: t0's slot holds a later call now (4 slots, 6 calls since)
    ring.outcome(t1, "stale")
    ring.note(p2p, 3)  # the 7th call: t1's slot (tick 1) taken by tick ... wraps
    slots = _slots(ring)
    return ([(s[0], s[1][1], s[2], s[5], s[6], s[7]) for s in slots],
            [s[4] >= s[3] for s in slots], (g.trace_seq, h.trace_p2p))


def _slots(ring):
    return [tuple(x)[:8] for x in ring.slots()]


def test_the_two_rings_agree(rings):
    native, python = rings
    got_c, got_py = _script(native), _script(python)
    assert got_c == got_py
    slots, ended, counters = got_py
    # ticks 0-8 made, tick 2 and the refused call's forgotten; 4 slots keep the newest
    assert [s[0] for s in slots] == [5, 6, 7]
    assert [s[1] for s in slots] == ["send", "all_reduce", "send"]
    assert slots[0][4] == (1, 9) and slots[0][3] == 6  # the receive-like call's extra
    assert ended == [True, True, False]  # the slow call ended by end_of; the last issued
    assert counters == (3, 3)  # g: t0, done, slow; h: t1, source, the last


def test_a_refused_call_leaves_no_number(rings):
    for ring in rings:
        g = _Group()
        d = rec.describe(g, "all_gather", None, "mpi")
        ring.recorded(lambda spin, a: False, d, 1, 1, ())(0.0, 4)
        assert g.trace_seq == 0 and not [s for s in ring.slots() if s[1] is d]


def test_bad_arguments_say_what_is_wanted(rings):
    native, _ = rings
    with pytest.raises(TypeError, match="desc"):
        native.note(("not", "a", "desc"), 1)
    with pytest.raises(TypeError, match="note\\(desc, count"):
        native.note(rec.describe(_Group(), "barrier", None, "mpi"))
    with pytest.raises(ValueError, match="at least one slot"):
        native.init(0)


class _Work:
    def __init__(self, done, error=None, t_done=None):
        self.done, self.error = done, error
        if t_done is not None:
            self.t_done = t_done


def test_done_works_are_let_go_four_calls_later(rings):
    """A done async Work leaves the ring 4 calls after its own (its end: its t_done, or
    the time the ring saw it done); one in flight or failed stays."""
    for ring in (_native(16), rec.PyRing(16)):
        g = _Group()
        d = rec.describe(g, "all_reduce", None, "mpi")
        ok, flying, failed = _Work(True, t_done=1e12), _Work(False), _Work(True, "boom")
        bare = _Work(True)  # (a compiled Work keeps no t_done)
        for w in (ok, flying, failed, bare):
            ring.note(d, 1, None, w)
        assert [s[7] for s in ring.slots()] == [ok, flying, failed, bare]
        for _ in range(4):
            ring.note(d, 1)  # ticks 4-7 look at ticks 0-3
        s = {x[0]: x for x in ring.slots()}
        assert s[0][7] == "async" and s[0][4] == 1e12
        assert s[1][7] is flying and s[2][7] is failed
        assert s[3][7] == "async" and s[3][4] < s[3][3]  # (done; its end unknown)


def test_a_call_taken_back_after_its_slot_went_keeps_the_numbers(rings):
    """A refused call whose slot another call took meanwhile (a ring of 1, or threads
    going round it) still gives its number back: else this rank numbers the group's
    later calls one higher than its peers."""
    for ring in (_native(1), rec.PyRing(1)):
        g, h = _Group(), _Group()
        a = rec.describe(g, "all_reduce", None, "mpi")
        b = rec.describe(h, "all_reduce", None, "mpi")
        t = ring.note(a, 1)
        ring.note(b, 1)  # takes the only slot
        ring.forget(t, a)
        assert (g.trace_seq, h.trace_seq) == (0, 1)
        assert [x[1] for x in ring.slots()] == [b]  # b's entry stays

        def refused_after_another(spin):
            ring.note(b, 1)  # (another thread's call while this one ran)
            return False
        ring.recorded(refused_after_another, a, -1, 1, ())(0.0)
        assert (g.trace_seq, h.trace_seq) == (0, 2)


def test_a_ring_made_anew_during_a_call(rings):
    """init() while a recorded call runs (another thread): the call ends without
    touching the old ring's memory, and the new ring works."""
    native = _native(8)
    g = _Group()
    d = rec.describe(g, "all_reduce", None, "mpi")

    def remakes(spin):
        native.init(2)
        return None
    assert native.recorded(remakes, d, -1, 1, ())(0.0) is None
    native.note(d, 1)
    assert len(native.slots()) == 1
