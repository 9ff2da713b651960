"""Two-level (hierarchical) all-reduce for groups whose ranks share hosts.

Where a group spans several hosts with the same number of its ranks on each, an
all-reduce can keep most of its traffic inside the hosts (shared memory, NVLink) and
send each host's data over the network once, split among its ranks:

1. reduce-scatter inside the host: local rank i gets block i of the host's sum;
2. all-reduce across hosts among the ranks with the same local index (one per host),
   each on its own block, so the network carries 1/L of the data per rank (L ranks
   per host) and the L exchanges run side by side;
3. all-gather inside the host: every rank gets every block.

This is the shape NCCL and Horovod use for their hierarchical all-reduce. The element
count is padded up to a multiple of L in a temporary (the padding is never read back).
Every reduce op works: SUM/PRODUCT/MIN/MAX/bitwise are associative, and AVG is the
average of per-host averages, which is the global average because every host holds
the same number of ranks.

How it is asked for: ``backend="hier"`` (each step's backend from the usual order:
the group's default, ``MCRDL_BACKEND``, the tuning table, the policy, per sub-group and
step) or ``backend="hier:NAME"`` (every step on backend NAME). The sub-groups (this
rank's host, and its peers of the same local index) are made on the first such call on
a group, by their members, and kept on the runtime (``Runtime.cache``, cleared by
``destroy``). A group that is not hierarchical (one host, a host with one of its ranks,
or hosts with different counts) runs the plain all-reduce on the named backend (or the
usual choice), so ``hier`` is always a valid request. The three steps run as one
:class:`~mcrdl_core.compress.schedule.ScheduleWork` of the progress engine: nothing
blocks, other backends' work keeps being driven, and a stalled peer ends in the
engine's timeout naming the step. Calls on one group run their steps one call after
the other (each sub-communicator must see the same order on every rank). Host buffers
only: on a GPU the call runs flat.
"""
from __future__ import annotations

import types

from . import alloc
from .compress.schedule import ScheduleWork
from .errors import InvalidArgumentError
from .ops import Op

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


def levels(rt, g):
    """(this rank's host group, its inter-host group) for group ``g``, or None where
    ``g`` is not hierarchical. Made on first use by each sub-group's members (every rank
    of ``g`` makes its own two in the same call, so the members meet) and kept."""
    cache = rt.cache("hier")
    key = (g.key, g.ranks)
    if key in cache:
        return cache[key]
    host_of = rt.bootstrap.host_of
    by_host: dict = {}
    for r in g.ranks:
        by_host.setdefault(host_of[r] if host_of else "", []).append(r)
    counts = {len(v) for v in by_host.values()}
    if len(by_host) < 2 or len(counts) != 1 or counts.pop() < 2:
        cache[key] = None
        return None
    hosts = list(by_host)
    mine = by_host[host_of[rt.rank]]
    h, local = hosts.index(host_of[rt.rank]), mine.index(rt.rank)
    intra = rt.new_group(mine, name=f"{g.name}/host{h}", key=f"hier:{g.key}:host{h}")
    inter = rt.new_group([by_host[x][local] for x in hosts], name=f"{g.name}/local{local}",
                         key=f"hier:{g.key}:local{local}")
    cache[key] = (intra, inter)
    return cache[key]


def all_reduce(rt, g, buf, op, backend: str, async_op: bool):
    """The all-reduce of ``buf`` (validated, in place) on group ``g`` the hierarchical
    way where ``g`` allows it (see the module docstring), else the plain one."""
    name = inner(backend)
    lv = levels(rt, g) if buf.device.kind == "cpu" and buf.numel else None
    if lv is None:
        be = rt.select(Op.ALL_REDUCE, g, buf, name, op)
        spans = rt.order(writes=(buf,), keep=async_op)
        return rt.finish(be.all_reduce(g, buf, op), spans, async_op, buf.nbytes)
    intra, inter = lv
    n, size = buf.numel, intra.size
    blk = -(-n // size)
    tmp = alloc.empty((size * blk,), buf.dtype)
    part = alloc.empty((blk,), buf.dtype)
    be_rs = rt.select(Op.REDUCE_SCATTER, intra, part, name, op, part.nbytes)
    be_ar = rt.select(Op.ALL_REDUCE, inter, part, name, op, part.nbytes)
    be_ag = rt.select(Op.ALL_GATHER, intra, part, name, None, tmp.nbytes)
    for be, sub in ((be_rs, intra), (be_ar, inter), (be_ag, intra)):
        be.comm(sub)  # now, in the same order on every member: never inside a step,
        # where a rendezvous would wait through the engine that is advancing the steps
    spans = rt.order(writes=(buf,), keep=async_op)
    arr, t = buf.array().reshape(-1), tmp.array()
    # the steps of two calls on the group must reach each sub-communicator in the same
    # order on every rank: a call's steps start once the previous call's are all done
    last = rt.cache("hier.last")
    prev = last.get(g.key)

    def steps():
        if prev is not None and not prev._done:
            yield prev
        t[:n] = arr  # after the ordering wait: the data the call was given
        yield be_rs.reduce_scatter(intra, part, tmp, op)
        yield be_ar.all_reduce(inter, part, op)
        yield be_ag.all_gather(intra, tmp, part)
        arr[...] = t[:n]
        return None

    names = f"{be_rs.name}/{be_ar.name}/{be_ag.name}"
    work = ScheduleWork(f"hier({names})", Op.ALL_REDUCE, g, steps(),
                        desc=f"{size} ranks per host x {inter.size} hosts")
    work.keep = (buf, tmp, part)
    last[g.key] = work
    return rt.finish(work, spans, async_op, buf.nbytes)


#: what ``hooks.transform("hierarchical")`` hands the api
TRANSFORM = types.SimpleNamespace(all_reduce=all_reduce, inner=inner)
