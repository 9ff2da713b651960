"""Batched point-to-point: ``batch_isend_irecv``, as torch.distributed's.

Sends and receives issued one after another can deadlock on a library that runs them
in order on one stream: with NCCL, a ring where every rank sends before it receives
hangs once a send waits for its peer's receive (3+ ranks, or messages past NCCL's
buffering). Issued as one batch they cannot: the ops that land on a backend with a
grouped form (``Backend.batch_p2p``: NCCL's ``groupStart``/``groupEnd``) go to it as
one group, the others are issued non-blocking one by one (MPI, Gloo), and the progress
engine drives all of them together.

Each op picks its backend as a single ``isend``/``irecv`` of that buffer would (so a
message's two ends agree, whatever else is in either batch). Host buffers first try the
fast path (``fastpath.batch``: the same plans as single isends and irecvs, each op
issued and registered by the backend's compiled launch), which steps aside, before
anything is issued, wherever it could not keep what this call does.
"""
from __future__ import annotations

from . import fastpath as _fast
from . import validate as _v
from ..base import tags as _tags
from ..base.errors import InvalidArgumentError
from ..base.ops import Op
from .runtime import get_runtime

_SEND_NAMES = ("isend", "send")
_RECV_NAMES = ("irecv", "recv")


class P2POp:
    """One send or receive of a batch. ``op``: ``isend``/``irecv`` (the function of
    mcrdl_core, mcrdl_torch or torch.distributed, or its name); ``peer``: a global rank,
    as in torch.distributed; ``tag``: in ``[0, USER_TAG_LIMIT)`` (``mcrdl_core.base.tags``),
    ignored by NCCL (it has none)."""

    def __init__(self, op, tensor, peer: int, group=None, tag: int = 0):
        name = op if isinstance(op, str) else getattr(op, "__name__", "")
        if name not in _SEND_NAMES + _RECV_NAMES:
            raise InvalidArgumentError(f"P2POp: op must be isend or irecv, got {op!r}")
        self.is_send = name in _SEND_NAMES
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = _tags.user_tag(tag, "P2POp")

    def __repr__(self) -> str:
        return f"P2POp({'isend' if self.is_send else 'irecv'}, peer={self.peer})"


def batch_isend_irecv(p2p_op_list, backend: str | None = None) -> list:
    """Issue every send and receive of ``p2p_op_list`` together; returns one Work per op
    (ops grouped on one backend share theirs). All ops must use the same group. Every
    argument is checked before anything is sent."""
    ops = list(p2p_op_list)
    if not ops or not all(isinstance(o, P2POp) for o in ops):
        raise InvalidArgumentError("batch_isend_irecv: give a non-empty list of P2POp")
    if any(o.group is not ops[0].group for o in ops):
        raise InvalidArgumentError("batch_isend_irecv: every P2POp of a batch must use the "
                                   "same group; make one batch per group")
    rt = get_runtime()
    g = rt.group(ops[0].group)
    bufs = [_v.input(o.tensor, f"p2p_op_list[{i}].tensor") if o.is_send
            else _v.output(o.tensor, f"p2p_op_list[{i}].tensor") for i, o in enumerate(ops)]
    if all(b.device.kind == "cpu" for b in bufs):  # the fast path (its first call plans)
        done = _fast.batch(rt, [(o.is_send, b.ptr, b.numel, b.dtype, o.peer, o.tag, b)
                                for o, b in zip(ops, bufs)], ops[0].group, backend, bufs)
        if done is not _fast.MISS:
            return done
    plan = []  # (backend, P2POp, buffer, group rank of the peer)
    for i, (o, buf) in enumerate(zip(ops, bufs)):
        be = rt.select(Op.SEND if o.is_send else Op.RECV, g, buf, backend)
        plan.append((be, o, buf, g.group_rank(o.peer, f"p2p_op_list[{i}].peer")))
    spans = rt.order(reads=[b for _, o, b, _ in plan if o.is_send],
                     writes=[b for _, o, b, _ in plan if not o.is_send])
    works: list = [None] * len(plan)
    grouped: dict = {}  # backend -> indices of its ops
    for i, (be, o, buf, peer) in enumerate(plan):
        if be.grouped_p2p:
            grouped.setdefault(be, []).append(i)
        elif o.is_send:
            works[i] = be.send(g, buf, peer, o.tag)
        else:
            works[i] = _global_source(g, be.recv(g, buf, peer, o.tag))
    for be, idx in grouped.items():
        sends = [(plan[i][2], plan[i][3]) for i in idx if plan[i][1].is_send]
        recvs = [(plan[i][2], plan[i][3]) for i in idx if not plan[i][1].is_send]
        work = be.batch_p2p(g, sends, recvs)
        for i in idx:
            works[i] = work
    seen = set()
    for w, (_, _, buf, _) in zip(works, plan):
        if id(w) not in seen:
            seen.add(id(w))
            rt.finish(w, spans, True, buf.nbytes)
    return works


def _global_source(g, work):
    """A receive's result as a global rank (the backend reports the group rank)."""
    work.add_finalizer(lambda: setattr(work, "value", g.global_rank(work.value)))
    return work
