"""The NCCL backend's communicator life cycle and Work, run on the CPU.

CuPy's CUDA calls and NCCL itself are replaced at the library boundary by small fakes
that record what they are asked to do (a stream is a handle, an event is "done after
k queries", a communicator logs its calls); everything above that boundary is the
backend's real code: placement check, NCCL_RUNTIME_CONNECT, p2p pre-connection on the
helper thread, process-lifetime streams, abort of a failed communicator, the pending
list that keeps buffers until the GPU is done, the all-to-all size check."""
import gc
import os
import threading
import weakref

import pytest

import mcrdl_backends.nccl as nccl_be
from mcrdl_backends.nccl import NCCLBackend, NCCLError, NCCLWork, _Comm
from mcrdl_core.memory import cuda as mc_cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.world.bootstrap import Bootstrap
from mcrdl_core.memory.buffer import Buffer, Device
from mcrdl_core.base.errors import InvalidArgumentError, UnsupportedError
from mcrdl_core.world.group import Group
from mcrdl_core.base.ops import Op
from mcrdl_core.engine.progress import ProgressEngine


# --- fakes at the CuPy / NCCL boundary ------------------------------------------------------
class FakeEvent:
    """done after ``polls`` queries (or when ``finish()`` is called)."""

    def __init__(self, polls=0):
        self.left = polls

    @property
    def done(self):
        self.left -= 1
        return self.left < 0

    def record(self, stream=None):
        pass

    def finish(self):
        self.left = 0


class FakeStream:
    count = 0

    def __init__(self, non_blocking=False, ptr=None):
        FakeStream.count += 1
        self.ptr = ptr if ptr is not None else 0x1000 + FakeStream.count
        self.waited = []
        self.synced = []

    def wait_event(self, ev):
        self.waited.append(ev)

    def synchronize(self):
        self.synced.append(threading.current_thread().name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCupy:
    """What the backend asks of ``cupy.cuda`` here."""

    def __init__(self, pci="0000:01:00.0"):
        cp = self

        class Device:
            def __init__(self, index=0):
                self.pci_bus_id = pci

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Stream(FakeStream):
            null = FakeStream(ptr=0)

            @classmethod
            def from_external(cls, obj):  # the stream with that handle
                ptr = obj.__cuda_stream__()[1]
                return cp.current if ptr == cp.current.ptr else FakeStream(ptr=ptr)

        class _Handle:
            def __init__(self, ptr):
                self.ptr = ptr

            def __cuda_stream__(self):
                return (0, self.ptr)

        def external_stream(ptr, device=-1):  # CuPy < 14's constructor
            return Stream.from_external(_Handle(ptr))

        class Runtime:
            @staticmethod
            def getDevice():
                return 0

        class Event(FakeEvent):
            def __init__(self, block=False, disable_timing=True):
                super().__init__(0)

        self.cuda = type("cuda", (), {"Device": Device, "Stream": Stream, "runtime": Runtime,
                                      "Event": Event, "ExternalStream": staticmethod(external_stream),
                                      "get_current_stream": staticmethod(lambda device_id=-1: cp.current)})
        self.current = FakeStream(ptr=0x77)
        self.uint8 = "uint8"

    def zeros(self, n, dtype=None):
        return type("arr", (), {"data": type("mem", (), {"ptr": 0x5000})()})()


class FakeNcclComm:
    def __init__(self, log, size, uid, rank):
        self.log = log
        self.error = None
        log.append(("init", size, rank, os.environ.get("NCCL_RUNTIME_CONNECT"),
                    threading.current_thread().name))

    def send(self, ptr, count, dtype, peer, stream):
        self.log.append(("send", peer, count, threading.current_thread().name))

    def recv(self, ptr, count, dtype, peer, stream):
        self.log.append(("recv", peer, count, threading.current_thread().name))

    def check_async_error(self):
        if self.error:
            raise RuntimeError(self.error)

    def destroy(self):
        self.log.append(("destroy",))

    def abort(self):
        self.log.append(("abort",))


class FakeNccl:
    """Stands in for ``cupy.cuda.nccl``."""
    NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 0, 7, 0

    def __init__(self):
        self.log = []
        self.comms = []
        outer = self

        class NcclCommunicator(FakeNcclComm):
            def __init__(self, size, uid, rank):
                super().__init__(outer.log, size, uid, rank)
                outer.comms.append(self)

        self.NcclCommunicator = NcclCommunicator

    def groupStart(self):
        self.log.append(("groupStart",))

    def groupEnd(self):
        self.log.append(("groupEnd",))

    def get_unique_id(self):
        return b"\x01" * 128

    class NcclError(Exception):
        pass


class FakeBootstrap(Bootstrap):
    """Answers the placement gather with what ``where`` says the members use."""

    def __init__(self, where):
        self.where = where

    def group_allgather(self, obj, ranks):
        return list(self.where)

    def hostname(self):
        return "h"


class FakeRuntime:
    def __init__(self, bootstrap, groups):
        self.bootstrap = bootstrap
        self.engine = ProgressEngine()
        self.groups = groups


@pytest.fixture
def fakes(monkeypatch):
    """Fake CuPy and NCCL behind the real backend; fresh stream caches."""
    cp, nccl = FakeCupy(), FakeNccl()
    monkeypatch.setattr(mc_cuda, "cupy", lambda: cp)
    monkeypatch.setattr(mc_cuda, "_WRAPPERS", {}, raising=False)
    monkeypatch.setattr(mc_cuda, "_LASTING", {}, raising=False)
    monkeypatch.setattr(nccl_be, "_LIB", [(nccl, None)])
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    monkeypatch.delenv("MCRDL_NCCL_PRECONNECT", raising=False)
    return cp, nccl


def _backend(where, ranks=(0, 1), me=0, gid=3):
    g = Group(gid, ranks, me, "pair")
    rt = FakeRuntime(FakeBootstrap(where), [g])
    return NCCLBackend(rt), g


# --- item 15: availability does not count GPUs per host; placement decides -------------------
def test_placement_verdict_from_gathered_host_and_pci_ids():
    g = Group(0, [0, 1, 2], 0)
    own = [("a", "0000:01:00.0"), ("a", "0000:02:00.0"), ("b", "0000:01:00.0")]
    assert nccl_be.shared_gpu_reason(g, own) is None  # one GPU each (the same bus id on two hosts)
    shared = [("a", "0000:01:00.0"), ("b", "0000:01:00.0"), ("a", "0000:01:00.0")]
    why = nccl_be.shared_gpu_reason(g, shared)
    assert "ranks 0 and 2" in why and "0000:01:00.0 on a" in why and "backend='mpi'" in why


def test_ranks_that_each_see_only_their_own_gpu_keep_nccl(monkeypatch, fakes):
    """CUDA_VISIBLE_DEVICES / --gpus-per-task=1: 4 ranks on a host, 1 visible GPU each."""
    monkeypatch.setattr(mc_cuda, "device_reason", lambda: None)
    monkeypatch.setattr(mc_cuda, "device_count", lambda: 1)
    monkeypatch.setattr(NCCLBackend, "_reasons", type(NCCLBackend._reasons)())
    bs = Bootstrap()
    bs.local_size = 4
    assert NCCLBackend.unavailable_reason(bs) is None


def test_creation_refuses_a_shared_gpu_on_every_member_before_nccl_is_called(fakes):
    _, nccl = fakes
    be, g = _backend([("h", "0000:01:00.0"), ("h", "0000:01:00.0")])
    with pytest.raises(UnsupportedError, match="ranks 0 and 1 of group 'pair'.*both use GPU"):
        be._create(g, 0)
    assert nccl.log == []  # no communicator, no connection


# --- items 19 and 21: eager connection, p2p pre-connection, lasting streams -------------------
def test_creation_connects_eagerly_and_preconnects_peers_off_the_calling_thread(fakes):
    cp, nccl = fakes
    be, g = _backend([("h", "0000:01:00.0"), ("h", "0000:02:00.0")])
    comm = be._create(g, 0)
    init = [e for e in nccl.log if e[0] == "init"]
    assert init == [("init", 2, 0, "0", init[0][4])]  # NCCL_RUNTIME_CONNECT=0 before it
    helper = init[0][4]
    assert helper != threading.current_thread().name
    p2p = [e for e in nccl.log if e[0] != "init"]
    assert p2p == [("groupStart",), ("send", 1, 1, helper), ("recv", 1, 1, helper),
                   ("groupEnd",)]
    assert comm.stream.synced == [helper]  # the helper thread waited, not this one


def test_user_settings_win(monkeypatch, fakes):
    _, nccl = fakes
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    monkeypatch.setenv("MCRDL_NCCL_PRECONNECT", "0")
    be, g = _backend([("h", "A"), ("h", "B")])
    be._create(g, 0)
    assert [e[3] for e in nccl.log if e[0] == "init"] == ["1"]
    assert [e for e in nccl.log if e[0] in ("send", "recv")] == []
    assert not nccl_be.preconnect_wanted(1)
    monkeypatch.delenv("MCRDL_NCCL_PRECONNECT")
    assert nccl_be.preconnect_wanted(16) and not nccl_be.preconnect_wanted(17)


def test_comm_streams_outlive_their_communicators(fakes):
    be, g = _backend([("h", "A"), ("h", "B")])
    g.comms["nccl"] = be._create(g, 0)
    stream = weakref.ref(g.comms["nccl"].stream)
    be.destroy()
    gc.collect()
    assert stream() is not None, "the stream torch may have recorded tensors on was freed"
    assert be._create(g, 0).stream is stream()  # the group's next communicator reuses it


# --- item 16: a failed communicator is aborted, never destroyed --------------------------------
@pytest.mark.parametrize("how", ["async error now", "failed earlier", "healthy"])
def test_shutdown_aborts_a_failed_communicator(fakes, how):
    _, nccl = fakes
    be, g = _backend([("h", "A"), ("h", "B")])
    comm = g.comms["nccl"] = be._create(g, 0)
    if how == "async error now":
        comm.nccl.error = "remote process exited"
    elif how == "failed earlier":
        with pytest.raises(NCCLError):
            comm.nccl.error = "boom"
            comm.check(Op.ALL_REDUCE)
        comm.nccl.error = None  # NCCL reports it once; the communicator stays broken
    be.destroy()
    assert nccl.log[-1] == (("destroy",) if how == "healthy" else ("abort",))
    assert "nccl" not in g.comms


# --- item 20: waited work is kept until the GPU is done -----------------------------------------
class Owner:
    """The memory behind a buffer (a weakref tells when nothing holds it)."""


def _work(comm, g, event, eng):
    owner = Owner()
    buf = Buffer(0x9000, (4,), dt.float32, Device("cuda", 0), owner=owner)
    w = NCCLWork(Op.ALL_REDUCE, g, event, comm, [buf], caller=0)
    eng.add(w)
    return w, weakref.ref(owner)


def test_waited_work_keeps_its_buffers_until_the_event_completes(fakes):
    cp, _ = fakes
    g = Group(1, [0, 1], 0, "pair")
    comm = _Comm(FakeNcclComm([], 2, b"", 0), 0, FakeStream(), g)
    eng = ProgressEngine()
    ev = FakeEvent(10 ** 9)
    w, alive = _work(comm, g, ev, eng)
    assert w.wait() is True  # returns at once: the caller's stream waits on the event
    assert cp.current.waited == [ev]
    del w  # the caller lets go of its Work (a blocking call never returns it)
    gc.collect()
    assert alive() is not None, "buffers were released while the GPU may still read them"
    assert len(eng.pending) == 1 and eng.inflight == []
    eng.reap()
    assert alive() is not None
    ev.finish()
    eng.progress()  # any progress loop reaps
    gc.collect()
    assert eng.pending == [] and alive() is None


def test_pending_work_reports_an_async_error_once_and_holds_its_buffers(fakes):
    g = Group(1, [0, 1], 0, "pair")
    comm = _Comm(FakeNcclComm([], 2, b"", 0), 0, FakeStream(), g)
    eng = ProgressEngine()
    w, alive = _work(comm, g, FakeEvent(10 ** 9), eng)
    w.wait()
    del w
    comm.nccl.error = "unhandled cuda error"
    with pytest.raises(NCCLError, match="all_reduce on group 'pair' .*failed asynchronously"):
        eng.reap()
    eng.reap()  # reported once
    assert eng.pending == []
    gc.collect()
    assert alive() is not None  # the failed op may still touch them: kept until abort
    assert comm.close() == "aborted" and comm.held == []


def test_work_completed_by_polling_is_not_kept(fakes):
    g = Group(1, [0, 1], 0, "pair")
    comm = _Comm(FakeNcclComm([], 2, b"", 0), 0, FakeStream(), g)
    eng = ProgressEngine()
    w, alive = _work(comm, g, FakeEvent(2), eng)
    eng.wait([w], timeout=5)
    gc.collect()
    assert eng.pending == [] and alive() is None


def test_shutdown_waits_for_pending_ops_before_destroying(fakes):
    _, nccl = fakes
    be, g = _backend([("h", "A"), ("h", "B")])
    comm = g.comms["nccl"] = be._create(g, 0)
    w, alive = _work(comm, g, FakeEvent(50), be.rt.engine)
    w.wait()
    assert be.rt.engine.pending == [w]
    be.destroy()
    assert be.rt.engine.pending == [] and nccl.log[-1] == ("destroy",)


# --- item 17: all-to-all's own block --------------------------------------------------------------
def test_all_to_all_refuses_unequal_own_block_before_any_launch(monkeypatch, fakes):
    be, g = _backend([("h", "A"), ("h", "B")])
    launched = []
    monkeypatch.setattr(be, "_issue", lambda *a, **k: launched.append(a))
    cuda = Device("cuda", 0)
    inp = Buffer(0x1000, (4,), dt.float32, cuda)
    out = Buffer(0x2000, (4,), dt.float32, cuda)
    with pytest.raises(InvalidArgumentError, match=r"rank 0 sends itself 1 elements but "
                                                   r"expects 2 .*split sizes"):
        be.all_to_all(g, out, inp, [2, 2], [1, 3])
    assert launched == []
    be.all_to_all(g, out, inp, [1, 3], [1, 3])  # equal own block: issued
    assert len(launched) == 1


# --- item 23: the grouped batch ---------------------------------------------------------------------
def test_batch_p2p_is_one_nccl_group(monkeypatch, fakes):
    _, nccl = fakes
    be, g = _backend([("h", "A"), ("h", "B")])
    issued = []

    def issue(op, group, bufs, enqueue, desc=""):
        enqueue(FakeNcclComm(nccl.log, 2, b"", 0), 0)
        issued.append((op, len(bufs), desc))
        return "work"

    monkeypatch.setattr(be, "_issue", issue)
    cuda = Device("cuda", 0)
    a = Buffer(0x1000, (4,), dt.float32, cuda)
    b = Buffer(0x2000, (3,), dt.int16, cuda)  # not an NCCL type: moved as bytes
    assert be.batch_p2p(g, [(a, 1)], [(b, 1)]) == "work"
    calls = [e[:3] for e in nccl.log if e[0] != "init"]
    assert calls == [("groupStart",), ("send", 1, 4), ("recv", 1, 6), ("groupEnd",)]
    assert issued == [(Op.SEND, 2, "batch of 1 sends, 1 receives")]
    with pytest.raises(InvalidArgumentError):
        be.batch_p2p(g, [], [])

