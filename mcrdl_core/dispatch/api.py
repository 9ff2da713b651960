"""The public calls of the core, on anything DLPack can describe (numpy, torch, jax,
cupy arrays or Buffers). Names, arguments and semantics follow torch.distributed:
``src``/``dst`` are global ranks, collectives work in place where torch's do, and
``async_op=True`` returns a Work (``wait()``, ``is_completed()``), else None.

Each call is its argument checks that need no group, its try of the fast path
(``fastpath``), and its description as a ``pipeline.Call``, which ``pipeline.run`` runs:
the rules every call shares (order of the checks, selection, compression and the other
transforms, observers, memory ordering, finish) live there, once.
"""
from __future__ import annotations

import contextlib

import numpy as np
from numpy import ndarray as _ndarray

from ..base import dtypes as _dt
from ..base import tags as _tags
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
from .pipeline import Call, run
from .runtime import get_runtime


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
# Each call below: its argument checks that need no group, its try of the fast path, then
# its description (``pipeline.Call``: the checks that need the group, the backend's call,
# the compressed and other variants), which ``pipeline.run`` runs.
def send(tensor, dst: int, group=None, tag: int = 0, async_op: bool = False, backend=None):
    """Send ``tensor`` to global rank ``dst``. ``tag``: in ``[0, USER_TAG_LIMIT)``
    (``mcrdl_core.base.tags``: the tags above are the core's own)."""
    return core_send(tensor, dst, group, _tags.user_tag(tag, "send"), async_op, backend)


def recv(tensor, src: int | None = None, group=None, tag: int = 0, async_op: bool = False,
         backend=None):
    """Receive into ``tensor``. Blocking: returns the sender's global rank; async: a Work
    whose ``result()`` is that rank. ``src=None`` receives from any rank. ``tag``: as
    for ``send``."""
    return core_recv(tensor, src, group, _tags.user_tag(tag, "recv"), async_op, backend)


def core_send(tensor, dst: int, group=None, tag: int = 0, async_op: bool = False,
              backend=None):
    """``send`` on any tag, the core's reserved ones included: for the core's own
    point-to-point algorithms (resharding), never a user's tag."""
    buf = _v.input(tensor, "tensor")
    done = _fast_one(_fast.send, buf, dst, tag, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    tag = int(tag)
    return run(Call(Op.SEND, group, backend, buf, async_op=async_op, reads=(buf,),
                    log_bytes=buf.nbytes, check=lambda g, c: {"peer": g.group_rank(dst, "dst")},
                    issue=lambda be, g, red, sig: be.send(g, buf, sig["peer"], tag)))


def core_recv(tensor, src: int | None = None, group=None, tag: int = 0,
              async_op: bool = False, backend=None):
    """``recv`` on any tag (see ``core_send``)."""
    buf = _v.output(tensor, "tensor")
    done = _fast_one(_fast.recv, buf, src, tag, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    tag = int(tag)

    def issue(be, g, red, sig):
        work = be.recv(g, buf, sig["peer"], tag)
        work.add_finalizer(lambda: setattr(work, "value", g.global_rank(work.value)))
        return work

    return run(Call(Op.RECV, group, backend, buf, async_op=async_op, writes=(buf,),
                    log_bytes=buf.nbytes, issue=issue, value=True,
                    check=lambda g, c: {"peer": None if src is None else g.group_rank(src, "src")}))


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
    return run(Call(Op.BROADCAST, group, backend, buf, async_op=async_op, writes=(buf,),
                    log_bytes=buf.nbytes,
                    check=lambda g, c: {"root": g.group_rank(src, "src"), "count": buf.numel},
                    issue=lambda be, g, red, sig: be.broadcast(g, buf, sig["root"])))


def reduce(tensor, dst: int = 0, op=ReduceOp.SUM, group=None, async_op: bool = False,
           backend=None):
    buf = _v.output(tensor, "tensor")
    done = _fast_one(_fast.reduce, buf, dst, op, group, async_op, backend)
    if done is not _fast.MISS:
        return done
    return run(Call(Op.REDUCE, group, backend, buf, reduce_op=op, async_op=async_op,
                    writes=(buf,), log_bytes=buf.nbytes,
                    check=lambda g, c: {"root": g.group_rank(dst, "dst"), "count": buf.numel},
                    issue=lambda be, g, red, sig: be.reduce(g, buf, sig["root"], red)))


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
    return run(Call(
        Op.ALL_REDUCE, group, backend, buf, reduce_op=op, compression=compression,
        async_op=async_op, writes=(buf,), log_bytes=buf.nbytes,
        check=lambda g, c: {"count": buf.numel},
        issue=lambda be, g, red, sig: be.all_reduce(g, buf, red),
        compressed=lambda t, rt, g, red, sig, cz: t.all_reduce(rt, g, buf, red, cz, backend,
                                                              async_op),
        algorithm=lambda name, rt, g, red: _hooks.transform("hierarchical").all_reduce(
            rt, g, buf, red, name, async_op)))


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
    return run(Call(Op.ALL_REDUCE, group, name, buf, reduce_op=op, async_op=async_op,
                    check=lambda g, c: {"count": buf.numel}, via="hier",
                    takeover=lambda rt, g, red: t.all_reduce(rt, g, buf, red, backend,
                                                             async_op)))


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

    def check(g, c):
        counts = _v.splits(None, inp, g.size, "input_split_sizes")
        _v.splits(None, out, g.size, "output_split_sizes")
        _v.numel(out, inp.numel, "output", "the input's element count")
        return {"counts": (counts, counts)}

    return run(Call(Op.ALL_TO_ALL, group, name, inp, async_op=async_op, check=check, via="hier",
                    takeover=lambda rt, g, red: t.all_to_all(rt, g, out, inp, backend,
                                                             async_op)))


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

    def check(g, c):
        _v.numel(out, g.size * inp.numel, "output_tensor", f"group size {g.size} x input elements")
        return {"count": inp.numel}

    return run(Call(
        Op.ALL_GATHER, group, backend, inp, compression=compression, async_op=async_op,
        reads=(inp,), writes=(out,), log_bytes=out.nbytes, check=check,
        issue=lambda be, g, red, sig: be.all_gather(g, out, inp),
        compressed=lambda t, rt, g, red, sig, cz: t.all_gather(rt, g, out, inp, cz, backend,
                                                              async_op)))


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, backend=None,
               compression=None):
    outs = [_v.output(t, f"tensor_list[{i}]") for i, t in enumerate(tensor_list)]
    inp = _v.input(tensor, "tensor")
    _v.same_kind(outs + [inp], "all_gather")
    if compression is None and inp.device.kind == "cpu":
        done = _fast.all_gather_list(get_runtime(), _fast.list_facts(outs, True), inp.ptr, inp.numel,
                                     inp.dtype, (outs, inp), group, async_op, backend, inp)
        if done is not _fast.MISS:
            return done

    def check(g, c):
        if len(outs) != g.size:
            raise _v.InvalidArgumentError(f"all_gather: tensor_list has {len(outs)} tensors "
                                          f"for a group of {g.size}; give one per rank")
        for i, o in enumerate(outs):
            _v.numel(o, inp.numel, f"tensor_list[{i}]", "each must match the input tensor")
        return {"count": inp.numel}

    def staging():  # one contiguous result, copied into the list after
        return alloc.empty((len(outs) * inp.numel,), inp.dtype, inp.device, like=outs[0])

    def issue(be, g, red, sig):
        tmp = staging()
        work = be.all_gather(g, tmp, inp)
        work.add_finalizer(lambda: _scatter_into(tmp, outs))
        return work

    def compressed(t, rt, g, red, sig, cz):
        tmp = staging()
        return t.all_gather(rt, g, tmp, inp, cz, backend, async_op, writes=outs,
                            then=lambda: _scatter_into(tmp, outs))

    return run(Call(Op.ALL_GATHER, group, backend, inp, compression=compression,
                    async_op=async_op, reads=(inp,), writes=outs,
                    log_bytes=len(outs) * inp.nbytes, check=check, issue=issue,
                    compressed=compressed))


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

    def check(g, c):
        _v.numel(inp, g.size * out.numel, "input", f"group size {g.size} x output elements")
        return {"count": out.numel}

    return run(Call(
        Op.REDUCE_SCATTER, group, backend, out, reduce_op=op, compression=compression,
        async_op=async_op, reads=(inp,), writes=(out,), log_bytes=inp.nbytes, check=check,
        issue=lambda be, g, red, sig: be.reduce_scatter(g, out, inp, red),
        compressed=lambda t, rt, g, red, sig, cz: t.reduce_scatter(rt, g, out, inp, red, cz,
                                                                  backend, async_op)))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   backend=None, compression=None):
    out = _v.output(output, "output")
    ins = [_v.input(t, f"input_list[{i}]") for i, t in enumerate(input_list)]
    _v.same_kind([out] + ins, "reduce_scatter")
    if compression is None and out.device.kind == "cpu":
        done = _fast.reduce_scatter_list(get_runtime(), _fast.list_facts(ins, False), out.ptr,
                                         out.numel, out.dtype, (out, ins), op, group, async_op,
                                         backend, out)
        if done is not _fast.MISS:
            return done

    def check(g, c):
        if len(ins) != g.size:
            raise _v.InvalidArgumentError(f"reduce_scatter: input_list has {len(ins)} tensors "
                                          f"for a group of {g.size}; give one per rank")
        for i, b in enumerate(ins):
            _v.numel(b, out.numel, f"input_list[{i}]", "each must match the output tensor")
        return {"count": out.numel}

    def issue(be, g, red, sig):
        return be.reduce_scatter(g, out, _concat(ins, len(ins) * out.numel), red)

    def compressed(t, rt, g, red, sig, cz):
        rt.order(reads=ins, writes=(out,), keep=False)  # before the inputs are read
        tmp = _concat(ins, len(ins) * out.numel)
        return t.reduce_scatter(rt, g, out, tmp, red, cz, backend, async_op)

    return run(Call(Op.REDUCE_SCATTER, group, backend, out, reduce_op=op,
                    compression=compression, async_op=async_op, reads=ins, writes=(out,),
                    log_bytes=len(ins) * out.nbytes, check=check, issue=issue,
                    compressed=compressed))


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
    if compression is None and inp.device.kind == "cpu":
        done = _fast.all_to_all(get_runtime(), out.ptr, out.numel,
                                out.shape[0] if out.shape else 1, inp.ptr, inp.numel,
                                inp.shape[0] if inp.shape else 1, inp.dtype, (out, inp),
                                output_split_sizes, input_split_sizes, group, async_op,
                                backend, inp)
        if done is not _fast.MISS:
            return done
    form_even = not output_split_sizes and not input_split_sizes
    # the selection size: an uneven call has none that every rank shares (by its form:
    # a call without split sizes is even where its checks pass and the sizes match)
    nbytes = inp.nbytes if form_even and out.numel == inp.numel else None

    def check(g, c):
        out_counts = _v.splits(output_split_sizes, out, g.size, "output_split_sizes")
        in_counts = _v.splits(input_split_sizes, inp, g.size, "input_split_sizes")
        return {"counts": (out_counts, in_counts)}

    def issue(be, g, red, sig):  # (after the debug checks, which see every rank's counts)
        _v.blocks(out, inp, *sig["counts"], g.rank, form_even, "all_to_all_single")
        return be.all_to_all(g, out, inp, *sig["counts"], form_even)

    return run(Call(
        Op.ALL_TO_ALL, group, backend, inp, compression=compression, async_op=async_op,
        reads=(inp,), writes=(out,), nbytes=nbytes, log_bytes=inp.nbytes, check=check,
        issue=issue,
        compressed=lambda t, rt, g, red, sig, cz: t.all_to_all(
            rt, g, out, inp, *sig["counts"], cz, backend, async_op, nbytes),
        algorithm=None if not form_even else lambda name, rt, g, red: _hooks.transform(
            "hierarchical").all_to_all(rt, g, out, inp, name, async_op)))


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False,
               backend=None, compression=None):
    """``compression``: as for ``all_to_all_single``."""
    outs = [_v.output(t, f"output_tensor_list[{i}]") for i, t in enumerate(output_tensor_list)]
    ins = [_v.input(t, f"input_tensor_list[{i}]") for i, t in enumerate(input_tensor_list)]
    if not outs or not ins:
        raise _v.InvalidArgumentError("all_to_all: tensor lists must not be empty")
    _v.same_kind(outs + ins, "all_to_all")
    if compression is None and ins[0].device.kind == "cpu":
        done = _fast.all_to_all_list(get_runtime(), _fast.list_facts(outs, True),
                                     _fast.list_facts(ins, False), ins[0].dtype, (outs, ins), group,
                                     async_op, backend, ins[0])
        if done is not _fast.MISS:
            return done
    out_counts = [b.numel for b in outs]
    in_counts = [b.numel for b in ins]
    # no selection size: the list form has none that every rank shares (a rank whose
    # own lists happen to be of one size knows nothing of the others'), so it selects
    # as an uneven all_to_all_single does, with the table's largest range, and runs as
    # one (Alltoallv), on every rank alike
    nbytes = None

    def check(g, c):
        if len(outs) != g.size or len(ins) != g.size:
            raise _v.InvalidArgumentError(f"all_to_all: {len(outs)} output and {len(ins)} input "
                                          f"tensors for a group of {g.size}; give one per rank")
        return {"counts": (out_counts, in_counts)}

    def staging():  # the inputs packed, and one contiguous result copied into the list after
        tmp_out = alloc.empty((sum(out_counts),), outs[0].dtype, outs[0].device, like=outs[0])
        return tmp_out, _concat(ins, sum(in_counts))

    def issue(be, g, red, sig):  # (after the debug checks, which see every rank's counts)
        _v.own_block(out_counts, in_counts, g.rank, "all_to_all")
        tmp_out, tmp_in = staging()
        work = be.all_to_all(g, tmp_out, tmp_in, out_counts, in_counts)
        work.add_finalizer(lambda: _scatter_into(tmp_out, outs))
        return work

    def compressed(t, rt, g, red, sig, cz):
        rt.order(reads=ins, writes=outs, keep=False)  # before the inputs are read
        tmp_out, tmp_in = staging()
        return t.all_to_all(rt, g, tmp_out, tmp_in, out_counts, in_counts, cz, backend,
                            async_op, nbytes, writes=outs,
                            then=lambda: _scatter_into(tmp_out, outs))

    return run(Call(Op.ALL_TO_ALL, group, backend, ins[0], compression=compression,
                    async_op=async_op, reads=ins, writes=outs, nbytes=nbytes,
                    log_bytes=sum(b.nbytes for b in ins), check=check, issue=issue,
                    compressed=compressed))


def _root_list(call, g, root, tensors, make, one, what, role, one_name):
    """The root's list of a gather or scatter, checked (an empty list on other ranks):
    one tensor per rank of the group, each of ``one``'s kind and size."""
    if g.rank != root:
        return []
    if tensors is None or len(tensors) != g.size:
        raise _v.InvalidArgumentError(f"{call}: the {role} rank needs a {what} of {g.size} "
                                      "tensors (one per rank of the group)")
    bufs = [make(t, f"{what}[{i}]") for i, t in enumerate(tensors)]
    _v.same_kind(bufs + [one], call)
    for i, b in enumerate(bufs):
        _v.numel(b, one.numel, f"{what}[{i}]", f"each must match the {one_name} tensor")
    return bufs


def _root_facts(tensors, make, what: str, one: Buffer, writes: bool):
    """(list facts, Buffers) of a gather's or scatter's list for the fast path, or None
    where none is given or it is not host buffers of ``one``'s dtype that convert: the
    list counts at the root only, where the general path then judges it (elsewhere it
    is ignored, as the general path ignores it)."""
    if tensors is None:
        return None
    try:
        bufs = [make(t, f"{what}[{i}]") for i, t in enumerate(tensors)]
    except Exception:  # (judged by the general path where it counts: at the root)
        return None
    if any(b.dtype is not one.dtype for b in bufs):
        return None
    lf = _fast.list_facts(bufs, writes)
    return None if lf is None else (lf, bufs)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           backend=None):
    """Gather ``tensor`` from every rank into ``gather_list`` on ``dst`` (ignored elsewhere)."""
    inp = _v.input(tensor, "tensor")
    if inp.device.kind == "cpu":
        facts = _root_facts(gather_list, _v.output, "gather_list", inp, True)
        done = _fast.gather(get_runtime(), facts and facts[0], inp.ptr, inp.numel, inp.dtype,
                            (inp, facts), dst, group, async_op, backend, inp)
        if done is not _fast.MISS:
            return done

    listed = []  # the checked gather_list (the root's; empty elsewhere), for issue

    def check(g, c):
        root = g.group_rank(dst, "dst")
        listed[:] = c.writes = _root_list("gather", g, root, gather_list, _v.output, inp,
                                          "gather_list", "destination", "input")
        c.log_bytes = g.size * inp.nbytes
        return {"root": root, "count": inp.numel}

    def issue(be, g, red, sig):
        outs = listed
        tmp = (alloc.empty((g.size * inp.numel,), inp.dtype, inp.device, like=outs[0])
               if outs else None)
        work = be.gather(g, tmp, inp, sig["root"])
        if outs:
            work.add_finalizer(lambda: _scatter_into(tmp, outs))
        return work

    return run(Call(Op.GATHER, group, backend, inp, async_op=async_op, reads=(inp,),
                    check=check, issue=issue))


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            backend=None):
    """Scatter ``scatter_list`` (given on ``src``) into ``tensor`` on every rank."""
    out = _v.output(tensor, "tensor")
    if out.device.kind == "cpu":
        facts = _root_facts(scatter_list, _v.input, "scatter_list", out, False)
        done = _fast.scatter(get_runtime(), facts and facts[0], out.ptr, out.numel, out.dtype,
                             (out, facts), src, group, async_op, backend, out)
        if done is not _fast.MISS:
            return done

    listed = []  # the checked scatter_list (the root's; empty elsewhere), for issue

    def check(g, c):
        root = g.group_rank(src, "src")
        listed[:] = c.reads = _root_list("scatter", g, root, scatter_list, _v.input, out,
                                         "scatter_list", "source", "output")
        c.log_bytes = g.size * out.nbytes
        return {"root": root, "count": out.numel}

    def issue(be, g, red, sig):
        tmp = _concat(listed, g.size * out.numel) if listed else None
        return be.scatter(g, out, tmp, sig["root"])

    return run(Call(Op.SCATTER, group, backend, out, async_op=async_op, writes=(out,),
                    check=check, issue=issue))


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

    def issue(be, g, red, sig):
        prior = [w for w in rt.engine.inflight if w.group is g and w.op not in _P2P]
        return _after(be.barrier(g), prior)

    return run(Call(Op.BARRIER, group, backend, probe, async_op=async_op, issue=issue))


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
