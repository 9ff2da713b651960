"""The public calls of the core, on anything DLPack can describe (numpy, torch, jax,
cupy arrays or Buffers). Names, arguments and semantics follow torch.distributed:
``src``/``dst`` are global ranks, collectives work in place where torch's do, and
``async_op=True`` returns a Work (``wait()``, ``is_completed()``), else None.
"""
from __future__ import annotations

import contextlib

import numpy as np
from numpy import ndarray as _ndarray

from ..base import dtypes as _dt
from ..base.errors import McrdlError
from ..base.ops import Op, ReduceOp
from ..engine.work import ChainWork
from ..memory import alloc
from ..memory import cuda as _cuda
from ..memory.buffer import Buffer, Device
from ..world.backend import backend_class
from . import fastpath as _fast
from . import hooks as _hooks
from . import validate as _v
from .runtime import get_runtime


def prepare(op, group, buf, backend, reduce_op=None, nbytes=-1):
    """The checks and selection of a call, without issuing it: (runtime, group, backend
    instance, reduce op). ``buf`` may be metadata only (a traced value's shape and
    dtype): what a frontend that issues the call its own way needs (the JAX lowering
    under ``jit``). Raises the call's errors, as the call itself would."""
    rt = get_runtime()
    g = rt.group(group)
    if reduce_op is not None:
        reduce_op = ReduceOp.coerce(reduce_op)
        _v.reduce_op(reduce_op, buf.dtype)
    be = rt.select(op, g, buf, backend, reduce_op, nbytes)
    return rt, g, be, reduce_op


def _compression(compression, op, rt, g, backend, buf: Buffer, reduce_op=None):
    """The compression allowed for this call (``compression=``, then MCRDL_COMPRESSION),
    checked against its dtype and reduce op; None (the usual case) costs one env lookup,
    and None too where an ``auto:`` spec keeps the backend's own collective."""
    if compression is None and not _fast.compression_env():
        return None
    t = _compress()
    cz = t.resolve(compression, op, buf.dtype, reduce_op)
    return None if t.keeps_plain(cz, rt, g, op, buf, backend) else cz


def _compress():
    """The compression transform (``hooks``: loaded at the first call that allows
    compression)."""
    return _hooks.transform("compression")


def _fast_one(fast, buf: Buffer, *args):
    """A one-buffer call's try of the fast path (``fastpath.send``, ``recv``,
    ``broadcast``, ``reduce``), whose first call of a key fills the memo from ``buf``;
    MISS for device memory."""
    if buf.device.kind != "cpu":
        return _fast.MISS
    return fast(get_runtime(), buf.ptr, buf.numel, buf.dtype, buf, *args, buf)


def _xp_copy(dst: Buffer, src_arr) -> None:
    d = dst.array()
    d[...] = src_arr.reshape(d.shape)


def _copies_into(targets, sources=(), after_current=False):
    """Where CuPy copies of a list-form call run (see ``cuda.copies_into``): on the
    stream of what they write, after what they read. Host buffers: no context."""
    if targets[0].device.kind != "cuda":
        return contextlib.nullcontext()
    return _cuda.copies_into(targets, sources, after_current)


def _concat(bufs, total: int) -> Buffer:
    tmp = alloc.empty((total,), bufs[0].dtype, bufs[0].device, like=bufs[0])
    with _copies_into([tmp], bufs):
        t = tmp.array()
        off = 0
        for b in bufs:
            t[off:off + b.numel] = b.array().reshape(-1)
            off += b.numel
    return tmp


def _scatter_into(tmp: Buffer, outs) -> None:
    with _copies_into(outs, after_current=True):
        t = tmp.array()
        off = 0
        for b in outs:
            _xp_copy(b, t[off:off + b.numel])
            off += b.numel


# --- point to point ------------------------------------------------------------------------
def send(tensor, dst: int, group=None, tag: int = 0, async_op: bool = False, backend=None):
    buf = _v.input(tensor, "tensor")
    done = _fast_one(_fast.send, buf, dst, tag, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    rt, g, be, _ = prepare(Op.SEND, group, buf, backend)
    peer = g.group_rank(dst, "dst")
    spans = rt.order(reads=(buf,), keep=async_op)
    return rt.finish(be.send(g, buf, peer, int(tag)), spans, async_op, buf.nbytes)


def recv(tensor, src: int | None = None, group=None, tag: int = 0, async_op: bool = False,
         backend=None):
    """Receive into ``tensor``. Blocking: returns the sender's global rank; async: a Work
    whose ``result()`` is that rank. ``src=None`` receives from any rank."""
    buf = _v.output(tensor, "tensor")
    done = _fast_one(_fast.recv, buf, src, tag, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    rt, g, be, _ = prepare(Op.RECV, group, buf, backend)
    peer = None if src is None else g.group_rank(src, "src")
    spans = rt.order(writes=(buf,), keep=async_op)
    work = be.recv(g, buf, peer, int(tag))
    work.add_finalizer(lambda: setattr(work, "value", g.global_rank(work.value)))
    rt.finish(work, spans, async_op, buf.nbytes)
    return work if async_op else work.value


def isend(tensor, dst: int, group=None, tag: int = 0, backend=None):
    return send(tensor, dst, group, tag, True, backend)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, backend=None):
    return recv(tensor, src, group, tag, True, backend)


# --- rooted and symmetric collectives ------------------------------------------------------
def broadcast(tensor, src: int = 0, group=None, async_op: bool = False, backend=None):
    buf = _v.output(tensor, "tensor")
    done = _fast_one(_fast.broadcast, buf, src, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    rt, g, be, _ = prepare(Op.BROADCAST, group, buf, backend)
    root = g.group_rank(src, "src")
    if rt.observed:
        rt.before(g, Op.BROADCAST, be, buf, root=root, count=buf.numel)
    spans = rt.order(writes=(buf,), keep=async_op)
    return rt.finish(be.broadcast(g, buf, root), spans, async_op, buf.nbytes)


def reduce(tensor, dst: int = 0, op=ReduceOp.SUM, group=None, async_op: bool = False,
           backend=None):
    buf = _v.output(tensor, "tensor")
    done = _fast_one(_fast.reduce, buf, dst, op, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    rt, g, be, op = prepare(Op.REDUCE, group, buf, backend, op)
    root = g.group_rank(dst, "dst")
    if rt.observed:
        rt.before(g, Op.REDUCE, be, buf, reduce_op=op, root=root, count=buf.numel)
    spans = rt.order(writes=(buf,), keep=async_op)
    return rt.finish(be.reduce(g, buf, root, op), spans, async_op, buf.nbytes)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, backend=None,
               compression=None):
    """``compression``: allow a codec (docs/compression.md); None: MCRDL_COMPRESSION/off.
    Small host calls with nothing else in flight take ``fastpath`` (same checks, memoized).
    ``backend="hier"`` / ``"hier:NAME"``: the two-level all-reduce (``mcrdl_core.algorithms.hier``)."""
    if backend.__class__ is str and backend[:4] == "hier":
        return _hierarchical(tensor, op, group, async_op, backend, compression)
    if compression is None and type(tensor) is _ndarray:
        done = _fast.ndarray_all_reduce(get_runtime(), tensor, op, group, async_op, backend)
        if done is not _fast.MISS:
            return done
    buf = _v.output(tensor, "tensor")
    if compression is None:
        done = _fast.all_reduce(get_runtime(), buf, op, group, async_op, backend)
        if done is not _fast.MISS:
            return done
    rt, g, be, op = prepare(Op.ALL_REDUCE, group, buf, backend, op)
    cz = _compression(compression, Op.ALL_REDUCE, rt, g, backend, buf, op)
    if cz is not None:
        return _compress().all_reduce(rt, g, buf, op, cz, backend, async_op)
    if rt.observed:
        rt.before(g, Op.ALL_REDUCE, be, buf, reduce_op=op, count=buf.numel)
    spans = rt.order(writes=(buf,), keep=async_op)
    return rt.finish(be.all_reduce(g, buf, op), spans, async_op, buf.nbytes)


def _hier_request(call: str, backend: str, compression):
    """(the ``hierarchical`` transform, the backend named for its steps or None) of a
    ``backend="hier..."`` request, refused with a clear error where it is malformed or
    comes with a compression (the two-level algorithms are lossless)."""
    t = _hooks.transform("hierarchical")
    name = t.inner(backend)
    if compression is not None:
        raise _v.InvalidArgumentError(
            f"{call}(backend={backend!r}, compression={compression!r}): the hierarchical "
            "algorithms are lossless and take no compression; drop one of the two")
    return t, name


def _hierarchical(tensor, op, group, async_op, backend, compression):
    """``all_reduce(..., backend="hier")``: checked as any all-reduce (the flat choice
    for the checks: dtype, reduce op, group), then the ``hierarchical`` transform."""
    t, name = _hier_request("all_reduce", backend, compression)
    buf = _v.output(tensor, "tensor")
    rt, g, be, op = prepare(Op.ALL_REDUCE, group, buf, name, op)
    if rt.observed:
        rt.before(g, Op.ALL_REDUCE, be, buf, reduce_op=op, count=buf.numel)
    return t.all_reduce(rt, g, buf, op, backend, async_op)


def _hierarchical_a2a(output, input, output_split_sizes, input_split_sizes, group,
                      async_op, backend, compression):
    """``all_to_all_single(..., backend="hier")``: the two-level all-to-all for an even
    call (no split sizes), checked as the plain call is; a call with split sizes runs
    the plain all-to-all on the named backend (``hier:NAME``) or the usual choice."""
    t, name = _hier_request("all_to_all_single", backend, compression)
    if output_split_sizes or input_split_sizes:
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, group,
                                 async_op, name)
    out = _v.output(output, "output")
    inp = _v.input(input, "input")
    _v.same_kind([out, inp], "all_to_all_single")
    rt, g, be, _ = prepare(Op.ALL_TO_ALL, group, inp, name)
    counts = _v.splits(None, inp, g.size, "input_split_sizes")
    _v.splits(None, out, g.size, "output_split_sizes")
    _v.numel(out, inp.numel, "output", "the input's element count")
    if rt.observed:
        rt.before(g, Op.ALL_TO_ALL, be, inp, counts=(counts, counts))
    return t.all_to_all(rt, g, out, inp, backend, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False,
                           backend=None, compression=None):
    out = _v.output(output_tensor, "output_tensor")
    inp = _v.input(input_tensor, "input_tensor")
    _v.same_kind([out, inp], "all_gather_into_tensor")
    if compression is None and inp.device.kind == "cpu":
        done = _fast.all_gather(get_runtime(), out.ptr, out.numel, inp.ptr, inp.numel, inp.dtype,
                                (out, inp), group, async_op, backend, inp)
        if done is not _fast.MISS:
            return done
    rt, g, be, _ = prepare(Op.ALL_GATHER, group, inp, backend)
    _v.numel(out, g.size * inp.numel, "output_tensor", f"group size {g.size} x input elements")
    cz = _compression(compression, Op.ALL_GATHER, rt, g, backend, inp)
    if cz is not None:
        return _compress().all_gather(rt, g, out, inp, cz, backend, async_op)
    if rt.observed:
        rt.before(g, Op.ALL_GATHER, be, inp, count=inp.numel)
    spans = rt.order(reads=(inp,), writes=(out,), keep=async_op)
    return rt.finish(be.all_gather(g, out, inp), spans, async_op, out.nbytes)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, backend=None,
               compression=None):
    outs = [_v.output(t, f"tensor_list[{i}]") for i, t in enumerate(tensor_list)]
    inp = _v.input(tensor, "tensor")
    _v.same_kind(outs + [inp], "all_gather")
    rt, g, be, _ = prepare(Op.ALL_GATHER, group, inp, backend)
    if len(outs) != g.size:
        raise _v.InvalidArgumentError(f"all_gather: tensor_list has {len(outs)} tensors for a "
                                      f"group of {g.size}; give one per rank")
    for i, o in enumerate(outs):
        _v.numel(o, inp.numel, f"tensor_list[{i}]", "each must match the input tensor")
    # one contiguous result on the outputs' producer stream, copied into the list after
    tmp = alloc.empty((g.size * inp.numel,), inp.dtype, inp.device, like=outs[0])
    cz = _compression(compression, Op.ALL_GATHER, rt, g, backend, inp)
    if cz is not None:
        return _compress().all_gather(rt, g, tmp, inp, cz, backend, async_op, writes=outs,
                                then=lambda: _scatter_into(tmp, outs))
    if rt.observed:
        rt.before(g, Op.ALL_GATHER, be, inp, count=inp.numel)
    spans = rt.order(reads=(inp,), writes=outs, keep=async_op)
    work = be.all_gather(g, tmp, inp)
    work.add_finalizer(lambda: _scatter_into(tmp, outs))
    return rt.finish(work, spans, async_op, tmp.nbytes)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False,
                          backend=None, compression=None):
    out = _v.output(output, "output")
    inp = _v.input(input, "input")
    _v.same_kind([out, inp], "reduce_scatter_tensor")
    if compression is None and out.device.kind == "cpu":
        done = _fast.reduce_scatter(get_runtime(), out.ptr, out.numel, inp.ptr, inp.numel,
                                    out.dtype, (out, inp), op, group, async_op, backend, out)
        if done is not _fast.MISS:
            return done
    rt, g, be, op = prepare(Op.REDUCE_SCATTER, group, out, backend, op)
    _v.numel(inp, g.size * out.numel, "input", f"group size {g.size} x output elements")
    cz = _compression(compression, Op.REDUCE_SCATTER, rt, g, backend, out, op)
    if cz is not None:
        return _compress().reduce_scatter(rt, g, out, inp, op, cz, backend, async_op)
    if rt.observed:
        rt.before(g, Op.REDUCE_SCATTER, be, out, reduce_op=op, count=out.numel)
    spans = rt.order(reads=(inp,), writes=(out,), keep=async_op)
    return rt.finish(be.reduce_scatter(g, out, inp, op), spans, async_op, inp.nbytes)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   backend=None, compression=None):
    out = _v.output(output, "output")
    ins = [_v.input(t, f"input_list[{i}]") for i, t in enumerate(input_list)]
    _v.same_kind([out] + ins, "reduce_scatter")
    rt, g, be, op = prepare(Op.REDUCE_SCATTER, group, out, backend, op)
    if len(ins) != g.size:
        raise _v.InvalidArgumentError(f"reduce_scatter: input_list has {len(ins)} tensors for a "
                                      f"group of {g.size}; give one per rank")
    for i, b in enumerate(ins):
        _v.numel(b, out.numel, f"input_list[{i}]", "each must match the output tensor")
    cz = _compression(compression, Op.REDUCE_SCATTER, rt, g, backend, out, op)
    if cz is not None:
        rt.order(reads=ins, writes=(out,), keep=False)  # before the inputs are read
        tmp = _concat(ins, g.size * out.numel)
        return _compress().reduce_scatter(rt, g, out, tmp, op, cz, backend, async_op)
    if rt.observed:
        rt.before(g, Op.REDUCE_SCATTER, be, out, reduce_op=op, count=out.numel)
    spans = rt.order(reads=ins, writes=(out,), keep=async_op)
    tmp = _concat(ins, g.size * out.numel)
    return rt.finish(be.reduce_scatter(g, out, tmp, op), spans, async_op, tmp.nbytes)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, backend=None, compression=None):
    """``compression``: allow a codec for the exchanged blocks (docs/compression.md);
    None: MCRDL_COMPRESSION's ``all_to_all=`` key, else off."""
    if backend.__class__ is str and backend[:4] == "hier":
        return _hierarchical_a2a(output, input, output_split_sizes, input_split_sizes,
                                 group, async_op, backend, compression)
    out = _v.output(output, "output")
    inp = _v.input(input, "input")
    _v.same_kind([out, inp], "all_to_all_single")
    rt = get_runtime()
    if compression is None and inp.device.kind == "cpu":
        done = _fast.all_to_all(rt, out.ptr, out.numel, out.shape[0] if out.shape else 1,
                                inp.ptr, inp.numel, inp.shape[0] if inp.shape else 1, inp.dtype,
                                (out, inp), output_split_sizes, input_split_sizes, group,
                                async_op, backend, inp)
        if done is not _fast.MISS:
            return done
    g = rt.group(group)
    out_counts = _v.splits(output_split_sizes, out, g.size, "output_split_sizes")
    in_counts = _v.splits(input_split_sizes, inp, g.size, "input_split_sizes")
    even = len(set(out_counts)) == 1 and len(set(in_counts)) == 1 and out_counts == in_counts
    nbytes = inp.nbytes if even and not (output_split_sizes or input_split_sizes) else None
    _, _, be, _ = prepare(Op.ALL_TO_ALL, g, inp, backend, nbytes=nbytes)
    cz = _compression(compression, Op.ALL_TO_ALL, rt, g, backend, inp)
    if cz is not None:
        return _compress().all_to_all(rt, g, out, inp, out_counts, in_counts, cz, backend,
                                         async_op, nbytes)
    if rt.observed:
        rt.before(g, Op.ALL_TO_ALL, be, inp, counts=(out_counts, in_counts))
    spans = rt.order(reads=(inp,), writes=(out,), keep=async_op)
    form_even = not output_split_sizes and not input_split_sizes
    return rt.finish(be.all_to_all(g, out, inp, out_counts, in_counts, form_even), spans,
                     async_op, inp.nbytes)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False,
               backend=None, compression=None):
    """``compression``: as for ``all_to_all_single``."""
    outs = [_v.output(t, f"output_tensor_list[{i}]") for i, t in enumerate(output_tensor_list)]
    ins = [_v.input(t, f"input_tensor_list[{i}]") for i, t in enumerate(input_tensor_list)]
    if not outs or not ins:
        raise _v.InvalidArgumentError("all_to_all: tensor lists must not be empty")
    _v.same_kind(outs + ins, "all_to_all")
    rt = get_runtime()
    g = rt.group(group)
    if len(outs) != g.size or len(ins) != g.size:
        raise _v.InvalidArgumentError(f"all_to_all: {len(outs)} output and {len(ins)} input "
                                      f"tensors for a group of {g.size}; give one per rank")
    out_counts = [b.numel for b in outs]
    in_counts = [b.numel for b in ins]
    even = len(set(out_counts + in_counts)) == 1
    nbytes = sum(b.nbytes for b in ins) if even else None
    _, _, be, _ = prepare(Op.ALL_TO_ALL, g, ins[0], backend, nbytes=nbytes)
    cz = _compression(compression, Op.ALL_TO_ALL, rt, g, backend, ins[0])
    if cz is not None:
        rt.order(reads=ins, writes=outs, keep=False)  # before the inputs are read
        tmp_in = _concat(ins, sum(in_counts))
        tmp_out = alloc.empty((sum(out_counts),), outs[0].dtype, outs[0].device, like=outs[0])
        return _compress().all_to_all(rt, g, tmp_out, tmp_in, out_counts, in_counts, cz,
                                         backend, async_op, nbytes, writes=outs,
                                         then=lambda: _scatter_into(tmp_out, outs))
    if rt.observed:
        rt.before(g, Op.ALL_TO_ALL, be, ins[0], counts=(out_counts, in_counts))
    spans = rt.order(reads=ins, writes=outs, keep=async_op)
    tmp_in = _concat(ins, sum(in_counts))
    tmp_out = alloc.empty((sum(out_counts),), outs[0].dtype, outs[0].device, like=outs[0])
    work = be.all_to_all(g, tmp_out, tmp_in, out_counts, in_counts)
    work.add_finalizer(lambda: _scatter_into(tmp_out, outs))
    return rt.finish(work, spans, async_op, tmp_in.nbytes)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           backend=None):
    """Gather ``tensor`` from every rank into ``gather_list`` on ``dst`` (ignored elsewhere)."""
    inp = _v.input(tensor, "tensor")
    rt, g, be, _ = prepare(Op.GATHER, group, inp, backend)
    root = g.group_rank(dst, "dst")
    outs = []
    if g.rank == root:
        if gather_list is None or len(gather_list) != g.size:
            raise _v.InvalidArgumentError(f"gather: the destination rank needs a gather_list of "
                                          f"{g.size} tensors (one per rank of the group)")
        outs = [_v.output(t, f"gather_list[{i}]") for i, t in enumerate(gather_list)]
        _v.same_kind(outs + [inp], "gather")
        for i, o in enumerate(outs):
            _v.numel(o, inp.numel, f"gather_list[{i}]", "each must match the input tensor")
    if rt.observed:
        rt.before(g, Op.GATHER, be, inp, root=root, count=inp.numel)
    spans = rt.order(reads=(inp,), writes=outs, keep=async_op)
    tmp = (alloc.empty((g.size * inp.numel,), inp.dtype, inp.device, like=outs[0])
           if outs else None)
    work = be.gather(g, tmp, inp, root)
    if outs:
        work.add_finalizer(lambda: _scatter_into(tmp, outs))
    return rt.finish(work, spans, async_op, g.size * inp.nbytes)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            backend=None):
    """Scatter ``scatter_list`` (given on ``src``) into ``tensor`` on every rank."""
    out = _v.output(tensor, "tensor")
    rt, g, be, _ = prepare(Op.SCATTER, group, out, backend)
    root = g.group_rank(src, "src")
    tmp, ins = None, []
    if g.rank == root:
        if scatter_list is None or len(scatter_list) != g.size:
            raise _v.InvalidArgumentError(f"scatter: the source rank needs a scatter_list of "
                                          f"{g.size} tensors (one per rank of the group)")
        ins = [_v.input(t, f"scatter_list[{i}]") for i, t in enumerate(scatter_list)]
        _v.same_kind(ins + [out], "scatter")
        for i, b in enumerate(ins):
            _v.numel(b, out.numel, f"scatter_list[{i}]", "each must match the output tensor")
    if rt.observed:
        rt.before(g, Op.SCATTER, be, out, root=root, count=out.numel)
    spans = rt.order(reads=ins, writes=(out,), keep=async_op)
    if ins:
        tmp = _concat(ins, g.size * out.numel)
    return rt.finish(be.scatter(g, out, tmp, root), spans, async_op, g.size * out.nbytes)


# --- barrier -------------------------------------------------------------------------
_HOST_PROBE: list = []


def barrier_probe(rt, group, backend: str | None) -> Buffer:
    """The buffer a barrier is selected with (a barrier moves no data; selection needs a
    device). A host buffer, unless the backend the call names -- ``backend``, else the
    group's default (``init_process_group("nccl")``, ``new_group(backend=)``), else an
    ``MCRDL_BACKEND`` override -- handles no host buffers (nccl): then a one-byte CUDA
    buffer on the current device, metadata only (never read or written). An unknown or
    unavailable name gets the host probe; selection then says why it cannot run."""
    name = rt.named_backend(Op.BARRIER, group, backend)
    if name is not None:
        try:
            devices = backend_class(name).devices
        except McrdlError:
            devices = ("cpu",)
        if "cpu" not in devices and rt.unavailable_reason(name) is None:
            return Buffer(0, (1,), _dt.uint8, Device("cuda", _cuda.current_device()))
    if not _HOST_PROBE:
        _HOST_PROBE.append(Buffer.from_numpy(np.zeros(1, dtype=np.uint8)))
    return _HOST_PROBE[0]


def barrier(group=None, async_op: bool = False, backend=None):
    """Selected with a host probe buffer, or a CUDA one when the backend named for the
    call handles CUDA buffers only (nccl): see ``barrier_probe``.

    It completes only after the group's collectives issued before it (as Gloo's barrier
    does; an async all-reduce's result is in place once a barrier returns), on whatever
    backend they run. Point-to-point work is not waited, as in Gloo: a receive posted
    before a barrier and matched after it must not deadlock."""
    rt = get_runtime()
    probe = barrier_probe(rt, rt.group(group), backend)
    if probe.device.kind == "cpu":
        done = _fast.barrier(rt, group, async_op, backend, probe)
        if done is not _fast.MISS:
            return done
    rt, g, be, _ = prepare(Op.BARRIER, group, probe, backend)
    if rt.observed:
        rt.before(g, Op.BARRIER, be, probe)
    prior = [w for w in rt.engine.inflight if w.group is g and w.op not in _P2P]
    return rt.finish(_after(be.barrier(g), prior), [], async_op, 0)


_P2P = (Op.SEND, Op.RECV)


def _after(work, prior):
    """``work``, completing only once every work in ``prior`` is complete as well (a
    chain of stages; a failed one fails the whole, with its error)."""
    if not prior:
        return work
    rest = list(prior)

    def then():
        while rest:
            w = rest.pop()
            if not w.done or w.error is not None:
                return ChainWork(w, then)
        return None
    return ChainWork(work, then)
