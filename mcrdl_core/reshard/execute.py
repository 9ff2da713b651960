"""Executors: run a :class:`Plan` on this rank, through the core's calls on any backend.

Every rank walks its own transfers in round order. By default (``overlap=True``) it
posts the sends and final receives of every round without waiting and waits for them
all at the end, so that a rank's later transfers do not wait for its earlier ones (on
the emulated cluster this took the all-to-all from 255 to 133 ms and halves -> thirds
from 379 to 291 ms against a 281 ms link bound); relays, broadcasts on
sub-communicators and all-gathers run in round order as they come, everything posted
progressing meanwhile. ``overlap=False`` waits for each transfer before the next.
A rank in no transfer only makes its local copies. Payloads travel as bytes
(any dtype, bool and bfloat16 included); a box that is contiguous in the tensor (a
run of leading-dimension rows, or the whole tile) is sent or received in place, other
boxes are packed into and unpacked from a contiguous copy.

- ``broadcast``: one broadcast per transfer from the sender to its receivers. To one
  receiver it is a send. Inside a host, or below ``CHAIN_MIN_BYTES``, the backend's
  broadcast on the cached sub-communicator of those ranks (``new_group`` of the core).
  Between hosts a segmented chain: sender, receivers on the sender's host, then the
  other hosts one after the other, each segment passed on as soon as it arrives, so
  every host's link carries the message once, as NCCL's ring broadcast does. Gloo's
  broadcast is a binomial tree that sends the whole message log2(p) times from the
  root, and MPICH's large-message broadcast measured 4x slower than a chain at
  1 Gbit/s to 4 hosts (2.37 s against the link's 0.59 s for 64 MiB), hence the chain.
  A relay posts all of a transfer's receives at once and passes each segment on once
  it has arrived, from whichever wait polls next (``_Deferred``: any call's wait drives
  it, so an async reshard never blocks in its start and a relay never needs a thread).
  The rank's later sends of the same call (go messages included) wait until its
  relays' segments and its own go messages have arrived (``_Ctx.gate``), as they did
  when a relay waited in place: the plan's rounds hold only so (without the gate,
  1D -> 2D on 4 hosts x 2 took 967 ms instead of 667).
  A chain that crosses hosts once (the sender's host, then one other host) is sent in
  one segment: its later hops are inside a host, so segments only add messages (2 hosts
  x 2 ranks at 1 Gbit/s, Gloo, 512 KiB tiles to both ranks of the other host: the
  two-mesh pipeline's blocking 1F1B with broadcast reshards 4900 -> 8000 samples/s).
  A chain with relays (of at least ``GO_MIN_BYTES``) starts only when its first
  receiver says so (a 1-byte message):
  MPICH pushes up to a socket buffer's worth (several MiB) before the receive is
  posted, so senders of later transfers to the same relay would otherwise share its
  link with the transfer it is relaying and starve the pipeline (1D -> 2D on 4 hosts x
  2: 1008 ms without, 678 ms with, against a 561 ms link bound). ``chain=True``/
  ``False`` forces either; the default chains every transfer over Gloo and, on other
  backends, transfers of at least ``CHAIN_MIN_BYTES`` that leave the sender's host.
  Segments: ``segment`` bytes, or ``MCRDL_RESHARD_SEGMENT``, or by default
  :func:`~.linkmodel.chain_segment` (n/8 clamped to [64 KiB, 1 MiB]) where the chain
  crosses hosts more than once, else the whole transfer.
- ``send_recv``: the sender sends the whole box to every receiver.
- ``send_recv_allgather``: per receiving host, the sender sends one piece to each of
  its receivers there, who then all-gather the pieces inside the host.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections import deque

import numpy as np

from ..dispatch import api as _api
from ..base import config as _config
from ..base import tags as _tags
from ..memory.buffer import as_buffer
from ..base.errors import InvalidArgumentError
from ..base.ops import Op
from ..dispatch.runtime import get_runtime
from ..engine.progress import engine as _engine
from ..engine.work import Work
from .linkmodel import chain_segment
from .plan import Plan

log = logging.getLogger("mcrdl.reshard")

TAG = _tags.RESHARD  # point-to-point tag of resharding messages (reserved: mcrdl_core.base.tags)
GO_TAG = _tags.RESHARD_GO  # a chain's first receiver tells the sender it has started
GO_MIN_BYTES = 1 << 20  # below this, no go message (its round trip costs more than it saves)
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
    """Sender, then receivers on its host, then the other hosts' receivers host by host.
    (Turning the hosts' order by the transfer's id, so that transfers to the same hosts
    take turns relaying, did not help: 1D -> 2D on 4 hosts x 2, 680 against 665 ms.)"""
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
        self.overlap = True
        self.pending: list = []  # (works, arrays they use, what to do after)
        # the receives of this rank's relays and go messages so far: its later sends wait
        # for them, as a relay or a go that waited in place held them back (the plan's
        # rounds keep a relay's link to the transfer it relays)
        self.gate: tuple = ()

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

    def token(self, like):
        """A 1-byte message buffer on the device of ``like``."""
        xp = _xp(like)
        if xp is np:
            return np.zeros(1, np.uint8)
        with xp.cuda.Device(like.device.id):
            return xp.zeros(1, xp.uint8)

    def store(self, view, flat) -> None:
        view[...] = flat.view(view.dtype).reshape(view.shape)

    def later(self, works, keep=None, then=None) -> None:
        """Wait for ``works`` now, or at :meth:`finish` when overlapping; ``keep``: arrays
        the works use (alive until then); ``then``: called once they are done."""
        if not self.overlap:
            _wait(works)
            if then is not None:
                then()
            return
        self.pending.append((works, keep, then))

    def finish(self) -> None:
        for works, _, then in self.pending:
            _wait(works)
            if then is not None:
                then()
        self.pending.clear()


def run(plan: Plan, rank: int, src_arr, out_arr, backend: str | None, chain: bool | None,
        segment: int | None, overlap: bool = True, finish: bool = True):
    """Execute ``plan`` on ``rank``: ``src_arr`` is its source tile (None if it holds
    none), ``out_arr`` its destination tile, written here (None if it receives none).

    ``overlap=True``: the sends and receives that need nothing from this rank in
    between (a sender's sends, a last receiver's receives) are posted in round order
    and waited for at the end, so a rank's transfers of later rounds do not wait for
    those of earlier rounds to finish; relays in a chain, broadcasts on
    sub-communicators and the all-gathers run in round order as they come, the other
    work progressing meanwhile. ``False``: every transfer is waited for before the
    next one (rounds one after the other on each rank). ``finish=False`` (an async
    reshard): returns a :class:`ReshardWork` over what is still posted instead of waiting."""
    segment = segment or _config.get("MCRDL_RESHARD_SEGMENT")
    if segment is not None and int(segment) < 1:
        raise InvalidArgumentError(f"segment={segment}: chain segments need >= 1 byte")
    register_groups(plan, chain, backend)
    ctx = _Ctx(plan, rank, src_arr, out_arr, backend, chain, segment and int(segment))
    ctx.overlap = overlap
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
    if not finish:
        return ReshardWork(ctx)
    ctx.finish()
    return None


class ReshardWork(Work):
    """The transfers an async reshard left posted (every stage was issued in plan order
    by ``run``): done when all of them are; its finalizer unpacks the boxes received
    through temporaries. Polled, like any work, by the progress loop of a wait."""

    def __init__(self, ctx: _Ctx):
        super().__init__("reshard", Op.BROADCAST, None, finalize=ctx.finish, desc="reshard")
        self.parts = [w for works, _, _ in ctx.pending for w in works if w is not None]
        self.keep = (ctx,)

    def poll(self) -> bool:
        return all(w.test() for w in self.parts)


def chained(plan: Plan, t, chain: bool | None, backend: str | None) -> bool:
    """Whether broadcast transfer ``t`` runs as a segmented chain (see the module
    docstring); the same answer on every rank."""
    if chain is not None:
        return bool(chain)
    if len(t.receivers) == 1:  # a chain of one hop: a plain send (MPICH's broadcast of
        return True             # 16 MiB between two ranks of a host took 1.7x as long)
    if backend == "gloo" or (backend is None and _policy_backend() == "gloo"):
        return True
    if t.nbytes < CHAIN_MIN_BYTES:
        return False
    own = plan.hosts[t.sender]
    return any(plan.hosts[r] != own for r in t.receivers)


def segment_bytes(n: int, segment: int | None, crossings: int = 2) -> int:
    """Bytes per segment of a chain of ``n`` bytes that goes from one host to another
    ``crossings`` times: ``segment`` if given, else the whole transfer where it crosses
    once or never (no later hop on a slow link to pipeline), else ``chain_segment``."""
    if segment:
        return segment
    return chain_segment(n) if crossings > 1 else max(n, 1)


def _crossings(plan: Plan, order) -> int:
    return sum(plan.hosts[a] != plan.hosts[b] for a, b in zip(order, order[1:]))


def _policy_backend() -> str | None:
    """The backend a host-buffer broadcast would get without ``backend=`` (to decide
    whether the chain applies)."""
    rt = get_runtime()
    name = rt.named_backend(Op.BROADCAST, rt.world, None)
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
    works = fn(tmp)
    ctx.later(works, tmp, None if flat is not None else lambda: ctx.store(view, tmp))


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
    seg = segment_bytes(n, ctx.segment, _crossings(ctx.plan, order))
    cuts = [(a, min(a + seg, n)) for a in range(0, n, seg)]
    relays = len(order) > 2 and n >= GO_MIN_BYTES
    if i == 0:
        buf = ctx.source_bytes(t.box)
        if relays:  # send (this and what follows) once the first receiver has started
            go = ctx.token(ctx.src)
            ctx.gate += (_api.core_recv(as_buffer(go), nxt, None, GO_TAG, True, be),)
            ctx.later([], go)
        ctx.later([_post_send(buf[a:b], nxt, be, None, ctx.gate) for a, b in cuts], buf)
        return
    prev = order[i - 1]
    if relays and i == 1:
        go = ctx.token(ctx.out)  # (after this rank's earlier relays: see ctx.gate)
        ctx.later([_post_send(go, prev, be, None, ctx.gate, GO_TAG)], go)

    def relay(a_u8):
        recvs = [_api.core_recv(as_buffer(a_u8[a:b]), prev, None, TAG, True, be) for a, b in cuts]
        if nxt is None:  # the chain's end: nothing to pass on
            return recvs
        # each segment passed on once it has arrived (by whichever wait polls next)
        sends = [_post_send(a_u8[a:b], nxt, be, w.test, ctx.gate) for (a, b), w in zip(cuts, recvs)]
        ctx.gate += tuple(recvs)
        return recvs + sends

    _receive(ctx, t, relay)


class _Deferred(Work):
    """A reshard send posted later than its call: once ``ready()`` holds (a relayed
    segment has arrived, a chain's go message came) and every earlier deferred send of
    this rank to the same peer is posted (a peer receives a pair's messages in the order
    they were meant to be sent). Registered in flight, so every wait of any call polls it
    (``_pump``), as the progress rule has every wait drive all work; done once the send
    it stands for is."""

    host_progress = True  # it moves only when polled: waits keep polling, not sleeping

    def __init__(self, peer: int, buf, backend, ready, tag: int):
        super().__init__("reshard", Op.SEND, None, desc="reshard send")
        self.peer, self.buf, self.be, self.ready, self.tag = peer, buf, backend, ready, tag
        self.sent = None
        self.keep = (buf,)

    def poll(self) -> bool:
        if self.sent is None:
            _pump()
            if self.sent is None:
                return False
        return self.sent.test()


_OUT: dict = {}  # (runtime id, peer, tag) -> deque of _Deferred, in the order meant
# held while the queues are read and a send posted from them, so that no thread's send
# overtakes a queued one; only tried by _pump (never re-entered, never waited for there)
_OUT_LOCK = threading.Lock()


def _issue(buf, peer: int, tag: int, backend):
    return _api.core_send(as_buffer(buf), peer, None, tag, True, backend)


def _post_send(buf, peer: int, backend, ready=None, gate=(), tag: int = TAG):
    """Send ``buf`` to ``peer`` on ``tag`` now, or as a :class:`_Deferred` when
    ``ready`` does not hold yet, a work of ``gate`` is not done or an earlier deferred
    send to ``peer`` on ``tag`` is still queued."""
    if gate:
        own = ready

        def ready():
            return all(w.test() for w in gate) and (own is None or own())
    key = (id(get_runtime()), peer, tag)
    with _OUT_LOCK:
        q = _OUT.get(key)
        if not q and (ready is None or ready()):
            return _issue(buf, peer, tag, backend)
        d = _Deferred(peer, buf, backend, ready, tag)
        _OUT.setdefault(key, deque()).append(d)
    _engine().add(d)
    return d


def _pump() -> None:
    """Post the queued sends whose turn has come (see :class:`_Deferred`)."""
    if not _OUT or not _OUT_LOCK.acquire(False):
        return
    try:
        for key in list(_OUT):
            q = _OUT[key]
            while q and (q[0].ready is None or q[0].ready()):
                d = q.popleft()
                try:
                    d.sent = _issue(d.buf, d.peer, d.tag, d.be)
                except BaseException as exc:  # (the send failed: so does its stand-in)
                    d.sent = d
                    d.complete(exc)
            if not q:
                del _OUT[key]
    finally:
        _OUT_LOCK.release()


def _send_recv(ctx: _Ctx, t) -> None:
    if ctx.rank == t.sender:
        src = ctx.source_bytes(t.box)
        ctx.later([_post_send(src, r, ctx.backend, None, ctx.gate) for r in t.receivers], src)
    else:
        _receive(ctx, t, lambda a: [_api.core_recv(as_buffer(a), t.sender, None, TAG, True,
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
            works += [_post_send(buf[a:b], r, be, None, ctx.gate) for r, (a, b) in zip(rs, cuts)]
        ctx.later(works, buf)
        return
    rs = next(rs for rs in hosts if ctx.rank in rs)
    k, i = len(rs), rs.index(ctx.rank)
    c, cuts = _pieces(t.nbytes, k)
    a, b = cuts[i]
    if k == 1:
        _receive(ctx, t, lambda u8: [_api.core_recv(as_buffer(u8), t.sender, None, TAG, True, be)])
        return
    g = group_of(tuple(sorted(rs)))
    pos = g.group_rank(ctx.rank)  # the all-gather orders pieces by group rank
    piece = ctx.scratch(c)
    _api.core_recv(as_buffer(piece[:b - a]), t.sender, None, TAG, False, be)
    whole = ctx.scratch(c * k)
    _api.all_gather_into_tensor(as_buffer(whole), as_buffer(piece), g, False, be)
    assert pos == i  # both sorted by rank
    flat, view = ctx.target(t.box)
    if flat is not None:
        flat[...] = whole[:t.nbytes]
    else:
        ctx.store(view, whole[:t.nbytes])
