"""``plan_reshard`` and ``reshard``: the core's resharding calls (framework-free).

Every rank of the world calls ``reshard`` with the same arguments (like ``new_group``):
the sub-communicators it uses are registered in plan order on every rank. A rank in
neither mesh then returns None at once, without communicating; a rank in both keeps
what it already holds without communication.
"""
from __future__ import annotations

import logging
import socket
import weakref
from collections import OrderedDict

import numpy as np

from ..dispatch import api as _api
from ..base import dtypes as _dt
from ..memory import alloc
from ..memory.buffer import Buffer, as_buffer
from ..base.errors import InvalidArgumentError, MismatchError
from ..dispatch.runtime import get_runtime
from . import execute as _ex
from .layout import Layout, box_shape
from .linkmodel import LinkModel
from .plan import Plan
from .planner import make_plan
from ..base.ops import Op

log = logging.getLogger("mcrdl.reshard")

_HOSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runtime -> [hostname]
_PLANS: "OrderedDict" = OrderedDict()  # argument key -> Plan (the last 64)


def world_hosts() -> list[str]:
    """Host name of every rank (exchanged once per runtime: collective the first time)."""
    rt = get_runtime()
    names = _HOSTS.get(rt)
    if names is None:
        names = _HOSTS[rt] = [str(n) for n in rt.bootstrap.allgather(socket.gethostname())]
    return names


def plan_reshard(global_shape, dtype, src: Layout, dst: Layout, *, method: str = "broadcast",
                 balance: str = "lpt", order: str = "rounds", hosts="auto",
                 link: LinkModel | None = None) -> Plan:
    """The plan of moving a ``global_shape`` tensor of ``dtype`` from ``src`` to ``dst``.

    ``method``: "broadcast" | "send_recv" | "send_recv_allgather"; ``balance``: "lpt" |
    "least_load" | "first"; ``order``: "rounds" | "naive"; ``hosts``: "auto" (the hosts
    the ranks run on: collective over the world the first time), None (one host per
    rank), ranks per host (int), or {rank: host}; ``link``: the :class:`LinkModel`
    (default: ``MCRDL_RESHARD_LINK`` or 1 Gbit/s). Pure otherwise: no communication."""
    if isinstance(hosts, str) and hosts == "auto":
        hosts = world_hosts()
    return make_plan(global_shape, dtype, src, dst, method=method, balance=balance,
                     order=order, hosts=hosts, link=link or LinkModel.from_env())


def _cached_plan(shape, dtype, src, dst, method, balance, order, hosts, link) -> Plan:
    if isinstance(hosts, str) and hosts == "auto":
        hosts = world_hosts()
    hkey = hosts if hosts is None or isinstance(hosts, int) else (
        tuple(sorted(hosts.items())) if isinstance(hosts, dict) else tuple(hosts))
    link = link or LinkModel.from_env()
    key = (shape, dtype.name, src.key(), dst.key(), method, balance, order, hkey, link)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(shape, dtype, src, dst, method=method, balance=balance, order=order,
                         hosts=hosts, link=link)
        _PLANS[key] = plan
        if len(_PLANS) > 64:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


_READY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runtime -> {backend}


def _world_ready(rt, backend) -> None:
    """Make sure the world communicator of the backend that carries the point-to-point
    messages exists. Backends create it lazily, collectively over the whole world; a
    transfer between two ranks as a program's first call would otherwise leave the
    other ranks out of that creation and its two ranks waiting for them. Every rank
    calls reshard, so every rank takes part here, once per runtime and backend."""
    done = _READY.get(rt)
    if done is None:
        done = _READY[rt] = set()
    if backend in done:
        return
    probe = Buffer.from_numpy(np.zeros(1, np.uint8))
    rt.select(Op.SEND, rt.world, probe, backend).comm(rt.world)
    done.add(backend)


def _host_backend(backend):
    return backend if backend in ("mpi", "gloo") else None


def verify(plan: Plan, backend=None) -> None:
    """Check that every rank of the plan holds the same plan (its fingerprint); raise
    MismatchError on every rank otherwise. Collective over the plan's ranks."""
    rt = get_runtime()
    ranks = tuple(plan.ranks())
    g = _ex.group_of(ranks)
    if rt.rank not in ranks or len(ranks) == 1:
        return
    mine = np.frombuffer(bytes.fromhex(plan.fingerprint())[:8], dtype=np.int64).copy()
    every = np.empty(len(ranks), np.int64)
    _api.all_gather_into_tensor(every, mine, g, False, _host_backend(backend))
    bad = [r for r, v in zip(ranks, every.tolist()) if v != mine[0]]
    if bad:
        raise MismatchError(
            f"reshard: rank {rt.rank} planned {plan.summary()!r} but ranks {bad} hold another "
            "plan; call reshard on every rank with the same shape, dtype, layouts, method, "
            "balance, order, hosts and link model (or pass the same serialized plan)")


def reshard(local, src: Layout | None = None, dst: Layout | None = None, global_shape=None, *,
            plan: Plan | None = None, dtype=None, method: str = "broadcast",
            balance: str = "lpt", order: str = "rounds", backend: str | None = None,
            out=None, hosts="auto", link: LinkModel | None = None, check: bool = True,
            chain: bool | None = None, segment: int | None = None, overlap: bool = True,
            async_op: bool = False):
    """Move a tensor laid out as ``src`` to the layout ``dst`` (possibly on other ranks).

    ``local``: this rank's source tile (any DLPack array; None on ranks outside the
    source mesh, which then pass ``dtype``). Returns this rank's destination tile (a new
    NumPy/CuPy array, or ``out`` filled in), or None on ranks outside the destination
    mesh. ``plan`` replaces (shape, layouts, method, balance, order, hosts, link);
    ``backend``: any backend name or None (selection as for other calls); ``check``:
    compare plan fingerprints across the ranks before the plan's first use;
    ``chain``/``segment`` (bytes): the segmented chain broadcast (default: over Gloo, and
    between hosts from 64 KiB; see ``execute.py``); ``overlap``: post a rank's sends and
    final receives of all rounds at once and wait at the end (default), or wait for each
    transfer before the next (``False``). ``async_op=True``: every stage is issued now, in
    plan order, and ``(work, result)`` is returned, the result filled in once
    ``work.wait()`` returns (work None where nothing is left in flight). Every rank of the
    world calls it."""
    rt = get_runtime()
    rank = rt.rank
    buf = None if local is None else as_buffer(local)
    if plan is None:
        if src is None or dst is None or global_shape is None:
            raise InvalidArgumentError("reshard: pass src, dst and global_shape (or a plan from "
                                       "mcrdl_core.plan_reshard)")
        if dtype is None and buf is None:
            raise InvalidArgumentError(f"reshard: rank {rank} passes no local tensor; pass "
                                       "dtype= so that it can plan (or pass a plan)")
        dt = _dt.lookup(dtype) if dtype is not None else buf.dtype
        shape = tuple(int(n) for n in global_shape)
        plan = _cached_plan(shape, dt, src, dst, method, balance, order, hosts, link)
    else:
        if not isinstance(plan, Plan):
            raise InvalidArgumentError(f"reshard: plan must be a Plan, got {type(plan).__name__}")
        for what, given, planned in (("src", src, plan.src), ("dst", dst, plan.dst)):
            if given is not None and given != planned:
                raise InvalidArgumentError(f"reshard: {what} differs from the plan's; drop it or "
                                           "plan again")
        if global_shape is not None and tuple(global_shape) != plan.global_shape:
            raise InvalidArgumentError(f"reshard: global_shape {tuple(global_shape)} differs from "
                                       f"the plan's {plan.global_shape}")
    dt = _dt.lookup(plan.dtype)
    shape = plan.global_shape
    src_box, dst_box = _ex.tiles(plan, rank)
    src_arr = out_arr = None
    if src_box is not None:
        if buf is None:
            raise InvalidArgumentError(f"reshard: rank {rank} is in the source mesh and must pass "
                                       f"its tile of shape {box_shape(src_box)}")
        if buf.shape != box_shape(src_box) or buf.dtype is not dt:
            raise InvalidArgumentError(
                f"reshard: rank {rank}'s local tensor is {buf.describe()} but its tile of the "
                f"{dt.name}{list(shape)} tensor under {plan.src!r} is {box_shape(src_box)}; "
                "pass that tile")
        src_arr = buf.array()
    if dst_box is not None:
        want = box_shape(dst_box)
        if out is not None:
            ob = as_buffer(out)
            if ob.shape != want or ob.dtype is not dt or ob.readonly:
                raise InvalidArgumentError(f"reshard: out is {ob.describe()}"
                                           f"{' (read-only)' if ob.readonly else ''} but rank "
                                           f"{rank}'s destination tile is {dt.name}{list(want)}; "
                                           "pass a writable array of that shape and dtype")
            out_arr = ob.array()
        else:
            device = buf.device if buf is not None else None
            out_arr = (alloc.empty(want, dt, device) if device is not None and
                       device.kind == "cuda" else alloc.empty(want, dt)).array()
    _world_ready(rt, backend)
    if check:
        key = ("verified", id(rt))
        if not plan.cache.get(key):
            _ex.group_of(tuple(plan.ranks()))  # registered on every rank, in order
            verify(plan, backend)
            plan.cache[key] = True
    if src_box is None and dst_box is None:
        _ex.register_groups(plan, chain, backend)
        return (None, None) if async_op else None
    if log.isEnabledFor(logging.DEBUG):
        log.debug("rank %d: %s", rank, plan.summary())
    work = _ex.run(plan, rank, src_arr, out_arr, backend, chain, segment, overlap,
                   finish=not async_op)
    res = out if out is not None else out_arr
    return (work, res) if async_op else res
