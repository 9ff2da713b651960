"""``torch.distributed.init_process_group("mcrdl")``: MCR-DL as a registered torch backend.

On torch 2.13 a backend written in Python is a subclass of
``torch.distributed.ProcessGroup`` returned by the creator (a Python subclass of the
C++ ``Backend`` has no usable constructor); torch then calls its methods for every
collective -- from Python (``dist.all_reduce`` -> ``pg.allreduce``) and from C++ (DDP's
reducer, ``_functional_collectives``) alike. Each method converts torch's arguments
(option structs, group ranks, ReduceOp objects) and makes one asynchronous call of
mcrdl_core, so every call gets the core's per-call selection -- explicit per-group or
per-op choice (``pg_options`` / ``MCRDL_BACKEND``), then the tuning table, then the
policy -- its ordering and deadlock freedom, and the comm logger. It returns a
:class:`~mcrdl_torch.pg_work.PGWork` (``wait``, ``is_completed``, ``exception``,
``get_future``; futures complete without anyone waiting, see ``pg_work.py``).

Choosing backends per group: ``init_process_group("mcrdl", pg_options="mpi")`` or
``pg_options="all_reduce=gloo,all_to_all=mpi"`` (a dict works too, or any object with a
``backend`` attribute holding either); ``new_group(..., pg_options=...)`` likewise.
Without one, the core's usual order applies (``MCRDL_BACKEND``, table, policy).

Ranks: torch passes group ranks (roots, peers); the core takes global ranks, so the
group maps them. Subgroups: torch 2.13 hands ``new_group`` to the default group's
``new_group`` on every rank; the core group is made on every rank, keyed by torch's
group name (which the members share), and non-members get None.

Rendezvous: the core bootstraps itself (MPI under ``mpiexec``, torchrun's store under
``torchrun``); the store torch hands to the creator is not used for data. The rank
torch was told must be the core's rank: a mismatch is refused with advice.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

import mcrdl_core as core
from mcrdl_core.errors import InvalidArgumentError, McrdlError, UnsupportedError
from mcrdl_core import bootstrap as _bootstrap
from mcrdl_core.ops import ReduceOp
from mcrdl_core.progress import engine as _engine
from mcrdl_core.selection import parse_override

from .pg_work import PGWork, seconds
from .tensors import to_buffer as _b

log = logging.getLogger("mcrdl.torch.pg")

BACKEND_NAME = "mcrdl"

_REDUCE = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PRODUCT,
           "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX, "BAND": ReduceOp.BAND,
           "BOR": ReduceOp.BOR, "BXOR": ReduceOp.BXOR}


_AS_RUNTIME: dict = {}


def as_runtime_error(exc: McrdlError) -> McrdlError:
    """The same error, also a RuntimeError: torch code catches RuntimeError from a
    backend (facebookresearch/dlrm probes all_to_all_single that way), while MCR-DL's
    argument errors are ValueError/TypeError subclasses; the copy is both."""
    if isinstance(exc, RuntimeError):
        return exc
    cls = _AS_RUNTIME.get(type(exc))
    if cls is None:
        cls = _AS_RUNTIME[type(exc)] = type(type(exc).__name__, (type(exc), RuntimeError), {})
    err = cls(str(exc))
    err.__cause__ = exc
    return err


def _reduce_op(op):
    """(core ReduceOp, pre-multiplication factor or None) from a torch ReduceOp, its
    RedOpType, an options struct's ``reduceOp`` or a name."""
    op = getattr(op, "reduceOp", op)
    kind = getattr(op, "op", op)
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    name = name.upper()
    if name == "PREMUL_SUM":
        return ReduceOp.SUM, op.factor
    try:
        return _REDUCE[name], None
    except KeyError:
        raise UnsupportedError(f"reduce op {op!r} is not supported by the mcrdl process group; "
                               f"use one of {sorted(_REDUCE) + ['PREMUL_SUM']}") from None


def _one(tensors, what: str):
    """torch's list-of-one-tensor convention (one device per process)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise InvalidArgumentError(f"{what}: the mcrdl process group takes one tensor per "
                                   f"process (got {len(tensors)}); use one device per rank")
    return tensors[0]


def _inner(lists):
    """The per-rank list out of torch's ``[[t0, t1, ...]]`` (or a flat list); None if empty."""
    if lists is None or len(lists) == 0:
        return None
    first = lists[0]
    return list(first) if isinstance(first, (list, tuple)) else list(lists)


def _apart(inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``inp``, or a copy of it when it shares memory with ``out`` (FSDP gathers into
    the tensor whose shard is the input; MPI refuses aliased buffers)."""
    if inp.numel() == 0 or out.numel() == 0:
        return inp
    a, b = inp.data_ptr(), inp.data_ptr() + inp.numel() * inp.element_size()
    c, d = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    return inp.clone() if a < d and c < b else inp


def _premul(t: torch.Tensor, factor) -> torch.Tensor:
    """PREMUL_SUM on an in-place call: scale, then the sum runs."""
    return t if factor is None else t.mul_(factor)


def parse_options(options) -> dict:
    """``pg_options`` -> {op name or "*": backend}: a string ("mpi",
    "all_reduce=gloo,all_to_all=mpi"), a dict, or an object with ``backend``."""
    if options is None:
        return {}
    options = getattr(options, "backend", options)
    if isinstance(options, str):
        return parse_override(options)
    if isinstance(options, dict):
        return {str(k): str(v) for k, v in options.items()}
    raise InvalidArgumentError(f"pg_options={options!r}: give a backend name ('mpi'), per-op "
                               "choices ('all_reduce=gloo,all_to_all=mpi') or a dict of them")


class McrdlProcessGroup(dist.ProcessGroup):
    """A torch process group whose calls run on MCR-DL (see the module docstring)."""

    def __init__(self, group: core.Group, options=None, timeout=None):
        super().__init__(group.rank, group.size)
        self._g = group
        self._choice = parse_options(options)
        self._timeout = seconds(timeout)
        self._coalescing = None  # core works collected between _start/_end_coalescing
        self._gname = ""
        self._gdesc = ""

    # --- identity -----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._g.rank

    def size(self) -> int:
        return self._g.size

    @property
    def mcrdl_group(self) -> core.Group:
        """The core group (mcrdl_torch/mcrdl_core calls accept this process group too)."""
        return self._g

    def _set_group_name(self, name: str) -> None:
        self._gname = name
        super()._set_group_name(name)

    def _set_group_desc(self, desc: str) -> None:
        self._gdesc = desc
        super()._set_group_desc(desc)

    @property
    def group_name(self) -> str:
        return self._gname

    @property
    def group_desc(self) -> str:
        return self._gdesc

    def set_timeout(self, timeout) -> None:
        self._timeout = seconds(timeout)

    def __repr__(self) -> str:
        return f"<McrdlProcessGroup {self._g.describe()} rank {self._g.rank}>"

    # --- plumbing -----------------------------------------------------------------------
    def _backend(self, op: str):
        return self._choice.get(op) or self._choice.get("*")

    def _issue(self, call, outputs, source=None, after=None) -> PGWork:
        """Run ``call()`` (a list of async core works) under the engine lock; ``after``
        runs once the last work completes (a copy back, say)."""
        with _engine().lock:
            try:
                works = call()
            except McrdlError as exc:  # refused before anything was sent
                raise as_runtime_error(exc) from None
            if after is not None:
                works[-1].add_finalizer(after)
        if self._coalescing is not None:
            self._coalescing.extend(works)
        return PGWork(works, outputs, self._timeout, source)

    def _global(self, group_rank: int) -> int:
        return self._g.global_rank(int(group_rank))

    # --- all-reduce ---------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, *rest) -> PGWork:
        """``allreduce(tensors, AllreduceOptions)`` (also a ReduceOp for ``opts``)."""
        t = _one(tensors, "allreduce")
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        be = self._backend("all_reduce")
        # torch's blocking dist.all_reduce says asyncOp=False and waits at once: make the
        # core's blocking call (its fast path) and hand back a completed Work
        blocking = getattr(opts, "asyncOp", True) is False and self._coalescing is None

        def call():
            _premul(t, factor)
            if blocking:
                core.all_reduce(_b(t), op, self._g, False, be)
                return []
            return [core.all_reduce(_b(t), op, self._g, True, be)]
        return self._issue(call, [t])

    def allreduce_coalesced(self, tensors, opts=None) -> PGWork:
        """One all-reduce of the tensors flattened together (same dtype), else one each."""
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        tensors = list(tensors)
        be = self._backend("all_reduce")
        if len({t.dtype for t in tensors}) == 1 and len(tensors) > 1:
            flat = torch.cat([t.reshape(-1) for t in tensors])

            def unflatten():
                off = 0
                for t in tensors:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

            def call():
                _premul(flat, factor)
                return [core.all_reduce(_b(flat), op, self._g, True, be)]
            return self._issue(call, tensors, after=unflatten)

        def each():
            return [core.all_reduce(_b(_premul(t, factor)), op, self._g, True, be)
                    for t in tensors]
        return self._issue(each, tensors)

    # --- rooted -------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None, *rest) -> PGWork:
        if isinstance(opts, int):  # broadcast(tensor, root)
            root, index = opts, 0
        else:
            root, index = opts.rootRank, opts.rootTensor
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        t = tensors[index] if len(tensors) > 1 else _one(tensors, "broadcast")
        src = self._global(root)
        be = self._backend("broadcast")
        return self._issue(lambda: [core.broadcast(_b(t), src, self._g, True, be)], [t])

    def reduce(self, tensors, opts=None, *rest) -> PGWork:
        t = _one(tensors, "reduce")
        if isinstance(opts, int):  # reduce(tensor, root, op)
            root, op, factor = opts, *_reduce_op(rest[0] if rest else ReduceOp.SUM)
        else:
            root = opts.rootRank
            op, factor = _reduce_op(opts)
        dst = self._global(root)
        be = self._backend("reduce")

        def call():
            _premul(t, factor)
            return [core.reduce(_b(t), dst, op, self._g, True, be)]
        return self._issue(call, [t])

    def gather(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``gather([[out per rank]] on the root, [] elsewhere, [input], opts)`` (also
        ``([outs], input, root)``)."""
        inp = _one(input_tensors, "gather")
        root = opts if isinstance(opts, int) else opts.rootRank
        outs = _inner(output_tensors) if self._g.rank == root else None
        dst = self._global(root)
        be = self._backend("gather")
        return self._issue(lambda: [core.gather(_b(inp), [_b(o) for o in outs] if outs else None,
                                                dst, self._g, True, be)],
                           [outs] if outs else [])

    def scatter(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``scatter([out], [[in per rank]] on the root, [] elsewhere, opts)``."""
        out = _one(output_tensors, "scatter")
        root = opts if isinstance(opts, int) else opts.rootRank
        ins = _inner(input_tensors) if self._g.rank == root else None
        src = self._global(root)
        be = self._backend("scatter")
        return self._issue(lambda: [core.scatter(_b(out), [_b(i) for i in ins] if ins else None,
                                                 src, self._g, True, be)], [out])

    # --- all-gather ---------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensor, opts=None) -> PGWork:
        """``allgather([[out per rank]], [input])`` (also ``([outs], input)``)."""
        outs = _inner(output_tensors)
        inp = _one(input_tensor, "allgather")
        be = self._backend("all_gather")
        return self._issue(lambda: [core.all_gather([_b(o) for o in outs], _b(inp), self._g, True,
                                                    be)], [outs])

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> PGWork:
        be = self._backend("all_gather")
        pairs = list(zip(output_lists, input_list))
        return self._issue(lambda: [core.all_gather([_b(o) for o in outs], _b(i), self._g, True, be)
                                    for outs, i in pairs], [list(o) for o in output_lists])

    def _allgather_base(self, output, input, opts=None) -> PGWork:
        input = _apart(input, output)
        be = self._backend("all_gather")
        return self._issue(lambda: [core.all_gather_into_tensor(_b(output), _b(input), self._g,
                                                                True, be)], [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> PGWork:
        be = self._backend("all_gather")
        pairs = [(o, _apart(i, o)) for o, i in zip(outputs, inputs)]
        return self._issue(lambda: [core.all_gather_into_tensor(_b(o), _b(i), self._g, True, be)
                                    for o, i in pairs], list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # --- reduce-scatter -----------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``reduce_scatter([out], [[in per rank]], opts)`` (also ``(out, [ins], op)``)."""
        out = _one(output_tensors, "reduce_scatter")
        ins = _inner(input_tensors)
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        ins = [_apart(i, out) if factor is None else i * factor for i in ins]
        be = self._backend("reduce_scatter")
        return self._issue(lambda: [core.reduce_scatter(_b(out), [_b(i) for i in ins], op,
                                                        self._g, True, be)], [out])

    def _reduce_scatter_base(self, output, input, opts=None) -> PGWork:
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        inp = _apart(input, output) if factor is None else input * factor
        be = self._backend("reduce_scatter")
        return self._issue(lambda: [core.reduce_scatter_tensor(_b(output), _b(inp), op, self._g,
                                                               True, be)], [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> PGWork:
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        pairs = [(o, _apart(i, o) if factor is None else i * factor)
                 for o, i in zip(outputs, inputs)]
        be = self._backend("reduce_scatter")
        return self._issue(lambda: [core.reduce_scatter_tensor(_b(o), _b(i), op, self._g, True, be)
                                    for o, i in pairs], list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # --- all-to-all ---------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=None) -> PGWork:
        """Uneven splits as in torch (empty lists: even). ``output`` may be ``input``: the
        input is then copied first."""
        src = _apart(input, output)
        osz = list(output_split_sizes) or None
        isz = list(input_split_sizes) or None
        be = self._backend("all_to_all")
        return self._issue(lambda: [core.all_to_all_single(_b(output), _b(src), osz, isz, self._g,
                                                           True, be)], [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None) -> PGWork:
        outs, ins = list(output_tensors), list(input_tensors)
        be = self._backend("all_to_all")
        return self._issue(lambda: [core.all_to_all([_b(o) for o in outs], [_b(i) for i in ins],
                                                    self._g, True, be)], outs)

    # --- point to point -----------------------------------------------------------------
    def send(self, tensors, dstRank: int, tag: int = 0) -> PGWork:
        t = _one(tensors, "send")
        dst = self._global(dstRank)
        be = self._backend("send")
        return self._issue(lambda: [core.send(_b(t), dst, self._g, tag, True, be)], [t])

    def recv(self, tensors, srcRank: int, tag: int = 0) -> PGWork:
        t = _one(tensors, "recv")
        src = self._global(srcRank)
        be = self._backend("recv")
        return self._issue(lambda: [core.recv(_b(t), src, self._g, tag, True, be)], [t],
                           source=lambda: int(srcRank))

    def recv_anysource(self, tensors, tag: int = 0) -> PGWork:
        t = _one(tensors, "recv_anysource")
        be = self._backend("recv")
        box = []

        def call():
            box.append(core.recv(_b(t), None, self._g, tag, True, be))
            return box

        return self._issue(call, [t], source=lambda: self._g.group_rank(box[0]._result))

    # --- barrier, coalescing ------------------------------------------------------------
    def barrier(self, opts=None) -> PGWork:
        be = self._backend("barrier")
        return self._issue(lambda: [core.barrier(self._g, True, be)], [])

    def _start_coalescing(self, device=None) -> None:
        if self._coalescing is not None:
            raise InvalidArgumentError("_start_coalescing: this group is already coalescing; "
                                       "end it with _end_coalescing first")
        self._coalescing = []

    def _end_coalescing(self, device=None) -> PGWork:
        """One Work for every call made since ``_start_coalescing`` (each was issued when
        it was made: nothing waits for the end to start moving)."""
        works, self._coalescing = self._coalescing or [], None
        return PGWork(works, [], self._timeout)

    # --- groups -------------------------------------------------------------------------
    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None,
                  group_desc=None, **_ignored):
        """torch 2.13 calls this on every rank for ``dist.new_group``; ranks are global.
        Returns the member's group, None elsewhere."""
        ranks = sorted(int(r) for r in ranks)
        world_ranks = [self._global(r) for r in range(self._g.size)] if self._g.id != 0 else None
        if world_ranks is not None and any(r not in world_ranks for r in ranks):
            raise InvalidArgumentError(f"new_group: ranks {ranks} are not all in {self._g.describe()}")
        g = core.new_group(ranks, name=group_name,
                           key=f"torch:{group_name}" if group_name else None)
        if not g.is_member:
            return None
        opts = pg_options if pg_options is not None else self._choice or None
        pg = McrdlProcessGroup(g, opts, timeout if timeout is not None else self._timeout)
        if group_name:
            pg._set_group_name(group_name)
        pg._set_group_desc(group_desc or "undefined")
        return pg

    def shutdown(self) -> None:
        """``destroy_process_group``: finish this group's in-flight work. The core runtime
        stays up (mcrdl_torch and mcrdl_core calls in the same process share it)."""
        eng = _engine()
        mine = [w for w in list(eng.inflight) if w.group is self._g]
        if mine:
            eng.wait(mine)

    def abort(self) -> None:
        self.shutdown()


def create(dist_opts, backend_options=None) -> McrdlProcessGroup:
    """The creator registered with ``extended_api=True``: torch calls it with a
    ``_DistributedBackendOptions`` (store, group rank/size, timeout, global ranks) and
    the user's ``pg_options``."""
    timeout = dist_opts.timeout
    secs = seconds(timeout) if isinstance(timeout, datetime.timedelta) else None
    ranks = list(dist_opts.global_ranks_in_group or [])
    if not ranks:  # the default group
        if dist_opts.group_size != rt.world_size or dist_opts.group_rank != rt.rank:
            raise InvalidArgumentError(
                f"init_process_group('mcrdl'): torch was told rank {dist_opts.group_rank} of "
                f"{dist_opts.group_size} but the launcher says rank {rt.rank} of "
                f"{rt.world_size}; launch with mpiexec or torchrun and do not pass rank/"
                "world_size, or run 'python -m mcrdl_torch.run script.py'")
        group = rt.world
    else:
        # a subgroup made through the creator (the default group is another backend):
        # only members get here, so the core group's id comes from torch's group name,
        # which every member shares, instead of a creation counter
        group = rt.new_group(ranks, name=str(dist_opts.group_id),
                             key=f"torch:{dist_opts.group_id}")
    return McrdlProcessGroup(group, backend_options, timeout)


def register() -> None:
    """Register "mcrdl" with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                  devices=["cpu", "cuda"])
    boot = None
    if not ranks and not core.is_initialized() and not _bootstrap.launched_by_mpi():
        # torchrun, RANK/WORLD_SIZE set by hand, mp.spawn with rank=/world_size=: the core
        # bootstraps on the store torch made (never a second server on MASTER_PORT)
        store = dist.PrefixStore(_bootstrap.store_prefix(), dist_opts.store)
        boot = _bootstrap.EnvBootstrap(lambda _: store, dist_opts.group_rank,
                                       dist_opts.group_size)
    rt = core.init(timeout=secs, bootstrap=boot)
