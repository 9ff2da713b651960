"""Two-level (hierarchical) all-reduce and all-to-all for groups whose ranks share hosts.

Where a group spans several hosts with the same number of its ranks on each, an
all-reduce can keep most of its traffic inside the hosts (shared memory, NVLink) and
send each host's data over the network once, split among its ranks:

1. reduce-scatter inside the host: local rank i gets block i of the host's sum;
2. all-reduce across hosts among the ranks with the same local index (one per host),
   each on its own block, so the network carries 1/L of the data per rank (L ranks
   per host) and the L exchanges run side by side;
3. all-gather inside the host: every rank gets every block.

This is the shape NCCL and Horovod use for their hierarchical all-reduce. The element
count is padded up to a multiple of L in a temporary (the padding is never read back);
float16 and bfloat16 data is carried in float32 through the three steps and rounded
once at the end, as the flat path rounds once (see :func:`accumulates_in`).
Every reduce op works: SUM/PRODUCT/MIN/MAX/bitwise are associative, and AVG is the
average of per-host averages, which is the global average because every host holds
the same number of ranks. The all-to-all (even splits: ``all_to_all_single`` without
split sizes) is Tutel's 2DH shape, see :func:`all_to_all`; uneven calls run flat.

How it is asked for: ``backend="hier"`` (each step's backend from the usual order:
the group's default, ``MCRDL_BACKEND``, the tuning table, the policy, per sub-group and
step) or ``backend="hier:NAME"`` (every step on backend NAME). The sub-groups (this
rank's host, and its peers of the same local index) are made on the first such call on
a group, by their members, and kept on the runtime (``Runtime.cache``, cleared by
``destroy``). A group that is not hierarchical (one host, a host with one of its ranks,
or hosts with different counts) runs the plain collective on the named backend (or the
usual choice), so ``hier`` is always a valid request. The steps run as one
:class:`~mcrdl_core.compress.schedule.ScheduleWork` of the progress engine: nothing
blocks, other backends' work keeps being driven, and a stalled peer ends in the
engine's timeout naming the step. Calls on one group run their steps one call after
the other (each sub-communicator must see the same order on every rank). Host buffers
only: on a GPU the call runs flat.
"""
from __future__ import annotations

import types

import numpy as np

from ..memory import alloc
from ..base import dtypes as _dt
from ..compress.schedule import ScheduleWork
from ..base.errors import InvalidArgumentError
from ..base.ops import Op

PREFIX = "hier"


def inner(backend: str) -> str | None:
    """The backend named for the steps (``hier:NAME``), None for ``hier``."""
    if backend == PREFIX:
        return None
    head, sep, name = backend.partition(":")
    if head != PREFIX or not sep or not name or name == PREFIX:
        raise InvalidArgumentError(
            f"backend={backend!r}: the hierarchical all-reduce is asked for as 'hier' "
            "(each step's backend chosen as usual) or 'hier:NAME' (every step on backend "
            "NAME, e.g. 'hier:mpi')")
    return name


def _by_host(rt, g):
    """{host: ranks of ``g`` on it, in group order}, or None where ``g`` is not
    hierarchical: one host, or hosts with different counts of its ranks, or one each."""
    host_of = rt.bootstrap.host_of
    by_host: dict = {}
    for r in g.ranks:
        by_host.setdefault(host_of[r] if host_of else "", []).append(r)
    counts = {len(v) for v in by_host.values()}
    if len(by_host) < 2 or len(counts) != 1 or counts.pop() < 2:
        return None
    return by_host


def applies(rt, g) -> bool:
    """Whether the two-level algorithms differ from the flat ones on group ``g`` (see
    ``levels``), without making any group: what ``mcrdl tune`` asks before measuring
    them as a candidate."""
    return _by_host(rt, g) is not None


def levels(rt, g):
    """(this rank's host group, its inter-host group, index) for group ``g``, or None
    where ``g`` is not hierarchical; ``index[h][l]`` is the group rank of the ``l``-th
    rank (in group order) of the ``h``-th host (in the order of its first rank in the
    group). Made on first use by each sub-group's members (every rank of ``g`` makes its
    own two in the same call, so the members meet) and kept."""
    cache = rt.cache("hier")
    key = (g.key, g.ranks)
    if key in cache:
        return cache[key]
    by_host = _by_host(rt, g)
    if by_host is None:
        cache[key] = None
        return None
    host_of = rt.bootstrap.host_of
    hosts = list(by_host)
    mine = by_host[host_of[rt.rank]]
    h, local = hosts.index(host_of[rt.rank]), mine.index(rt.rank)
    intra = rt.new_group(mine, name=f"{g.name}/host{h}", key=f"hier:{g.key}:host{h}")
    inter = rt.new_group([by_host[x][local] for x in hosts], name=f"{g.name}/local{local}",
                         key=f"hier:{g.key}:local{local}")
    index = np.array([[g.group_rank(r) for r in by_host[x]] for x in hosts])
    cache[key] = (intra, inter, index)
    return cache[key]


def _connect(*pairs) -> None:
    """Each (backend, sub-group)'s communicator, now, in the same order on every member:
    never inside a step, where a rendezvous would wait through the engine that is
    advancing the steps."""
    for be, sub in pairs:
        be.comm(sub)


def _schedule(rt, g, op, steps, names, desc, spans, async_op, nbytes, keep):
    """Run ``steps`` (a generator function yielding the Works it waits for) as one
    ScheduleWork. The steps of two calls on a group must reach each sub-communicator in
    the same order on every rank, so a call's steps start once the previous call's (on
    the same group, either op) are all done."""
    last = rt.cache("hier.last")
    prev = last.get(g.key)

    def after_prev():
        if prev is not None and not prev.done:
            yield prev
        return (yield from steps())

    work = ScheduleWork(f"hier({'/'.join(names)})", op, g, after_prev(), desc=desc)
    work.keep = keep
    last[g.key] = work
    return rt.finish(work, spans, async_op, nbytes)


def accumulates_in(dtype):
    """The dtype the two levels reduce and carry ``dtype`` data in: float32 for float16
    and bfloat16, as the flat path (the MPI backend reduces them upcast), so that a
    host's partial result is not rounded to 16 bits between the levels (two hosts' sums
    of 40000 + 40000 and -40000 - 39000 would overflow float16 there and meet as
    inf - inf = NaN; bfloat16 would round twice); the result is rounded once, at the
    end. Every other dtype as itself."""
    return _dt.float32 if dtype.is_half else dtype


def all_reduce(rt, g, buf, op, backend: str, async_op: bool):
    """The all-reduce of ``buf`` (validated, in place) on group ``g`` the hierarchical
    way where ``g`` allows it (see the module docstring), else the plain one."""
    name = inner(backend)
    lv = levels(rt, g) if buf.device.kind == "cpu" and buf.numel else None
    if lv is None:
        be = rt.select(Op.ALL_REDUCE, g, buf, name, op)
        spans = rt.order(writes=(buf,), keep=async_op)
        return rt.finish(be.all_reduce(g, buf, op), spans, async_op, buf.nbytes)
    intra, inter, _ = lv
    n, size = buf.numel, intra.size
    blk = -(-n // size)
    wd = accumulates_in(buf.dtype)
    tmp = alloc.empty((size * blk,), wd)
    part = alloc.empty((blk,), wd)
    be_rs = rt.select(Op.REDUCE_SCATTER, intra, part, name, op, part.nbytes)
    be_ar = rt.select(Op.ALL_REDUCE, inter, part, name, op, part.nbytes)
    be_ag = rt.select(Op.ALL_GATHER, intra, part, name, None, tmp.nbytes)
    _connect((be_rs, intra), (be_ar, inter), (be_ag, intra))
    spans = rt.order(writes=(buf,), keep=async_op)
    arr, t = buf.array().reshape(-1), tmp.array()

    def steps():
        t[:n] = arr  # after the ordering wait: the data the call was given (widened)
        yield be_rs.reduce_scatter(intra, part, tmp, op)
        yield be_ar.all_reduce(inter, part, op)
        yield be_ag.all_gather(intra, tmp, part)
        arr[...] = t[:n]  # the one rounding back to a 16-bit float

    return _schedule(rt, g, Op.ALL_REDUCE, steps, (be_rs.name, be_ar.name, be_ag.name),
                     f"{size} ranks per host x {inter.size} hosts", spans, async_op,
                     buf.nbytes, (buf, tmp, part))


def all_to_all(rt, g, out, inp, backend: str, async_op: bool):
    """The even all-to-all of ``inp`` into ``out`` (validated: P equal blocks each) on
    group ``g`` in two levels where ``g`` allows it, in the style of Tutel's 2DH: an
    all-to-all inside the host that gathers, on local rank l, every block of the host
    bound for local rank l of any host; one all-to-all among the ranks of local index
    l, one per host, carrying L blocks to each host in one message (H messages per rank
    instead of P - L, each L times larger: what pays where messages are small and
    per-message costs dominate); then each block is put at its source's place. Moves
    bytes only, so any dtype works. Else the plain all-to-all."""
    name = inner(backend)
    size = g.size
    lv = levels(rt, g) if inp.device.kind == "cpu" and inp.nbytes else None
    if lv is None:
        be = rt.select(Op.ALL_TO_ALL, g, inp, name, nbytes=inp.nbytes)
        counts = [inp.numel // size] * size
        spans = rt.order(reads=(inp,), writes=(out,), keep=async_op)
        return rt.finish(be.all_to_all(g, out, inp, counts, counts, True), spans, async_op,
                         inp.nbytes)
    intra, inter, index = lv
    hosts, local = index.shape
    b = inp.nbytes // size
    a, r1, c, r2 = (alloc.empty((size * b,), _dt.uint8) for _ in range(4))
    be1 = rt.select(Op.ALL_TO_ALL, intra, a, name, nbytes=a.nbytes)
    be2 = rt.select(Op.ALL_TO_ALL, inter, c, name, nbytes=c.nbytes)
    _connect((be1, intra), (be2, inter))
    spans = rt.order(reads=(inp,), writes=(out,), keep=async_op)
    x = inp.array().reshape(-1).view(np.uint8).reshape(size, b)
    o = out.array().reshape(-1).view(np.uint8).reshape(size, b)
    by_local = a.array().reshape(local, hosts, b)   # [local dest, host dest]
    got = r1.array().reshape(local, hosts, b)       # [local source, host dest]
    by_host = c.array().reshape(hosts, local, b)    # [host dest, local source]
    final = r2.array().reshape(hosts, local, b)     # [host source, local source]

    def steps():
        by_local[...] = x[index.T]  # after the ordering wait, as any call reads
        yield be1.all_to_all(intra, r1, a, [hosts * b] * local, [hosts * b] * local, True)
        by_host[...] = got.transpose(1, 0, 2)
        yield be2.all_to_all(inter, r2, c, [local * b] * hosts, [local * b] * hosts, True)
        o[index.reshape(-1)] = final.reshape(size, b)

    return _schedule(rt, g, Op.ALL_TO_ALL, steps, (be1.name, be2.name),
                     f"{local} ranks per host x {hosts} hosts", spans, async_op, inp.nbytes,
                     (inp, out, a, r1, c, r2))


#: what ``hooks.transform("hierarchical")`` hands the api
TRANSFORM = types.SimpleNamespace(all_reduce=all_reduce, all_to_all=all_to_all, inner=inner)
