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

Buffers are passed to MPI by address (``MPI.buffer.fromaddress``), no copies.
CUDA buffers are not handled here yet (the GPU issue adds CUDA-aware and staged paths).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mcrdl_core import dtypes as dt
from mcrdl_core.backend import Backend
from mcrdl_core.buffer import Buffer
from mcrdl_core.ops import Op, ReduceOp
from mcrdl_core.work import Work

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

    def _poll(self) -> bool:
        return self.req.Test(self.status) if self.status is not None else self.req.Test()

    @classmethod
    def poll_many(cls, works) -> None:
        plain = [w for w in works if w.status is None and not w._done]
        if plain:
            done = MPI.Request.Testsome([w.req for w in plain])
            for i in done or ():
                plain[i]._complete()
        for w in works:
            if w.status is not None and not w._done and w._poll():
                w._complete()

    def _complete(self, error=None):
        super()._complete(error)
        self.keep = ()


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


class MPIBackend(Backend):
    name = "mpi"
    devices = ("cpu",)

    @classmethod
    def unavailable_reason(cls, bootstrap):
        if bootstrap.kind != "mpi":
            return bootstrap.mpi_reason
        return None

    def unsupported_reason(self, op, device, dtype, reduce_op=None):
        if device.kind != "cpu":
            return ("the mpi backend does not handle CUDA buffers yet (CUDA-aware and staged "
                    "paths come with the GPU work)")
        if dtype not in _TYPES:
            return f"the mpi backend has no MPI datatype for {dtype.name}"
        return None

    def create_comm(self, group):
        world = MPI.COMM_WORLD
        if group.id == 0:
            return world.Dup()
        sub = world.Get_group().Incl(list(group.ranks))
        try:
            return world.Create_group(sub, tag=group.id)
        finally:
            sub.Free()

    def destroy(self):
        for g in self.rt.groups:
            c = g.comms.pop(self.name, None)
            if c is not None and c != MPI.COMM_NULL:
                c.Free()

    # --- point to point -----------------------------------------------------------------
    def send(self, group, buf, dst, tag):
        req = self.comm(group).Isend(_spec(buf), dst, tag)
        return MPIWork(Op.SEND, group, req, (buf,), desc=f"to group rank {dst}")

    def recv(self, group, buf, src, tag):
        status = MPI.Status()
        source = MPI.ANY_SOURCE if src is None else src
        req = self.comm(group).Irecv(_spec(buf), source, tag)
        work = MPIWork(Op.RECV, group, req, (buf,), status=status,
                       desc=f"from group rank {'any' if src is None else src}")
        work.add_finalizer(lambda: setattr(work, "_result", status.Get_source()))
        return work

    # --- collectives --------------------------------------------------------------------
    def broadcast(self, group, buf, root):
        return MPIWork(Op.BROADCAST, group, self.comm(group).Ibcast(_spec(buf), root), (buf,))

    def reduce(self, group, buf, root, op):
        r = _Reducible(buf, op, group.size)
        comm = self.comm(group)
        if group.rank == root:
            req = comm.Ireduce(MPI.IN_PLACE, _spec(r.work_buf), _OPS[op], root)
            return MPIWork(Op.REDUCE, group, req, (buf, r), finalize=r.finalizer)
        req = comm.Ireduce(_spec(r.work_buf), None, _OPS[op], root)
        return MPIWork(Op.REDUCE, group, req, (buf, r))

    def all_reduce(self, group, buf, op):
        r = _Reducible(buf, op, group.size)
        req = self.comm(group).Iallreduce(MPI.IN_PLACE, _spec(r.work_buf), _OPS[op])
        return MPIWork(Op.ALL_REDUCE, group, req, (buf, r), finalize=r.finalizer)

    def all_gather(self, group, out, inp):
        req = self.comm(group).Iallgather(_spec(inp), _spec(out, inp.numel))
        return MPIWork(Op.ALL_GATHER, group, req, (out, inp))

    def reduce_scatter(self, group, out, inp, op):
        r_in = _Reducible(inp, ReduceOp.SUM, group.size)
        r_out = _Reducible(out, op, group.size, copy_in=False)
        req = self.comm(group).Ireduce_scatter_block(_spec(r_in.work_buf, out.numel),
                                                     _spec(r_out.work_buf),
                                                     _OPS[op])
        return MPIWork(Op.REDUCE_SCATTER, group, req, (out, inp, r_in, r_out),
                       finalize=r_out.finalizer)

    def all_to_all(self, group, out, inp, out_counts, in_counts):
        comm = self.comm(group)
        if len(set(in_counts)) == 1 and in_counts == out_counts:
            req = comm.Ialltoall(_spec(inp, in_counts[0]), _spec(out, out_counts[0]))
        else:
            in_displs = np.concatenate(([0], np.cumsum(in_counts[:-1]))).tolist()
            out_displs = np.concatenate(([0], np.cumsum(out_counts[:-1]))).tolist()
            s_in, s_out = _spec(inp), _spec(out)
            req = comm.Ialltoallv([s_in[0], (in_counts, in_displs), s_in[2]],
                                  [s_out[0], (out_counts, out_displs), s_out[2]])
        return MPIWork(Op.ALL_TO_ALL, group, req, (out, inp))

    def gather(self, group, out, inp, root):
        recv = _spec(out, inp.numel) if group.rank == root else None
        req = self.comm(group).Igather(_spec(inp), recv, root)
        return MPIWork(Op.GATHER, group, req, (out, inp))

    def scatter(self, group, out, inp, root):
        send = _spec(inp, out.numel) if group.rank == root else None
        req = self.comm(group).Iscatter(send, _spec(out), root)
        return MPIWork(Op.SCATTER, group, req, (out, inp))

    def barrier(self, group):
        return MPIWork(Op.BARRIER, group, self.comm(group).Ibarrier())
