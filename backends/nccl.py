"""NCCL backend, through ``cupy.cuda.nccl``. CUDA buffers only.

This module imports without CuPy, NCCL or a GPU: ``NCCLBackend.unavailable_reason``
then says exactly what is missing (CuPy not installed, no usable CUDA device, or the
NCCL library not loadable by CuPy). How many GPUs a rank *sees* decides nothing: with
CUDA_VISIBLE_DEVICES or Slurm's ``--gpus-per-task=1`` each rank sees only its own.

Communicators
    One NCCL communicator per group, created on the group's first NCCL call by its
    members and cached in ``group.comms`` (never one per call). Group rank 0 makes the
    unique id (``nccl.get_unique_id``); the core's bootstrap carries it to the other
    members (``share_unique_id``, collective over the members only). Before NCCL is
    called, the members exchange (host, PCI bus id) of the GPU each uses and two ranks
    on one GPU are refused, both named, on every member alike (``shared_gpu_reason``;
    NCCL needs a GPU per rank; ``backend='mpi'``/``'gloo'`` serve ranks sharing one).
    ``ncclCommInitRank`` blocks until every member has joined, so it runs on a helper
    thread while the calling thread keeps driving the progress loop. Connections are
    opened there too, never later on the calling thread inside a collective's
    ``ncclGroupEnd`` (where the thread would stop driving MPI): ``NCCL_RUNTIME_CONNECT=0``
    is set before the first communicator (unless the user set it), and the p2p
    connections, which NCCL always opens lazily, are opened by a one-byte exchange with
    every peer (``MCRDL_NCCL_PRECONNECT``; by default for groups of up to 16 ranks).
    The communicator lives on the device of the buffer that created it; a later call on
    that group with a buffer on another device is refused. At shutdown a communicator is
    destroyed, or aborted if it failed (``ncclCommDestroy`` would wait forever).

Stream and event semantics (enforced here and in ``mcrdl_core.memory.cuda``)
    1. Producer -> communication. Each communicator owns one communication stream (a
       non-blocking stream on its device, kept for the process lifetime: torch may still
       refer to it through ``record_stream``). Before an op is enqueued, an event is
       recorded on the *producer stream* of every buffer of the call and the
       communication stream waits on it (``cudaStreamWaitEvent``: no host wait). The
       producer stream is ``mcrdl_core.memory.cuda.producer_stream``: the stream a DLPack
       producer was asked to synchronize with (JAX arrays, and any array converted
       through DLPack, are made ready on CuPy's current stream that way), else torch's
       current stream for a torch tensor, else CuPy's current stream.
    2. Communication -> caller. After the op an event is recorded on the communication
       stream: the Work's event. A blocking call (``async_op=False``) and ``Work.wait()``
       make the caller's *current* stream (torch's for torch tensors, CuPy's otherwise)
       wait on that event and return at once, without blocking the host, as torch's NCCL
       backend does. Finalizers of the call (the core's list-form copies) run then,
       enqueued on that same stream, so they follow the op. ``is_completed()`` and
       ``test()`` query the event.
    3. Switching to a host library. MPI and Gloo only touch CUDA memory once an event
       recorded on the producer stream — which by rule 2 follows the NCCL op — has
       completed, and they wait for it by *querying* it from the progress loop
       (``mcrdl_core.memory.cuda.ready`` / ``HostStage``). An NCCL work still in flight that
       conflicts with a later call is waited for by the runtime the same way (the
       progress loop queries its event and checks NCCL's asynchronous error). Nothing
       calls a blocking synchronize while MPI work is in flight. ``barrier()`` is the
       one NCCL op whose wait blocks the host, through the progress loop, as torch's.
    4. Memory lifetime. torch tensors of a call are recorded on the communication
       stream (``Tensor.record_stream``) so torch's caching allocator cannot hand their
       memory out again before NCCL is done with it. Every buffer of a call (CuPy and
       JAX memory, the core's temporaries) stays referenced until the op's event has
       completed: by the Work while in flight, and after a ``wait()`` that returned
       before the GPU finished, by the progress engine's pending list
       (``ProgressEngine.defer``), which the engine polls on every later wait.
    5. Errors. An NCCL call that fails raises at once, naming op and group. Each poll of
       an unfinished op calls ``check_async_error`` on its communicator and raises what
       it finds as :class:`NCCLError` naming the op, so a dead peer surfaces instead of a
       wait that ends only at the timeout. An op already waited on reports its error
       from the pending list: at the next call that drives the progress engine.

Ops
    send/recv (NCCL has no tags: messages between two ranks arrive in order; any-source
    recv is refused), broadcast, reduce and all-reduce (in place), all-gather,
    reduce-scatter, and all-to-all (even and uneven), gather and scatter as grouped
    send/recv inside ``groupStart``/``groupEnd`` (the rank's own block is copied with
    ``cudaMemcpyAsync`` on the communication stream; its two split sizes must agree);
    ``batch_p2p`` (``mcrdl_core.dispatch.p2p.batch_isend_irecv``) issues a batch of sends and
    receives as one group; barrier is an all-reduce of one float on a scratch buffer. Data types: int8, uint8, int32, int64, float16, bfloat16,
    float32, float64; data-movement ops move any other dtype as bytes. ReduceOps: SUM,
    PRODUCT, MIN, MAX and AVG (``ncclAvg``, NCCL >= 2.10); BAND/BOR/BXOR do not exist in
    NCCL and are refused with a reason (mpi and gloo have them).
"""
from __future__ import annotations

import os
import time
import warnings

from mcrdl_core.memory import cuda as _cuda
from mcrdl_core.dispatch import validate as _v
from mcrdl_core.world.backend import Backend
from mcrdl_core.base.errors import InvalidArgumentError, McrdlError, UnsupportedError
from mcrdl_core.base.ops import BITWISE, REDUCING, Op, ReduceOp
from mcrdl_core.engine.progress import engine as _engine
from mcrdl_core.engine.work import EventWork, ThreadWork

#: MCR-DL dtype name -> attribute of cupy.cuda.nccl
NCCL_TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
              "int64": "NCCL_INT64", "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16",
              "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
#: ReduceOp -> attribute of cupy.cuda.nccl (the bitwise ops have none)
NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.PRODUCT: "NCCL_PROD", ReduceOp.MIN: "NCCL_MIN",
            ReduceOp.MAX: "NCCL_MAX", ReduceOp.AVG: "NCCL_AVG"}
AVG_MIN_VERSION = 21000  # ncclAvg appeared in NCCL 2.10
D2D = 3  # cudaMemcpyDeviceToDevice


class NCCLError(McrdlError, RuntimeError):
    """NCCL reported an error (at the call, or asynchronously while the op ran)."""


_LIB: list = []  # memo: [(module or None, reason or None)]


def nccl_library():
    """(cupy.cuda.nccl, None) if NCCL can be loaded through CuPy, else (None, why not)."""
    if not _LIB:
        reason = _cuda.cupy_reason()
        mod = None
        if reason is None:
            with warnings.catch_warnings():  # CuPy warns when libnccl is missing; we say it
                warnings.simplefilter("ignore")
                try:
                    from cupy.cuda import nccl as mod
                except ImportError as exc:
                    mod, reason = None, str(exc)
            if mod is not None and not getattr(mod, "available", False):
                try:  # the import error names the missing shared library
                    from cupy_backends.cuda.libs import nccl as _raw  # noqa: F401
                    detail = "unknown reason"
                except ImportError as exc:
                    detail = str(exc)
                mod, reason = None, detail
            if reason is not None:
                major = _cuda_major()
                extra = "gpu" if major == 12 else f"gpu-cuda{major}"
                reason = (f"the NCCL library cannot be loaded by CuPy ({reason}); install it "
                          f"with pip install nvidia-nccl-cu{major} (part of 'mcr-dl[{extra}]')")
        _LIB.append((mod, reason))
    return _LIB[0]


def _cuda_major() -> int:
    """The CUDA major version CuPy was built for (12 or 13: the suffix of the NCCL wheel
    it loads), 12 if CuPy cannot say."""
    try:
        return _cuda.cupy().cuda.runtime.runtimeGetVersion() // 1000
    except Exception:  # noqa: BLE001 - no CUDA runtime library: name the default wheel
        return 12


def _nccl():
    mod, reason = nccl_library()
    if mod is None:
        raise NCCLError(reason)
    return mod


def id_bytes(uid) -> bytes:
    """An NCCL unique id as bytes (CuPy >= 14 returns bytes, older CuPy a tuple of
    signed chars)."""
    return uid if isinstance(uid, bytes) else bytes(int(x) & 0xFF for x in uid)


def share_unique_id(bootstrap, ranks, make_id=None):
    """The NCCL unique id of the group of global ``ranks``: made by ``make_id`` (default
    ``nccl.get_unique_id``) on ``ranks[0]`` and carried by the bootstrap to every other
    member, unchanged. Collective over the members only."""
    ranks = tuple(ranks)
    uid = None
    if bootstrap.rank == ranks[0]:
        uid = (make_id or _nccl().get_unique_id)()
    return bootstrap.group_bcast(uid, ranks, root=0)


def shared_gpu_reason(group, where) -> str | None:
    """Why NCCL cannot run ``group``, from the (host, PCI bus id) of the GPU each member
    uses (``where``, in the order of ``group.ranks``, gathered from the members: every
    member decides the same), or None. NCCL needs one GPU per rank; how many GPUs a
    rank *sees* does not matter (CUDA_VISIBLE_DEVICES or Slurm's --gpus-per-task=1 show
    each rank only its own)."""
    seen: dict = {}
    for r, loc in zip(group.ranks, where):
        loc = tuple(loc)
        if loc in seen:
            return (f"nccl: ranks {seen[loc]} and {r} of {group.describe()} both use GPU "
                    f"{loc[1]} on {loc[0]}; NCCL needs one GPU per rank. Give each rank its "
                    "own device (e.g. torch.cuda.set_device(local_rank)) or use "
                    "backend='mpi' or 'gloo' for these calls (MCRDL_BACKEND=mpi for all)")
        seen[loc] = r
    return None


def connect_eagerly() -> None:
    """Ask NCCL (>= 2.22) to open a communicator's connections at creation, on the helper
    thread that creates it, rather than lazily inside the first collective's
    ``ncclGroupEnd`` on the calling thread, which would block that thread while MPI
    work in flight needs it: ``NCCL_RUNTIME_CONNECT=0``, unless the user set it. NCCL
    reads it once, at its first communicator; set it earlier yourself if something
    else in the process creates NCCL communicators first."""
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")


PRECONNECT_MAX_RANKS = 16  # default bound: every pair costs NCCL buffers on both GPUs


def preconnect_wanted(size: int) -> bool:
    """Whether to open the p2p connections of a group of ``size`` at creation:
    ``MCRDL_NCCL_PRECONNECT=1``/``0`` if set, else for groups of up to
    PRECONNECT_MAX_RANKS ranks."""
    flag = _cuda.env_flag("MCRDL_NCCL_PRECONNECT")
    return size > 1 and (flag if flag is not None else size <= PRECONNECT_MAX_RANKS)


def preconnect(nccl, comm, me: int, size: int, send_ptr: int, recv_ptr: int,
               stream_ptr: int) -> None:
    """Open NCCL's point-to-point connections to every peer now (NCCL always connects
    p2p lazily, inside the first ``ncclGroupEnd`` with that peer): one byte to and from
    every peer in one NCCL group. Every member runs it at creation, on the helper
    thread; ``recv_ptr`` needs ``size`` bytes (peer p writes byte p)."""
    nccl.groupStart()
    try:
        for p in range(size):
            if p != me:
                comm.send(send_ptr, 1, nccl.NCCL_UINT8, p, stream_ptr)
                comm.recv(recv_ptr + p, 1, nccl.NCCL_UINT8, p, stream_ptr)
    finally:
        nccl.groupEnd()


class _Comm:
    """One group's NCCL communicator, its device and its communication stream (a
    process-lifetime stream: see ``mcrdl_core.memory.cuda.lasting_stream``)."""

    def __init__(self, nccl_comm, device: int, stream, group):
        self.nccl = nccl_comm
        self.device = device
        self.stream = stream
        self.group = group
        self.scratch = None  # one float for barrier
        self.torch_stream = None
        self.failed: BaseException | None = None
        self.held: list = []  # buffers of failed ops: kept until the communicator is aborted

    def check(self, op) -> None:
        """Raise NCCL's asynchronous error of this communicator, naming ``op``."""
        if self.failed is not None:
            raise self.failed
        try:
            self.nccl.check_async_error()
        except Exception as exc:  # noqa: BLE001 - NcclError and CUDA errors alike
            self.failed = NCCLError(
                f"nccl: {op} on {self.group.describe()} failed asynchronously: {exc}. The "
                "communicator is unusable now; check the other ranks' output (a rank that "
                "died or called another op) and run with NCCL_DEBUG=INFO for details")
            raise self.failed from exc

    def close(self) -> str:
        """Release the communicator: ``abort()`` if it failed (an asynchronous error now or
        before: ``ncclCommDestroy`` would wait forever for its stuck ops, and CuPy's
        ``destroy()`` never raises), else ``destroy()``. Returns which was done."""
        if self.failed is None:
            try:
                self.check("shutdown")
            except NCCLError:
                pass
        if self.failed is not None:
            self.nccl.abort()
            done = "aborted"
        else:
            self.nccl.destroy()
            done = "destroyed"
        self.held = []
        return done


class NCCLWork(EventWork):
    """An NCCL op: the event recorded on the communication stream after it.

    ``wait()`` makes the caller's current stream wait on the event and returns at once
    (the host does not block); finalizers run then, on that stream. The GPU may still be
    running the op then, so the Work goes on the progress engine's pending list, which
    keeps its buffers referenced (and checks the communicator's asynchronous errors)
    until the event completes. ``host_wait`` works (barrier) wait on the host instead,
    through the progress loop."""

    def __init__(self, op, group, event, comm: _Comm, bufs, caller: int, desc="",
                 host_wait=False):
        super().__init__("nccl", op, event, group, keep=tuple(bufs),
                         check=lambda: comm.check(op), desc=desc)
        self.comm = comm
        self.caller = caller  # caller's stream at issue: finalizers run on it
        self.host_wait = host_wait
        self.ref = bufs[0] if bufs else None
        self.held = ()  # buffers kept while pending

    def wait(self, timeout: float | None = None) -> bool:
        if self.done or self.host_wait:
            return super().wait(timeout)
        try:
            self.comm.check(self.op)
        except BaseException as exc:
            self.complete(exc)
            raise
        dev = self.comm.device
        cp = _cuda.cupy()
        with cp.cuda.Device(dev):
            if self.ref is not None:
                self.caller = _cuda.current_stream(self.ref)
            else:
                self.caller = cp.cuda.get_current_stream().ptr
            _cuda.stream(self.caller, dev).wait_event(self.event)
        self.complete()
        if self.error is not None:
            raise self.error
        return True

    def complete(self, error=None):
        if self.done:
            return
        hold = self.keep
        if error is not None or not self.finalizers:
            super().complete(error)
        else:
            cp = _cuda.cupy()
            with cp.cuda.Device(self.comm.device), _cuda.stream(self.caller, self.comm.device):
                super().complete(error)
        self.ref = None
        if error is not None and self.comm.failed is not None:
            self.comm.held.extend(hold)  # the failed op may still touch them: until abort
        elif error is None and hold and not self.event.done:
            self.held = hold
            (self.engine or _engine()).defer(self)

    def release(self) -> bool:
        """For the engine's pending list: True once the GPU is past the op (the buffers
        are let go). An asynchronous error of the communicator is raised, naming the op;
        the buffers then stay with the communicator until it is aborted."""
        if self.event.done:
            self.held = ()
            return True
        try:
            self.comm.check(self.op)
        except BaseException:
            self.comm.held.extend(self.held)
            self.held = ()
            raise
        return False


class NCCLBackend(Backend):
    grouped_p2p = True  # batch_p2p: groupStart/groupEnd
    name = "nccl"
    devices = ("cuda",)

    _reasons: list = []  # memo: [reason or None] (facts of this process; computed once)

    @classmethod
    def unavailable_reason(cls, bootstrap):
        """From facts that do not depend on how the ranks are placed: CuPy, a visible CUDA
        device, the NCCL library. Whether the members of a group have a GPU each is
        decided when its communicator is created, from the (host, PCI bus id) gathered
        from them (``shared_gpu_reason``): the same verdict on every member."""
        if not cls._reasons:
            cls._reasons.append(cls._reason())
        return cls._reasons[0]

    @staticmethod
    def _reason() -> str | None:
        reason = _cuda.device_reason()
        if reason is not None:
            return reason
        return nccl_library()[1]

    def unsupported_reason(self, op, device, dtype, reduce_op=None):
        if device.kind != "cuda":
            return (f"the nccl backend handles CUDA buffers only, not {device.kind} buffers; "
                    "use mpi or gloo for host memory")
        if op in REDUCING:
            if dtype.name not in NCCL_TYPES:
                return f"NCCL cannot reduce {dtype.name}; it reduces {sorted(NCCL_TYPES)}"
            if reduce_op in BITWISE:
                return (f"NCCL has no bitwise reductions (ReduceOp.{reduce_op.name}); use "
                        "backend='mpi' or 'gloo'")
            if reduce_op is ReduceOp.AVG:
                mod = nccl_library()[0]
                if mod is not None and mod.get_version() < AVG_MIN_VERSION:
                    return (f"ReduceOp.AVG needs NCCL >= 2.10 (ncclAvg); this NCCL is "
                            f"{mod.get_version()}")
        return None

    # --- communicators ------------------------------------------------------------------
    def create_comm(self, group):
        return self._create(group, _cuda.current_device())

    def _comm(self, group, device: int) -> _Comm:
        c = group.comms.get(self.name)
        if c is None:
            c = group.comms[self.name] = self._create(group, device)
        elif c.device != device:
            raise InvalidArgumentError(
                f"nccl: {group.describe()} has its NCCL communicator on cuda:{c.device}, but "
                f"this call's buffers are on cuda:{device}; keep a group's NCCL calls on one "
                "device (one GPU per rank), or make another group for the other device")
        return c

    def _create(self, group, device: int) -> _Comm:
        """Collective over the group's members: check the placement, share the unique id,
        create the communicator (and open its p2p connections) on a helper thread while
        this thread keeps driving the progress loop."""
        nccl = _nccl()
        bs = self.rt.bootstrap
        where = bs.group_allgather((bs.hostname(), _cuda.pci_bus_id(device)), group.ranks)
        reason = shared_gpu_reason(group, where)
        if reason is not None:
            raise UnsupportedError(reason)
        connect_eagerly()
        uid = share_unique_id(bs, group.ranks)
        stream = _cuda.lasting_stream(device, group.id)
        warm = preconnect_wanted(group.size)

        def init():
            with _cuda.on_device(device):
                comm = nccl.NcclCommunicator(group.size, uid, group.rank)
                if warm:
                    scratch = _cuda.device_bytes(group.size + 1, device)
                    ptr = scratch.data.ptr
                    preconnect(nccl, comm, group.rank, group.size, ptr, ptr + 1, stream.ptr)
                    stream.synchronize()  # this helper thread only; scratch freed after
            return comm

        work = ThreadWork("nccl", "create communicator", init, group, desc="ncclCommInitRank")
        self.rt.engine.wait([work])
        return _Comm(work.result(), device, stream, group)

    def destroy(self):
        self._settle(self.rt.engine)
        for g in self.rt.groups:
            c = g.comms.pop(self.name, None)
            if c is not None:
                c.close()

    @staticmethod
    def _settle(engine) -> None:
        """Before the communicators go: poll until the GPU is done with the ops the
        engine still holds (bounded by the engine's timeout). An op that failed or did
        not finish in time marks its communicator failed, so that it is aborted."""
        deadline = time.perf_counter() + engine.timeout
        while engine.pending:
            try:
                engine.reap()
            except McrdlError:
                continue  # that communicator is failed now: close() aborts it
            if not engine.pending:
                return
            if time.perf_counter() > deadline:
                for w in engine.pending:
                    comm = getattr(w, "comm", None)
                    if comm is not None and comm.failed is None:
                        comm.failed = NCCLError(f"nccl: {w.op} did not finish before shutdown")
                engine.pending.clear()
                return
            time.sleep(1e-4)

    # --- helpers ------------------------------------------------------------------------
    @staticmethod
    def _type(buf, reducing: bool = False):
        """(NCCL datatype, element count) for ``buf``; other dtypes move as bytes."""
        nccl = _nccl()
        name = NCCL_TYPES.get(buf.dtype.name)
        if name is None:
            if reducing:
                raise UnsupportedError(f"NCCL cannot reduce {buf.dtype.name}")
            return nccl.NCCL_UINT8, buf.nbytes, buf.dtype.itemsize
        return getattr(nccl, name), buf.numel, 1

    @staticmethod
    def _op(op: ReduceOp):
        return getattr(_nccl(), NCCL_OPS[op])

    def _issue(self, op, group, bufs, enqueue, desc="", comm=None, host_wait=False):
        """Order the communication stream after the producers, enqueue, record the event."""
        if comm is None:
            comm = self._comm(group, bufs[0].device.index)
        for b in bufs:
            if b.device.index != comm.device:
                raise InvalidArgumentError(f"nccl: {b.describe()} is not on cuda:{comm.device}, "
                                           "the device of this group's communicator")
        cp = _cuda.cupy()
        nccl = _nccl()
        dev = comm.device
        comm.check(op)
        with cp.cuda.Device(dev):
            caller = _cuda.current_stream(bufs[0]) if bufs else cp.cuda.get_current_stream().ptr
            _cuda.wait_on(comm.stream.ptr, [_cuda.producer_stream(b) for b in bufs] or [caller],
                          dev)
            try:
                enqueue(comm.nccl, comm.stream.ptr)
            except nccl.NcclError as exc:
                raise NCCLError(f"nccl: {op} on {group.describe()} failed: {exc} (run with "
                                "NCCL_DEBUG=INFO for details)") from exc
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record(comm.stream)
        self._record_streams(bufs, comm)
        return NCCLWork(op, group, event, comm, bufs, caller, desc, host_wait)

    @staticmethod
    def _record_streams(bufs, comm) -> None:
        """Tell torch's caching allocator that the communication stream uses these."""
        for b in bufs:
            owner = _cuda.root_owner(b)
            if type(owner).__module__.split(".")[0] == "torch":
                import torch

                if comm.torch_stream is None:
                    comm.torch_stream = torch.cuda.ExternalStream(comm.stream.ptr,
                                                                  device=comm.device)
                owner.record_stream(comm.torch_stream)

    @staticmethod
    def _copy(dst_ptr, src_ptr, nbytes, stream_ptr) -> None:
        if nbytes:
            _cuda.cupy().cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, D2D, stream_ptr)

    def _grouped(self, sends, recvs, local):
        """An enqueue function: ``local`` (dst, src, nbytes) copied on the stream, then
        the (ptr, count, peer) sends and receives as one NCCL group."""
        nccl = _nccl()

        def enqueue(comm, s, dtype):
            if local is not None:
                self._copy(*local, s)
            nccl.groupStart()
            try:
                for ptr, count, peer in sends:
                    if count:
                        comm.send(ptr, count, dtype, peer, s)
                for ptr, count, peer in recvs:
                    if count:
                        comm.recv(ptr, count, dtype, peer, s)
            finally:
                nccl.groupEnd()
        return enqueue

    # --- point to point -----------------------------------------------------------------
    def send(self, group, buf, dst, tag):
        t, n, _ = self._type(buf)
        return self._issue(Op.SEND, group, [buf], lambda c, s: c.send(buf.ptr, n, t, dst, s),
                           desc=f"to group rank {dst}")

    def recv(self, group, buf, src, tag):
        if src is None:
            raise UnsupportedError("the nccl backend cannot receive from any source (NCCL "
                                   "needs the peer); pass src, or use backend='mpi' or 'gloo'")
        t, n, _ = self._type(buf)
        work = self._issue(Op.RECV, group, [buf], lambda c, s: c.recv(buf.ptr, n, t, src, s),
                           desc=f"from group rank {src}")
        work.value = src
        return work

    def batch_p2p(self, group, sends, recvs):
        """Sends and receives (``[(buf, group rank)]``) as one NCCL group
        (``groupStart``/``groupEnd``): one Work; no order among them can deadlock."""
        bufs = [b for b, _ in sends] + [b for b, _ in recvs]
        if not bufs:
            raise InvalidArgumentError("nccl: batch_p2p needs at least one send or receive")
        items = [(True, b, p) + self._type(b)[:2] for b, p in sends]
        items += [(False, b, p) + self._type(b)[:2] for b, p in recvs]
        nccl = _nccl()

        def enqueue(comm, s):
            nccl.groupStart()
            try:
                for is_send, b, peer, dtype, count in items:
                    if count:
                        (comm.send if is_send else comm.recv)(b.ptr, count, dtype, peer, s)
            finally:
                nccl.groupEnd()
        return self._issue(Op.SEND if sends else Op.RECV, group, bufs, enqueue,
                           desc=f"batch of {len(sends)} sends, {len(recvs)} receives")

    # --- collectives --------------------------------------------------------------------
    def broadcast(self, group, buf, root):
        t, n, _ = self._type(buf)
        return self._issue(Op.BROADCAST, group, [buf],
                           lambda c, s: c.broadcast(buf.ptr, buf.ptr, n, t, root, s))

    def reduce(self, group, buf, root, op):
        t, n, _ = self._type(buf, True)
        o = self._op(op)
        return self._issue(Op.REDUCE, group, [buf],
                           lambda c, s: c.reduce(buf.ptr, buf.ptr, n, t, o, root, s))

    def all_reduce(self, group, buf, op):
        t, n, _ = self._type(buf, True)
        o = self._op(op)
        return self._issue(Op.ALL_REDUCE, group, [buf],
                           lambda c, s: c.allReduce(buf.ptr, buf.ptr, n, t, o, s))

    def all_gather(self, group, out, inp):
        t, n, _ = self._type(inp)
        return self._issue(Op.ALL_GATHER, group, [inp, out],
                           lambda c, s: c.allGather(inp.ptr, out.ptr, n, t, s))

    def reduce_scatter(self, group, out, inp, op):
        t, n, _ = self._type(out, True)
        o = self._op(op)
        return self._issue(Op.REDUCE_SCATTER, group, [inp, out],
                           lambda c, s: c.reduceScatter(inp.ptr, out.ptr, n, t, o, s))

    def all_to_all(self, group, out, inp, out_counts, in_counts, even=False):
        _v.own_block(out_counts, in_counts, group.rank, "nccl: all_to_all")
        t, _, scale = self._type(inp)
        isz = inp.dtype.itemsize
        me = group.rank
        in_off = _offsets(in_counts)
        out_off = _offsets(out_counts)
        sends = [(inp.ptr + in_off[p] * isz, in_counts[p] * scale, p)
                 for p in range(group.size) if p != me]
        recvs = [(out.ptr + out_off[p] * isz, out_counts[p] * scale, p)
                 for p in range(group.size) if p != me]
        local = (out.ptr + out_off[me] * isz, inp.ptr + in_off[me] * isz, in_counts[me] * isz)
        enqueue = self._grouped(sends, recvs, local)
        return self._issue(Op.ALL_TO_ALL, group, [inp, out], lambda c, s: enqueue(c, s, t))

    def gather(self, group, out, inp, root):
        t, n, _ = self._type(inp)
        me, nb = group.rank, inp.nbytes
        if me == root:
            recvs = [(out.ptr + p * nb, n, p) for p in range(group.size) if p != me]
            enqueue = self._grouped([], recvs, (out.ptr + me * nb, inp.ptr, nb))
            bufs = [inp, out]
        else:
            enqueue = self._grouped([(inp.ptr, n, root)], [], None)
            bufs = [inp]
        return self._issue(Op.GATHER, group, bufs, lambda c, s: enqueue(c, s, t))

    def scatter(self, group, out, inp, root):
        t, n, _ = self._type(out)
        me, nb = group.rank, out.nbytes
        if me == root:
            sends = [(inp.ptr + p * nb, n, p) for p in range(group.size) if p != me]
            enqueue = self._grouped(sends, [], (out.ptr, inp.ptr + me * nb, nb))
            bufs = [out, inp]
        else:
            enqueue = self._grouped([], [(out.ptr, n, root)], None)
            bufs = [out]
        return self._issue(Op.SCATTER, group, bufs, lambda c, s: enqueue(c, s, t))

    def barrier(self, group):
        cp = _cuda.cupy()
        comm = group.comms.get(self.name) or self._comm(group, _cuda.current_device())
        if comm.scratch is None:
            with cp.cuda.Device(comm.device):
                comm.scratch = cp.zeros(1, dtype=cp.float32)
        nccl = _nccl()
        ptr = comm.scratch.data.ptr
        return self._issue(Op.BARRIER, group, [],
                           lambda c, s: c.allReduce(ptr, ptr, 1, nccl.NCCL_FLOAT32,
                                                    nccl.NCCL_SUM, s),
                           comm=comm, host_wait=True)


def _offsets(counts) -> list:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
