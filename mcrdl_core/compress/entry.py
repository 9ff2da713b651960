"""The compressed variants of the core's calls. ``mcrdl_core.api`` validates the
arguments as for any call, then hands the Buffers here when a compression is allowed
(keyword or ``MCRDL_COMPRESSION``); everything below runs before anything is sent
until the ScheduleWork is created. An ``auto`` spec is settled here (auto.choose): the
plain collective, or a Compression over the backend the caller named or the one the
tuning table measured the winning variant on."""
from __future__ import annotations

import functools

from .. import debug as _debug
from ..ops import Op, ReduceOp
from . import algorithms as _alg
from .auto import Auto, choose
from .codecs import NonFiniteError
from .schedule import Channel, ScheduleWork, store, to_work, xp_of
from .spec import make_codec, plan, work_dtype


def _check_intact(work, codec) -> None:
    if work._result is False:
        raise NonFiniteError(
            f"codec {codec.name!r} cannot carry NaN/Inf and a block this rank's result "
            "depends on held some (its values arrived as NaN). Use int8, int4, fp16 or bf16, "
            "which carry NaN/Inf, or compression=None")


def _issue(rt, g, op, cz, count, dtype, device, gen_fn, reads, writes, async_op, nbytes,
           backend, finish=None, reduce_op=None):
    """Common tail: plan, debug check, tag slot, order, create the ScheduleWork, register
    or wait."""
    codec = make_codec(cz.codec, dtype.name)
    codec.check_device(device.kind)
    p = plan(op, cz, g.size, count, dtype)
    lay = _alg.Layout(p.chunk_counts if count else (0,), codec)
    ch = Channel(rt, g, backend, device)
    be = ch.backend(Op.SEND if cz.algorithm != "a2a" else
                    (Op.ALL_TO_ALL if op is not Op.ALL_GATHER else Op.ALL_GATHER), ch.staging(1))
    if rt.debug:
        _debug.check(rt, g, op, be, reads[0], reduce_op=reduce_op, count=count,
                     compression=f"{codec.name}@{cz.algorithm}*{p.chunks}")
    ch.claim_slot()
    spans = rt.order(reads=reads, writes=writes, keep=async_op)
    gen = gen_fn(ch, lay)
    work = ScheduleWork(f"{be.name}+{codec.name}@{cz.algorithm}", op, g, gen, desc=str(p))
    ch.hold(work)
    if finish is not None:
        work.add_finalizer(finish)
    work.add_finalizer(functools.partial(_check_intact, work, codec))
    return rt.finish(work, spans, async_op, nbytes)


def _plain(rt, g, op, backend, probe, call, reads, writes, async_op, nbytes, then=None):
    """Where auto keeps the backend's own collective: the core's usual path."""
    be = rt.select(op, g, probe, backend)
    if rt.debug:
        _debug.check(rt, g, op, be, probe, count=probe.numel)
    spans = rt.order(reads=reads, writes=writes, keep=async_op)
    work = call(be)
    if then is not None:
        work.add_finalizer(then)
    return rt.finish(work, spans, async_op, nbytes)


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
