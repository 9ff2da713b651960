"""MPI backend (mpi4py; MPICH from the ``mpich`` wheel by default).

Every op is exactly one nonblocking MPI call (Isend, Irecv, Ibcast, Ireduce,
Iallreduce, Iallgather, Ireduce_scatter_block, Ialltoall(v), Igather, Iscatter,
Ibarrier) returning one request, so the progress engine can drive all of them with a
single ``Testsome`` and nothing ever blocks inside MPI.

What MPI lacks is built from MPI itself:
- float16 / bfloat16 reductions: MPI has no such reduction types, so the data is
  upcast to float32 (one NumPy call), reduced in float32, and rounded back once at the
  end — more accurate than reducing in 16 bits. Data movement ops send the raw 16-bit
  words (MPI_UINT16_T).
- ReduceOp.AVG: MPI_SUM, then a division by the group size when the request completes.

Buffers are passed to MPI by address (``MPI.buffer.fromaddress``), no copies, except
where the input shares memory with the output, as torch.distributed allows
(``all_gather_into_tensor(out, out[r*n:(r+1)*n])``, ``reduce_scatter_tensor(x[r*n:(r+1)*n],
x)``, ``all_to_all_single(x, x)``): MPI forbids overlapping send and receive buffers
(MPICH refuses identical pointers, "Buffers must not be aliased", and other overlaps are
undefined), so the input goes to MPI as a copy (``_apart``). Not ``MPI_IN_PLACE``: for
these ops the standard requires it on all processes or none, and a rank cannot know
whether its peers' calls are in place; the copy is of the input only (1/size of an
all-gather's output). Gather and scatter never see shared memory here: the core hands
them fresh temporaries.

CUDA buffers (CuPy required):
- CUDA-aware MPI (``cuda_support()``: ``MCRDL_MPI_CUDA_AWARE=0/1`` if set, else
  ``MPIX_Query_cuda_support()`` of the loaded library, which MPICH and Open MPI both
  export; without it the library is taken as not CUDA-aware): the device pointers go to
  MPI, once an event recorded on the producer stream has completed (queried from the
  progress loop, never a blocking synchronize). Reductions that need host arithmetic
  (float16/bfloat16 upcast, AVG's division) are staged as below.
- otherwise staged through pinned host memory (``mcrdl_core.memory.cuda.HostStage``): copies in
  on the producer stream, the same MPI call on the host copies, and the results copied
  back on that stream when the request completes; the Work completes when they land.
"""
from __future__ import annotations

import ctypes
import functools
from itertools import accumulate
import zlib

import numpy as np
from mpi4py import MPI

from mcrdl_core.base import config as _config
from mcrdl_core.memory import cuda as _cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.world import mpi_setup as _setup
from mcrdl_core.world.backend import Backend
from mcrdl_core.memory.buffer import Buffer
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.engine.work import Work

_gpu = _cuda.cuda_dispatch

_TYPES = {
    dt.float32: MPI.FLOAT, dt.float64: MPI.DOUBLE, dt.int8: MPI.INT8_T, dt.uint8: MPI.UINT8_T,
    dt.int16: MPI.INT16_T, dt.int32: MPI.INT32_T, dt.int64: MPI.INT64_T,
    dt.float16: MPI.UINT16_T, dt.bfloat16: MPI.UINT16_T,  # moved as bits, reduced upcast
}
_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
        ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND,
        ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}


class MPIWork(Work):
    """One MPI request. ``status`` is kept for receives (to report the source)."""

    poll_group = "mpi"
    host_progress = True

    def __init__(self, op, group, req, keep=(), finalize=None, status=None, desc=""):
        super().__init__("mpi", op, group, finalize=finalize, desc=desc)
        self.req = req
        self.keep = keep  # buffers and temporaries MPI reads or writes until completion
        self.status = status

    def poll(self) -> bool:
        return self.req.Test(self.status) if self.status is not None else self.req.Test()

    @classmethod
    def poll_many(cls, works) -> None:
        plain = [w for w in works if w.status is None and not w.done]
        if plain:
            done = MPI.Request.Testsome([w.req for w in plain])
            for i in done or ():
                plain[i].complete()
        for w in works:
            if w.status is not None and not w.done and w.poll():
                w.complete()


try:  # the compiled hot path: built by mcrdl_backends.build (make install), not by pip
    from . import mpi_fast
except ImportError as _exc:
    mpi_fast, _NOT_BUILT = None, f"not built ({_exc}): run python -m mcrdl_backends.build"


class _PyWorkFields:
    """What ``mpi_fast.Work`` holds in the object, as class defaults: the base of the
    fast path's Works where the compiled module is not built (or is another version)."""

    req = status = counts = op = group = engine = error = None
    spans = keep = finalizers = ()
    done = False


#: the fields of the fast path's Works: in the object (the compiled module's type, which
#: its calls fill in without a dict lookup) where it is built, else plain attributes
_WorkFields = getattr(mpi_fast, "Work", _PyWorkFields)


class _FastWork(_WorkFields, MPIWork):
    """An MPIWork of the fast path (``MPIBackend.fast_work``): its hot fields (request,
    status, op, group, spans, keep, engine, finalizers, error, done) are those of
    ``_WorkFields``; what is the same for all of them is set on the class.

    While the compiled module is in use its ``wait`` is the module's ``work_wait`` (set
    by ``fast_blocking``): with no timeout given, while every work in flight on this
    rank is MPI's and nothing is deferred, it spins on this request under the engine's
    ``poll_lock`` for at most the engine's spin time and finishes the work if it
    completed. MPI's progress is global, so testing this request drives the others
    too, and nothing of another library waits to be polled meanwhile. A request not
    finished by then, a timeout given, or anything else in flight goes to the engine's
    wait (``MPIWork.wait``: its timeout and diagnostics), as any Work; that is also the
    wait while the module is not in use."""

    backend, desc, value = "mpi", "", None

    def poll(self) -> bool:
        return self.req.Test()  # no status: never a receive

    Test = poll  # a request's name: the fast path polls either


class _FastRecvWork(_FastWork):
    """A receive of the fast path: polled with its status (the source it reports).
    ``value``, once complete, is the sender's global rank, read from the status when
    asked (no finalizer to run at completion)."""

    def poll(self) -> bool:
        return self.req.Test(self.status)

    Test = poll

    def source(self) -> int:
        return self.status.Get_source()

    @property
    def value(self):
        if self.done and self.error is None:
            return self.group.ranks[self.status.Get_source()]
        return None


#: the Work classes of MPI requests: a fast-path wait spins in C only while every work
#: in flight is one of these (exactly: another class may need its own polling)
_MPI_WORKS = frozenset((MPIWork, _FastWork, _FastRecvWork))


class _RecvRequest:
    """An ``Irecv`` request and its status: ``Test()`` fills the status; ``source()``
    is the sender's rank in the group once complete."""

    __slots__ = ("req", "status")

    def __init__(self, req, status):
        self.req, self.status = req, status

    def Test(self) -> bool:  # noqa: N802 (mpi4py's name, what the fast path calls)
        return self.req.Test(self.status)

    def source(self) -> int:
        return self.status.Get_source()


def _split_counts(splits, count: int, rows: int, n: int):
    """Element counts per peer of one side of an uneven all-to-all: ``splits`` (n row
    counts adding up to ``rows``; a row is count / rows elements) or, for None, ``rows``
    split evenly; None where they do not fit."""
    if splits is None:
        return None if rows % n else [count // n] * n
    if len(splits) != n:
        return None
    per_row = count // rows if rows else 0
    total = 0
    counts = []
    for s in splits:
        s = int(s)
        if s < 0:
            return None
        total += s
        counts.append(s * per_row)
    return counts if total == rows else None


def _displs(counts) -> list:
    """Displacements of consecutive blocks of ``counts`` elements."""
    return [0, *accumulate(counts[:-1])]


def _overlap(a: Buffer, b: Buffer) -> bool:
    """Whether ``a`` and ``b`` share a byte of memory (empty buffers share none)."""
    (lo_a, hi_a), (lo_b, hi_b) = a.span(), b.span()
    return bool(a.nbytes and b.nbytes) and lo_a < hi_b and lo_b < hi_a


def _apart(inp: Buffer, out: Buffer) -> Buffer:
    """``inp``, or a host copy of it when it shares memory with ``out``: what MPI reads
    must not overlap what it writes (see the module docstring). Host buffers only: an
    aliased CUDA call is staged (``MPIBackend.cuda_call``), which separates them."""
    return Buffer.from_numpy(inp.host().copy()) if _overlap(inp, out) else inp


def _spec(buf: Buffer, count: int | None = None):
    """mpi4py buffer spec by address: [memory, count, datatype]."""
    mem = MPI.buffer.fromaddress(buf.ptr if buf.nbytes else 0, buf.nbytes, readonly=buf.readonly)
    return [mem, buf.numel if count is None else count, _TYPES[buf.dtype]]


class _Reducible:
    """The buffer MPI reduces for ``buf``: itself, or a float32 copy for 16-bit floats.
    ``finish()`` applies AVG and writes a copy back into ``buf``."""

    def __init__(self, buf: Buffer, op: ReduceOp, n: int, copy_in: bool = True):
        self.buf, self.op, self.n = buf, op, n
        if buf.dtype.is_half:
            h = buf.host()
            arr = h.astype(np.float32) if copy_in else np.empty(h.shape, np.float32)
            self.work_buf = Buffer.from_numpy(arr)
        else:
            self.work_buf = buf

    @property
    def finalizer(self):
        """``finish`` if there is anything to do on completion, else None."""
        needed = self.op is ReduceOp.AVG or self.work_buf is not self.buf
        return self.finish if needed else None

    def finish(self) -> None:
        arr = self.work_buf.host()
        if self.op is ReduceOp.AVG:
            np.divide(arr, self.n, out=arr, casting="unsafe")
        if self.work_buf is not self.buf:
            np.copyto(self.buf.host(), arr, casting="unsafe")


_FAST_VERSION = 7  # mpi_fast.c's VERSION that this module's calls are written for
_COMPILED: list = []


def _launch(op, group, req, spans, keep, engine):
    """The Work of a Python issuer's request, registered with ``engine``: where the
    compiled ``launch`` hands such a request (``MCRDL_MPI_FAST`` off after the module
    was loaded)."""
    work = MPIBackend.fast_work(None, op, group, req, spans, keep)
    work.engine = engine
    engine.inflight.append(work)
    return work


def compiled():
    """(the compiled hot path module ``mpi_fast``, or None; why not). Checked once: a
    module built against another MPI library than mpi4py's is refused (its handles would
    mean nothing there)."""
    if not _COMPILED:
        if mpi_fast is None:
            _COMPILED.append((None, _NOT_BUILT))
        elif getattr(mpi_fast, "VERSION", None) != _FAST_VERSION:
            _COMPILED.append((None, "built from another version of mpi_fast.c: rebuild "
                                    "with python -m mcrdl_backends.build"))
        elif (mpi_fast.library_version() != MPI.Get_library_version()
              or mpi_fast.world_handle() != MPI.COMM_WORLD.handle):
            _COMPILED.append((None, "built against another MPI library than mpi4py's: "
                                    "rebuild with python -m mcrdl_backends.build"))
        else:
            mpi_fast.set_work_classes(_FastWork, _FastRecvWork, _MPI_WORKS, MPIWork.wait,
                                      _launch)
            _COMPILED.append((mpi_fast, "built"))
    return _COMPILED[0]


def fast_module():
    """The compiled module if built and ``MCRDL_MPI_FAST`` is on, else None."""
    return compiled()[0] if _config.get("MCRDL_MPI_FAST") else None


_CUDA_SUPPORT: list = []


def cuda_support() -> tuple[bool, str]:
    """(is the MPI library CUDA-aware, how that was found out). Computed once."""
    if not _CUDA_SUPPORT:
        forced = _cuda.env_flag("MCRDL_MPI_CUDA_AWARE")
        if forced is not None:
            _CUDA_SUPPORT.append((forced, "set by MCRDL_MPI_CUDA_AWARE"))
        else:
            try:  # dlsym through mpi4py's extension module finds the linked libmpi
                query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
            except (OSError, AttributeError):
                _CUDA_SUPPORT.append((False, "the library has no MPIX_Query_cuda_support(); "
                                             "set MCRDL_MPI_CUDA_AWARE=1 if it is CUDA-aware"))
            else:
                query.restype, query.argtypes = ctypes.c_int, []
                value = int(query())
                _CUDA_SUPPORT.append((bool(value), f"MPIX_Query_cuda_support() = {value}"))
    return _CUDA_SUPPORT[0]


class MPIBackend(Backend):
    name = "mpi"
    devices = ("cpu", "cuda")

    @classmethod
    def unavailable_reason(cls, bootstrap):
        if bootstrap.kind != "mpi":
            return bootstrap.mpi_reason
        return None

    def unsupported_reason(self, op, device, dtype, reduce_op=None):
        if dtype not in _TYPES:
            return f"the mpi backend has no MPI datatype for {dtype.name}"
        if device.kind == "cuda":
            reason = _cuda.cupy_reason()
            if reason is not None:
                return f"the mpi backend needs CuPy for CUDA buffers: {reason}"
        elif device.kind != "cpu":
            return f"the mpi backend does not handle {device.kind} buffers"
        return None

    def cuda_call(self, op, fn, group, args):
        """Device pointers if the library is CUDA-aware, no host arithmetic is needed and
        the buffers do not share memory (an in-place call), else pinned host staging
        (see the module docstring): the host mirrors are separate buffers."""
        bufs = _cuda.cuda_buffers(args)
        red = next((a for a in args if isinstance(a, ReduceOp)), None)
        host_math = red is ReduceOp.AVG or (red is not None and bufs[0].dtype.is_half)
        aliased = len(bufs) == 2 and _overlap(*bufs)
        if cuda_support()[0] and not host_math and not aliased:
            _cuda.ready(self.rt.engine, bufs, self.name, op, group)
            return fn(self, group, *args)
        return _cuda.staged_call(self.rt.engine, self.name, op, functools.partial(fn, self),
                                 group, *args)

    def create_comm(self, group):
        """The group's communicator, made on the group's first MPI call by its members,
        with every wait for peers in the progress loop under ``MCRDL_TIMEOUT``
        (``mcrdl_core.world.mpi_setup``): the world's by ``MPI_Comm_idup``; a sub-group's by
        ``MPI_Comm_create_group`` (MPI has no nonblocking form) once a nonblocking
        readiness handshake has shown every member to be there. A member that never
        makes the call therefore ends in CommTimeoutError naming the group (and the
        group is marked broken), not in a hang inside MPI; in-flight work of other
        backends keeps progressing during creation. Measured on 2 local ranks: the
        world's Idup and a 2-rank handshake + create both complete in well under 1 ms
        when all members are there (tests/faults: first-call straggler cases)."""
        world = MPI.COMM_WORLD
        if group.id == 0:
            return _setup.dup(world, group)
        _setup.members_ready(self._handshake_comm(), group.ranks, group.key, group)
        sub = world.Get_group().Incl(list(group.ranks))
        try:
            return world.Create_group(sub, tag=zlib.crc32(group.key.encode()) % 32768)
        finally:
            sub.Free()

    def _handshake_comm(self):
        """A private communicator for the readiness handshakes (point-to-point only):
        the bootstrap's own when MPI bootstrapped the job (it is private already)."""
        comm = getattr(self.rt.bootstrap, "comm", None)
        return comm if comm is not None else MPI.COMM_WORLD

    def destroy(self):
        for g in self.rt.groups:
            c = g.comms.pop(self.name, None)
            if c is not None and c != MPI.COMM_NULL:
                c.Free()

    # --- point to point -----------------------------------------------------------------
    @_gpu(Op.SEND)
    def send(self, group, buf, dst, tag):
        req = self.comm(group).Isend(_spec(buf), dst, tag)
        return MPIWork(Op.SEND, group, req, (buf,), desc=f"to group rank {dst}")

    @_gpu(Op.RECV)
    def recv(self, group, buf, src, tag):
        status = MPI.Status()
        source = MPI.ANY_SOURCE if src is None else src
        req = self.comm(group).Irecv(_spec(buf), source, tag)
        work = MPIWork(Op.RECV, group, req, (buf,), status=status,
                       desc=f"from group rank {'any' if src is None else src}")
        work.add_finalizer(lambda: setattr(work, "value", status.Get_source()))
        return work

    # --- collectives --------------------------------------------------------------------
    @_gpu(Op.BROADCAST)
    def broadcast(self, group, buf, root):
        return MPIWork(Op.BROADCAST, group, self.comm(group).Ibcast(_spec(buf), root), (buf,))

    @_gpu(Op.REDUCE)
    def reduce(self, group, buf, root, op):
        r = _Reducible(buf, op, group.size)
        comm = self.comm(group)
        if group.rank == root:
            req = comm.Ireduce(MPI.IN_PLACE, _spec(r.work_buf), _OPS[op], root)
            return MPIWork(Op.REDUCE, group, req, (buf, r), finalize=r.finalizer)
        req = comm.Ireduce(_spec(r.work_buf), None, _OPS[op], root)
        return MPIWork(Op.REDUCE, group, req, (buf, r))

    @_gpu(Op.ALL_REDUCE)
    def all_reduce(self, group, buf, op):
        r = _Reducible(buf, op, group.size)
        req = self.comm(group).Iallreduce(MPI.IN_PLACE, _spec(r.work_buf), _OPS[op])
        return MPIWork(Op.ALL_REDUCE, group, req, (buf, r), finalize=r.finalizer)

    @_gpu(Op.ALL_GATHER)
    def all_gather(self, group, out, inp):
        inp = _apart(inp, out)
        req = self.comm(group).Iallgather(_spec(inp), _spec(out, inp.numel))
        return MPIWork(Op.ALL_GATHER, group, req, (out, inp))

    @_gpu(Op.REDUCE_SCATTER)
    def reduce_scatter(self, group, out, inp, op):
        r_in = _Reducible(_apart(inp, out), ReduceOp.SUM, group.size)
        r_out = _Reducible(out, op, group.size, copy_in=False)
        req = self.comm(group).Ireduce_scatter_block(_spec(r_in.work_buf, out.numel),
                                                     _spec(r_out.work_buf),
                                                     _OPS[op])
        return MPIWork(Op.REDUCE_SCATTER, group, req, (out, inp, r_in, r_out),
                       finalize=r_out.finalizer)

    @_gpu(Op.ALL_TO_ALL)
    def all_to_all(self, group, out, inp, out_counts, in_counts, even=False):
        """``MPI_Ialltoall`` only where the call is even by its form (``even``: every rank
        issues the same collective); else ``MPI_Ialltoallv``, also when this rank's own
        counts happen to be equal (an idle rank among uneven ones)."""
        comm = self.comm(group)
        inp = _apart(inp, out)
        if even:
            req = comm.Ialltoall(_spec(inp, in_counts[0]), _spec(out, out_counts[0]))
        else:
            in_displs = np.concatenate(([0], np.cumsum(in_counts[:-1], dtype=np.int64))).tolist()
            out_displs = np.concatenate(([0], np.cumsum(out_counts[:-1], dtype=np.int64))).tolist()
            s_in, s_out = _spec(inp), _spec(out)
            req = comm.Ialltoallv([s_in[0], (in_counts, in_displs), s_in[2]],
                                  [s_out[0], (out_counts, out_displs), s_out[2]])
        return MPIWork(Op.ALL_TO_ALL, group, req, (out, inp))

    @_gpu(Op.GATHER)
    def gather(self, group, out, inp, root):
        recv = _spec(out, inp.numel) if group.rank == root else None
        req = self.comm(group).Igather(_spec(inp), recv, root)
        return MPIWork(Op.GATHER, group, req, (out, inp))

    @_gpu(Op.SCATTER)
    def scatter(self, group, out, inp, root):
        send = _spec(inp, out.numel) if group.rank == root else None
        req = self.comm(group).Iscatter(send, _spec(out), root)
        return MPIWork(Op.SCATTER, group, req, (out, inp))

    # --- the fast path (mcrdl_core.dispatch.fastpath) -------------------------------------------
    def fast_all_reduce(self, group, dtype, op):
        """An issuer ``issue(mem, count) -> MPI request`` of an in-place ``Iallreduce`` of
        ``count`` elements of ``dtype`` in host memory ``mem`` (an address, or an object
        with the buffer protocol such as a NumPy array), bound once to the group's
        communicator, datatype and op; None where a finishing step is needed (16-bit
        floats are reduced upcast, AVG divides at the end): those take the general path."""
        if dtype.is_half or op is ReduceOp.AVG or dtype not in _TYPES:
            return None
        compiled = self.fast_blocking(Op.ALL_REDUCE, group, dtype, op)
        if compiled is not None:  # the same call, compiled, never polled (spin < 0)
            return functools.partial(compiled, -1.0)
        iallreduce = self.comm(group).Iallreduce
        fromaddress, in_place = MPI.buffer.fromaddress, MPI.IN_PLACE
        mtype, mop, isz = _TYPES[dtype], _OPS[op], dtype.itemsize

        def issue(mem, count):
            if mem.__class__ is int:  # an address (else an object with the buffer protocol)
                mem = fromaddress(mem if count else 0, count * isz)
            return iallreduce(in_place, [mem, count, mtype], mop)

        return issue

    def fast_issuer(self, op, group, dtype, red=None, root=None):
        """An issuer of ``op`` on host memory given by address, bound once to the group's
        communicator, datatype, op and root (``mcrdl_core.dispatch.fastpath``); None where this
        backend needs more than one MPI call (16-bit float and AVG reductions finish on
        the host) or the dtype has no MPI type. Arguments and MPI calls by op:

        - broadcast, reduce: ``(ptr, count)``; ``Ibcast``, ``Ireduce`` (in place at the root)
        - all_gather: ``(out, inp, count)``, ``count`` per rank; ``Iallgather``
        - reduce_scatter: ``(out, inp, count)``, ``count`` per rank; ``Ireduce_scatter_block``
        - all_to_all: ``(out, inp, count)`` per peer (``Ialltoall``); with ``root="v"``
          ``(out, out_count, out_rows, inp, in_count, in_rows, out_splits, in_splits)``
          (``Ialltoallv``): split sizes along dim 0 (None: even on that side), which it
          judges: False, with nothing sent, where they do not fit the group (the fast
          path's MISS), or where this rank's own block differs between them
        - send, recv: ``(ptr, count, group rank or None, tag)``; a receive's request also
          tells its source (``source()``)
        - barrier: ``()``; ``Ibarrier``
        - compiled only (None without the module): gather, scatter ``(out, inp, count)``
          (``Igather``, ``Iscatter``; ``root``: the root's group rank), and
          all_to_all with ``root="list"``, the list form ``(outs, out_counts, ins,
          in_counts)`` (``Ialltoallv``, as the general path issues it). The list forms
          of all_gather, reduce_scatter, gather and scatter give the list side as a
          tuple of block addresses where the blocks are not one run (staged in a
          temporary: packed before the issue, copied into the blocks at completion)

        With the compiled module in use (``fast_module``) the issuer is its function of
        the op, not polled (``fast_blocking`` with a negative spin), and what it returns
        is already the call's Work (``_FastWork``; a receive's ``_FastRecvWork``), which
        ``fast_work`` completes.
        """
        if dtype is not None and dtype not in _TYPES:
            return None
        if red is not None and (dtype.is_half or red is ReduceOp.AVG):
            return None
        compiled = self.fast_blocking(op, group, dtype, red, root)
        if compiled is not None:  # the same call, compiled, never polled (spin < 0)
            return functools.partial(compiled, -1.0)
        if op in (Op.GATHER, Op.SCATTER) or root == "list":
            return None  # (the list forms, gather and scatter: compiled only)
        comm = self.comm(group)
        if op is Op.BARRIER:
            return comm.Ibarrier
        mtype, isz = _TYPES[dtype], dtype.itemsize
        mem = MPI.buffer.fromaddress

        def spec(ptr, count):
            return [mem(ptr if count else 0, count * isz), count, mtype]

        n = group.size
        if op is Op.BROADCAST:
            ibcast = comm.Ibcast
            return lambda ptr, count: ibcast(spec(ptr, count), root)
        if op is Op.REDUCE:
            ireduce, mop = comm.Ireduce, _OPS[red]
            if group.rank == root:
                in_place = MPI.IN_PLACE
                return lambda ptr, count: ireduce(in_place, spec(ptr, count), mop, root)
            return lambda ptr, count: ireduce(spec(ptr, count), None, mop, root)
        if op is Op.ALL_GATHER:
            iallgather = comm.Iallgather
            return lambda out, inp, count: iallgather(
                spec(inp, count), [mem(out if count else 0, n * count * isz), count, mtype])
        if op is Op.REDUCE_SCATTER:
            irs, mop = comm.Ireduce_scatter_block, _OPS[red]
            return lambda out, inp, count: irs(
                [mem(inp if count else 0, n * count * isz), count, mtype], spec(out, count), mop)
        if op is Op.ALL_TO_ALL and root == "v":
            ialltoallv, me = comm.Ialltoallv, group.rank

            def issue_v(out, out_count, out_rows, inp, in_count, in_rows, out_splits,
                        in_splits):
                out_counts = _split_counts(out_splits, out_count, out_rows, n)
                in_counts = _split_counts(in_splits, in_count, in_rows, n)
                if out_counts is None or in_counts is None or out_counts[me] != in_counts[me]:
                    return False  # nothing sent: the general path judges the splits
                return ialltoallv(
                    [mem(inp if in_count else 0, in_count * isz), (in_counts, _displs(in_counts)),
                     mtype],
                    [mem(out if out_count else 0, out_count * isz),
                     (out_counts, _displs(out_counts)), mtype])
            return issue_v
        if op is Op.ALL_TO_ALL:
            ialltoall = comm.Ialltoall
            return lambda out, inp, count: ialltoall(
                [mem(inp if count else 0, n * count * isz), count, mtype],
                [mem(out if count else 0, n * count * isz), count, mtype])
        if op is Op.SEND:
            isend = comm.Isend
            return lambda ptr, count, peer, tag: isend(spec(ptr, count), peer, tag)
        if op is Op.RECV:
            irecv, any_source = comm.Irecv, MPI.ANY_SOURCE

            def issue_recv(ptr, count, peer, tag):
                status = MPI.Status()
                req = irecv(spec(ptr, count), any_source if peer is None else peer, tag)
                return _RecvRequest(req, status)
            return issue_recv
        return None

    def fast_blocking(self, op, group, dtype, red=None, root=None):
        """The compiled form of ``fast_issuer``'s issuer for blocking calls (see
        ``mpi_fast.c``): ``blocking(spin_s, *args)`` with the issuer's arguments issues
        the same nonblocking MPI call and polls it for at most ``spin_s`` seconds;
        it returns None if it completed (a receive: the source's group rank), else what
        ``fast_request`` turns into the pending request. None where the module is not in
        use (``fast_module``). What it returns unfinished is already the call's Work
        (the uneven all-to-all's holds the count arrays MPI reads until completion, as
        ``counts``); a call MPI failed, at the issue or a poll, gives its Work done with
        the ``MPIError`` as ``error``, which its wait raises as a library failure
        (CommFailedError, the group marked broken), as the engine's poll would. Also sets how the fast path's Works wait
        (``_FastWork.wait``): in the module where it is in use."""
        c = fast_module()
        _FastWork.wait = MPIWork.wait if c is None else c.work_wait
        if c is None or (dtype is not None and dtype not in _TYPES):
            return None
        if red is not None and (dtype.is_half or red is ReduceOp.AVG):
            return None
        comm = self.comm(group).handle
        if op is Op.BARRIER:
            return functools.partial(c.barrier, comm)
        mtype = _TYPES[dtype].handle
        if op is Op.ALL_REDUCE:
            return functools.partial(c.allreduce, comm, mtype, _OPS[red].handle)
        if op is Op.BROADCAST:
            return functools.partial(c.bcast, comm, mtype, root)
        if op is Op.REDUCE:
            return functools.partial(c.reduce, comm, mtype, _OPS[red].handle, root,
                                     group.rank == root)
        if op is Op.ALL_GATHER:
            return functools.partial(c.allgather, comm, mtype)
        if op is Op.REDUCE_SCATTER:
            return functools.partial(c.reduce_scatter, comm, mtype, _OPS[red].handle)
        if op is Op.ALL_TO_ALL and root is None:
            return functools.partial(c.alltoall, comm, mtype)
        if op is Op.ALL_TO_ALL and root == "v":
            return functools.partial(c.alltoallv, comm, mtype, group.size, group.rank)
        if op is Op.ALL_TO_ALL and root == "list":
            return functools.partial(c.alltoall_list, comm, mtype, group.size, group.rank)
        if op is Op.GATHER:
            return functools.partial(c.gather, comm, mtype, root, group.rank == root)
        if op is Op.SCATTER:
            return functools.partial(c.scatter, comm, mtype, root, group.rank == root)
        if op is Op.SEND:
            return functools.partial(c.send, comm, mtype)
        if op is Op.RECV:
            return functools.partial(c.recv, comm, mtype)
        return None

    @staticmethod
    def fast_request(left):
        """The pending call a ``fast_blocking`` call left: its Work already (made by the
        compiled module), as ``fast_issuer``'s compiled issuer returns it."""
        return left

    @functools.cached_property
    def fast_launch(self):
        """``launch(op, group, issue, args, spans, keep, engine)`` (``Backend.fast_launch``):
        the compiled module's where it is built, one C call that checks the memory
        against the work in flight, issues, fills in the Work the issuer made and
        appends it to the engine's in-flight list; else the Python one. Looked up once
        per backend (``compiled()`` decides once per process): later reads are an
        attribute's."""
        c = compiled()[0]
        return Backend.fast_launch.__get__(self) if c is None else c.launch

    def fast_work(self, op, group, req, spans, keep):
        """The Work, unregistered, of what an issuer of ``fast_issuer`` returned (``keep``:
        what keeps the memory alive): the compiled module's Work, completed here, or a
        Work made without the constructor around the Python issuers' request."""
        cls = req.__class__
        if cls is _FastWork or cls is _FastRecvWork:  # made by the compiled module
            req.op, req.group, req.keep, req.spans = op, group, keep, spans
            return req
        if cls is _RecvRequest:
            w = _FastRecvWork.__new__(_FastRecvWork)
            w.status, req = req.status, req.req
        else:
            w = _FastWork.__new__(_FastWork)
        w.op, w.group, w.req, w.keep, w.spans = op, group, req, keep, spans
        return w

    def barrier(self, group):
        return MPIWork(Op.BARRIER, group, self.comm(group).Ibarrier())
