"""The compressed variants of the core's calls (all-gather, reduce-scatter, all-reduce,
all-to-all). ``mcrdl_core.dispatch.api`` validates the
arguments as for any call, then hands the Buffers here when a compression is allowed
(keyword or ``MCRDL_COMPRESSION``); everything below runs before anything is sent
until the ScheduleWork is created. An ``auto`` spec is settled here (auto.choose): the
plain collective, or a Compression over the backend the caller named or the one the
tuning table measured the winning variant on."""
from __future__ import annotations

import functools

from ..dispatch import validate as _v
from ..dispatch.pipeline import Call, run
from ..base.ops import Op, ReduceOp
from . import algorithms as _alg
from .auto import Auto, choose, choose_all_to_all, keeps_plain
from .codecs import NonFiniteError
from .schedule import Channel, ScheduleWork, store, to_work, xp_of
from .spec import call_codec, make_codec, plan, plan_all_to_all, resolve, work_dtype


def _check_intact(work, codec) -> None:
    if work.value is False:
        raise NonFiniteError(
            f"codec {codec.name!r} cannot carry NaN/Inf and a block this rank's result "
            "depends on held some (its values arrived as NaN). Use int8, int4, fp16 or bf16, "
            "which carry NaN/Inf, or compression=None")


def _issue(rt, g, op, cz, count, dtype, device, gen_fn, reads, writes, async_op, nbytes,
           backend, finish=None, reduce_op=None, counts=None, sel_nbytes=-1):
    """Common tail: plan, debug check, tag slot, order, create the ScheduleWork, register
    or wait. ``counts``: an all-to-all's ``(out_counts, in_counts)``: its plan is this
    rank's (``plan_all_to_all``, handed to ``gen_fn`` in place of a Layout) and the
    debug check compares the splits across ranks too; ``sel_nbytes``: its backend's
    selection size (None: uneven splits, as for the plain call)."""
    codec = call_codec(cz.codec, op, dtype)
    codec.check_device(device.kind)
    ch = Channel(rt, g, backend, device)
    if counts is None:
        p = plan(op, cz, g.size, count, dtype)
        lay = _alg.Layout(p.chunk_counts if count else (0,), codec)
        # selected with the size of what the first stage moves, which every rank knows
        # from the plan: a ring's largest message (its receives take the same choice),
        # the encoded block all-gathered, or the P encoded blocks of an all-to-all
        if cz.algorithm != "a2a":
            first, size = Op.SEND, max(lay.enc)
        elif op is Op.ALL_GATHER:
            first, size = Op.ALL_GATHER, lay.nbytes
        else:
            first, size = Op.ALL_TO_ALL, g.size * lay.nbytes
        be = ch.backend(first, ch.staging(1), size)
        spec = f"{codec.name}@{cz.algorithm}*{p.chunks}"
    else:
        p = lay = plan_all_to_all(cz, g.size, g.rank, *counts, dtype, _same_host(rt, g))
        be = ch.backend(Op.ALL_TO_ALL, ch.staging(1), sel_nbytes)
        spec, count = f"{codec.name}@a2a", None  # the splits are compared instead
    if rt.observed:
        rt.before(g, op, be, reads[0], reduce_op=reduce_op, count=count, counts=counts,
                  compression=spec)
    ch.claim_slot()
    spans = rt.order(reads=reads, writes=writes, keep=async_op)
    gen = gen_fn(ch, lay)
    algorithm = "a2a" if counts is not None else cz.algorithm
    work = ScheduleWork(f"{be.name}+{codec.name}@{algorithm}", op, g, gen, desc=str(p),
                        wait=rt.engine.wait)
    ch.hold(work)
    if finish is not None:
        work.add_finalizer(finish)
    work.add_finalizer(functools.partial(_check_intact, work, codec))
    return rt.finish(work, spans, async_op, nbytes)


def _same_host(rt, g) -> tuple:
    """For each rank of ``g``, whether it runs on this rank's host, where ``g`` spans
    several hosts; () where it does not (one host: every block is encoded, as asked)."""
    bs = rt.bootstrap
    if bs.hosts_in(g.ranks) < 2:
        return ()
    mine = bs.host_of[g.ranks[g.rank]]
    return tuple(bs.host_of[r] == mine for r in g.ranks)


def _plain(rt, g, op, backend, probe, call, reads, writes, async_op, nbytes, then=None,
           counts=None, sel_nbytes=-1):
    """Where auto keeps the backend's own collective: the core's pipeline, with
    ``call(be)`` as its issue. ``counts``/``sel_nbytes``: an all-to-all's splits and
    selection size (``_issue``)."""
    def issue(be, g, red, sig):
        work = call(be)
        if then is not None:
            work.add_finalizer(then)
        return work

    return run(Call(op, g, backend, probe, async_op=async_op, reads=reads, writes=writes,
                    nbytes=sel_nbytes, log_bytes=nbytes, issue=issue,
                    check=lambda g, c: {"count": None if counts else probe.numel,
                                     "counts": counts}))


def all_gather(rt, g, out, inp, cz, backend, async_op, writes=None, then=None):
    """``out`` (P*n elements) gets every rank's ``inp`` (n elements). ``writes``: the
    user's buffers when ``out`` is a staging buffer that ``then`` copies into them."""
    if isinstance(cz, Auto):
        cz, backend = choose(cz, rt, g, Op.ALL_GATHER, inp.numel, inp.dtype, backend,
                             inp.nbytes, inp.device.kind)
        if cz is None:
            return _plain(rt, g, Op.ALL_GATHER, backend, inp, lambda be: be.all_gather(g, out, inp),
                          (inp,), writes or (out,), async_op, out.nbytes, then)
    wd = work_dtype(inp.dtype)
    direct = out.array().dtype == wd
    res = out.array().reshape(-1) if direct else xp_of(out).empty(g.size * inp.numel, wd)

    def gen(ch, lay):
        x = to_work(inp, wd)  # read after the ordering wait, like the data itself
        if cz.algorithm == "a2a":
            return (yield from _alg.coll_all_gather(ch, lay, x, res))
        return (yield from _alg.ring_all_gather(ch, lay, x, res, per_hop=cz.algorithm == "p2p"))

    def finish():
        if not direct:
            store(out, res)
        if then is not None:
            then()

    return _issue(rt, g, Op.ALL_GATHER, cz, inp.numel, inp.dtype, inp.device, gen, (inp,),
                  writes or (out,), async_op, out.nbytes, backend, finish)


def reduce_scatter(rt, g, out, inp, op, cz, backend, async_op):
    """``out`` (n elements) gets block r of the sum over ranks of ``inp`` (P*n)."""
    if isinstance(cz, Auto):
        cz, backend = choose(cz, rt, g, Op.REDUCE_SCATTER, out.numel, out.dtype, backend,
                             out.nbytes, out.device.kind)
        if cz is None:
            return _plain(rt, g, Op.REDUCE_SCATTER, backend, out,
                          lambda be: be.reduce_scatter(g, out, inp, op), (inp,), (out,),
                          async_op, inp.nbytes)
    wd = work_dtype(inp.dtype)
    direct = out.array().dtype == wd
    res = out.array().reshape(-1) if direct else xp_of(out).empty(out.numel, wd)

    def gen(ch, lay):
        x = to_work(inp, wd)
        if cz.algorithm == "a2a":
            return (yield from _alg.a2a_reduce_scatter(ch, lay, x, res))
        return (yield from _alg.ring_reduce_scatter(ch, lay, x, res))

    def finish():
        if op is ReduceOp.AVG:
            res[...] /= g.size
        if not direct:
            store(out, res)

    return _issue(rt, g, Op.REDUCE_SCATTER, cz, out.numel, inp.dtype, inp.device, gen, (inp,),
                  (out,), async_op, inp.nbytes, backend, finish, op)


def all_reduce(rt, g, buf, op, cz, backend, async_op):
    """All-reduce as reduce-scatter + all-gather of P blocks of ceil(n/P) elements."""
    P, n = g.size, buf.numel
    m = -(-n // P)
    if isinstance(cz, Auto):
        cz, backend = choose(cz, rt, g, Op.ALL_REDUCE, m, buf.dtype, backend, buf.nbytes,
                             buf.device.kind)
        if cz is None:
            return _plain(rt, g, Op.ALL_REDUCE, backend, buf, lambda be: be.all_reduce(g, buf, op),
                          (), (buf,), async_op, buf.nbytes)
    wd = work_dtype(buf.dtype)
    xp = xp_of(buf)
    res = xp.empty(P * m, wd)

    def gen(ch, lay):
        x = xp.zeros(P * m, wd)
        x[:n] = to_work(buf, wd)
        return (yield from _alg.all_reduce(ch, lay, x, res, cz.algorithm))

    def finish():
        if op is ReduceOp.AVG:
            res[...] /= P
        store(buf, res[:n])

    return _issue(rt, g, Op.ALL_REDUCE, cz, m, buf.dtype, buf.device, gen, (buf,), (buf,),
                  async_op, buf.nbytes, backend, finish, op)


def all_to_all(rt, g, out, inp, out_counts, in_counts, cz, backend, async_op, nbytes,
               writes=None, then=None):
    """Compressed all-to-all, even or uneven: ``in_counts[k]`` elements of ``inp``
    (packed in rank order) go to rank k, whose block for this rank lands in ``out`` at
    block k (``out_counts[k]`` elements); each block is one codec round trip
    (``algorithms.all_to_all``). ``nbytes``: the plain call's selection size (None for
    uneven splits, so every rank selects alike); the compressed call selects its
    backend with the encoded size of an even call instead. ``writes``/``then``: the
    list form's user buffers and the copy into them, as for ``all_gather``. The own
    block must have one size in both split lists (checked before anything is sent)."""
    _v.own_block(out_counts, in_counts, g.rank, "all_to_all")
    counts = (list(out_counts), list(in_counts))
    if isinstance(cz, Auto):
        cz, backend = choose_all_to_all(cz, rt, g, inp.dtype, backend, nbytes, inp.device.kind)
        if cz is None:
            return _plain(rt, g, Op.ALL_TO_ALL, backend, inp,
                          lambda be: be.all_to_all(g, out, inp, *counts), (inp,),
                          writes or (out,), async_op, inp.nbytes, then, counts, nbytes)
    codec = make_codec(cz.codec, inp.dtype.name)
    wd = work_dtype(inp.dtype)
    direct = out.array().dtype == wd
    res = out.array().reshape(-1) if direct else xp_of(out).empty(out.numel, wd)

    def gen(ch, p):
        x = to_work(inp, wd)  # read after the ordering wait, like the data itself
        return (yield from _alg.all_to_all(ch, codec, p, x, res))

    def finish():
        if not direct:
            store(out, res)
        if then is not None:
            then()

    sel = None if nbytes is None else g.size * codec.encoded_nbytes(in_counts[0])
    return _issue(rt, g, Op.ALL_TO_ALL, cz, inp.numel, inp.dtype, inp.device, gen, (inp,),
                  writes or (out,), async_op, inp.nbytes, backend, finish, counts=counts,
                  sel_nbytes=sel)


class _Transform:
    """What the api calls (``hooks.transform("compression")``): the resolution of what a
    call allows, whether an ``auto:`` spec keeps the plain collective, and the
    compressed entries."""

    keeps_plain = staticmethod(keeps_plain)
    resolve = staticmethod(resolve)
    all_reduce = staticmethod(all_reduce)
    all_gather = staticmethod(all_gather)
    reduce_scatter = staticmethod(reduce_scatter)
    all_to_all = staticmethod(all_to_all)


TRANSFORM = _Transform()
