"""Executors: run a :class:`Plan` on this rank, through the core's calls on any backend.

Every rank walks its own transfers in round order and waits for each before the next,
so that a round's transfers (which share no host) run together and rounds follow each
other; a rank in no transfer only makes its local copies. Payloads travel as bytes
(any dtype, bool and bfloat16 included); a box that is contiguous in the tensor (a
run of leading-dimension rows, or the whole tile) is sent or received in place, other
boxes are packed into and unpacked from a contiguous copy.

- ``broadcast``: one broadcast per transfer from the sender to its receivers. Inside a
  host, or for small messages, the backend's broadcast on the cached sub-communicator
  of those ranks (``new_group`` of the core). Between hosts a segmented chain: sender,
  receivers on the sender's host, then the other hosts one after the other, each
  segment passed on as soon as it arrives, so every host's link carries the message
  once, as NCCL's ring broadcast does. Gloo's broadcast is a binomial tree that sends
  the whole message log2(p) times from the root, and MPICH's large-message broadcast
  measured 4x slower than a chain at 1 Gbit/s to 4 hosts (2.37 s against the link's
  0.59 s for 64 MiB), hence the chain. ``chain=True``/``False`` forces either; the
  default chains every transfer over Gloo and, on other backends, transfers of at
  least ``CHAIN_MIN_BYTES`` that leave the sender's host. Segments: ``segment`` bytes,
  or ``MCRDL_RESHARD_SEGMENT``, or by default n/8 clamped to [64 KiB, 1 MiB]
  (64 MiB to 4 hosts at 1 Gbit/s, one run each: 16 MiB segments 1.29 s, 4 MiB 1.19 s,
  1 MiB 0.82 s, 512 KiB 0.78 s, 256 KiB 1.22 s; the link allows 0.59 s).
- ``send_recv``: the sender sends the whole box to every receiver.
- ``send_recv_allgather``: per receiving host, the sender sends one piece to each of
  its receivers there, who then all-gather the pieces inside the host.
"""
from __future__ import annotations

import logging
import os
import weakref

import numpy as np

from .. import api as _api
from ..buffer import as_buffer
from ..errors import InvalidArgumentError
from ..runtime import get_runtime
from .plan import Plan

log = logging.getLogger("mcrdl.reshard")

TAG = 0x7E5A  # point-to-point tag of resharding messages (< 32768, MPI's smallest tag bound)
CHAIN_MIN_BYTES = 1 << 16

_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runtime -> {ranks: Group}


def group_of(ranks: tuple):
    """The core group of ``ranks`` (a sorted tuple), created once per runtime and then
    reused, so the backends' sub-communicators are created once too. Like
    ``new_group``, every rank must ask for the same groups in the same order."""
    rt = get_runtime()
    cache = _GROUPS.get(rt)
    if cache is None:
        cache = _GROUPS[rt] = {}
    g = cache.get(ranks)
    if g is None:
        g = cache[ranks] = rt.new_group(list(ranks), name=f"reshard{list(ranks)}"[:64])
    return g


def register_groups(plan: Plan, chain: bool | None, backend: str | None) -> None:
    """Create (locally, in plan order, on every rank) the groups the plan will use."""
    rt = get_runtime()
    key = ("groups", id(rt), chain, backend)
    if plan.cache.get(key):
        return
    if plan.method == "broadcast":
        for t in plan.transfers:
            if not chained(plan, t, chain, backend):
                group_of(tuple(sorted(t.ranks())))
    elif plan.method == "send_recv_allgather":
        for t in plan.transfers:
            for rs in _by_host(plan, t.receivers):
                if len(rs) > 1:
                    group_of(tuple(sorted(rs)))
    plan.cache[key] = True


def _by_host(plan: Plan, ranks) -> list:
    """Ranks grouped by host, hosts in label order, ranks ascending."""
    groups: dict = {}
    for r in sorted(ranks):
        groups.setdefault(plan.hosts[r], []).append(r)
    return [groups[h] for h in sorted(groups)]


def chain_order(plan: Plan, t) -> list:
    """Sender, then receivers on its host, then the other hosts' receivers host by host."""
    own = plan.hosts[t.sender]
    rest = [rs for rs in _by_host(plan, t.receivers)]
    first = [rs for rs in rest if plan.hosts[rs[0]] == own]
    others = [rs for rs in rest if plan.hosts[rs[0]] != own]
    return [t.sender] + [r for rs in first + others for r in rs]


def tiles(plan: Plan, rank: int) -> tuple:
    """(source tile, destination tile) boxes of ``rank`` (None where it holds none)."""
    key = ("tiles", rank)
    hit = plan.cache.get(key)
    if hit is None:
        shape = plan.global_shape
        hit = plan.cache[key] = (plan.src.tile(shape, rank), plan.dst.tile(shape, rank))
    return hit


def _slices(box, origin) -> tuple:
    if not box:
        return (Ellipsis,)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _xp(arr):
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # lazy: CUDA buffers only

    return cupy


def _bytes(arr):
    """Flat uint8 view of a C-contiguous array (NumPy or CuPy)."""
    return arr.reshape(-1).view(_xp(arr).uint8)


class _Ctx:
    """What the executor needs on this rank: the source and destination arrays, tile
    origins, backend and chain settings."""

    def __init__(self, plan: Plan, rank: int, src_arr, out_arr, backend, chain, segment):
        self.plan = plan
        self.rank = rank
        self.src = src_arr
        self.out = out_arr
        self.backend = backend
        self.chain = chain
        self.segment = segment
        self.src_tile, self.dst_tile = tiles(plan, rank)

    def source_bytes(self, box):
        v = self.src[_slices(box, self.src_tile)]
        if not v.flags.c_contiguous:
            v = _xp(v).ascontiguousarray(v)
        return _bytes(v)

    def target(self, box):
        """(uint8 array to receive into, or None if a temporary is needed; the view)."""
        v = self.out[_slices(box, self.dst_tile)]
        return (_bytes(v) if v.flags.c_contiguous else None), v

    def scratch(self, nbytes: int):
        xp = _xp(self.out)
        if xp is np:
            return np.empty(nbytes, np.uint8)
        with xp.cuda.Device(self.out.device.id):
            return xp.empty(nbytes, xp.uint8)

    def store(self, view, flat) -> None:
        view[...] = flat.view(view.dtype).reshape(view.shape)


def run(plan: Plan, rank: int, src_arr, out_arr, backend: str | None, chain: bool | None,
        segment: int | None) -> None:
    """Execute ``plan`` on ``rank``: ``src_arr`` is its source tile (None if it holds
    none), ``out_arr`` its destination tile, written here (None if it receives none)."""
    segment = segment or os.environ.get("MCRDL_RESHARD_SEGMENT")
    if segment is not None and int(segment) < 1:
        raise InvalidArgumentError(f"segment={segment}: chain segments need >= 1 byte")
    register_groups(plan, chain, backend)
    ctx = _Ctx(plan, rank, src_arr, out_arr, backend, chain, segment and int(segment))
    mine, local = plan.for_rank(rank)
    for box in local:
        ctx.out[_slices(box, ctx.dst_tile)] = ctx.src[_slices(box, ctx.src_tile)]
    for t in mine:
        if plan.method == "send_recv":
            _send_recv(ctx, t)
        elif plan.method == "send_recv_allgather":
            _send_recv_allgather(ctx, t)
        elif chained(plan, t, chain, backend):
            _chain(ctx, t)
        else:
            _broadcast(ctx, t)


def chained(plan: Plan, t, chain: bool | None, backend: str | None) -> bool:
    """Whether broadcast transfer ``t`` runs as a segmented chain (see the module
    docstring); the same answer on every rank."""
    if chain is not None:
        return bool(chain)
    if backend == "gloo" or (backend is None and _policy_backend() == "gloo"):
        return True
    if t.nbytes < CHAIN_MIN_BYTES:
        return False
    own = plan.hosts[t.sender]
    return any(plan.hosts[r] != own for r in t.receivers)


def segment_bytes(n: int, segment: int | None) -> int:
    return segment if segment else min(1 << 20, max(64 << 10, n // 8))


def _policy_backend() -> str | None:
    """The backend a host-buffer broadcast would get without ``backend=`` (to decide
    whether the chain applies)."""
    rt = get_runtime()
    name = rt.world.backend or rt.override.get("broadcast") or rt.override.get("*")
    if name:
        return name
    usable = [n for n, r in rt.available_backends().items() if r is None]
    return "mpi" if "mpi" in usable else (usable[0] if usable else None)


def _wait(works) -> None:
    for w in works:
        if w is not None:
            w.wait()


def _receive(ctx: _Ctx, t, fn) -> None:
    """Receive transfer ``t`` with ``fn(flat uint8 array)`` (which returns the works to
    wait for) into the destination tile, through a temporary when not contiguous."""
    flat, view = ctx.target(t.box)
    tmp = flat if flat is not None else ctx.scratch(t.nbytes)
    _wait(fn(tmp))
    if flat is None:
        ctx.store(view, tmp)


def _broadcast(ctx: _Ctx, t) -> None:
    g = group_of(tuple(sorted(t.ranks())))
    if ctx.rank == t.sender:
        buf = ctx.source_bytes(t.box)
        if not buf.flags.writeable:  # the core's broadcast takes a writable buffer
            buf = buf.copy()
        _api.broadcast(as_buffer(buf), t.sender, g, False, ctx.backend)
    else:
        _receive(ctx, t, lambda a: [_api.broadcast(as_buffer(a), t.sender, g, True,
                                                   ctx.backend)])


def _chain(ctx: _Ctx, t) -> None:
    order = chain_order(ctx.plan, t)
    i = order.index(ctx.rank)
    nxt = order[i + 1] if i + 1 < len(order) else None
    n, be = t.nbytes, ctx.backend
    seg = segment_bytes(n, ctx.segment)
    cuts = [(a, min(a + seg, n)) for a in range(0, n, seg)]
    if i == 0:
        buf = ctx.source_bytes(t.box)
        _wait([_api.send(as_buffer(buf[a:b]), nxt, None, TAG, True, be) for a, b in cuts])
        return
    prev = order[i - 1]

    def relay(a_u8):
        recvs = [_api.recv(as_buffer(a_u8[a:b]), prev, None, TAG, True, be) for a, b in cuts]
        sends = []
        for (a, b), w in zip(cuts, recvs):
            w.wait()
            if nxt is not None:
                sends.append(_api.send(as_buffer(a_u8[a:b]), nxt, None, TAG, True, be))
        return sends

    _receive(ctx, t, relay)


def _send_recv(ctx: _Ctx, t) -> None:
    if ctx.rank == t.sender:
        buf = as_buffer(ctx.source_bytes(t.box))
        _wait([_api.send(buf, r, None, TAG, True, ctx.backend) for r in t.receivers])
    else:
        _receive(ctx, t, lambda a: [_api.recv(as_buffer(a), t.sender, None, TAG, True,
                                              ctx.backend)])


def _pieces(n: int, k: int) -> tuple[int, list]:
    c = -(-n // k)
    return c, [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def _send_recv_allgather(ctx: _Ctx, t) -> None:
    hosts = _by_host(ctx.plan, t.receivers)
    be = ctx.backend
    if ctx.rank == t.sender:
        buf = ctx.source_bytes(t.box)
        works = []
        for rs in hosts:
            _, cuts = _pieces(t.nbytes, len(rs))
            works += [_api.send(as_buffer(buf[a:b]), r, None, TAG, True, be)
                      for r, (a, b) in zip(rs, cuts)]
        _wait(works)
        return
    rs = next(rs for rs in hosts if ctx.rank in rs)
    k, i = len(rs), rs.index(ctx.rank)
    c, cuts = _pieces(t.nbytes, k)
    a, b = cuts[i]
    if k == 1:
        _receive(ctx, t, lambda u8: [_api.recv(as_buffer(u8), t.sender, None, TAG, True, be)])
        return
    g = group_of(tuple(sorted(rs)))
    pos = g.group_rank(ctx.rank)  # the all-gather orders pieces by group rank
    piece = ctx.scratch(c)
    _api.recv(as_buffer(piece[:b - a]), t.sender, None, TAG, False, be)
    whole = ctx.scratch(c * k)
    _api.all_gather_into_tensor(as_buffer(whole), as_buffer(piece), g, False, be)
    assert pos == i  # both sorted by rank
    flat, view = ctx.target(t.box)
    if flat is not None:
        flat[...] = whole[:t.nbytes]
    else:
        ctx.store(view, whole[:t.nbytes])
