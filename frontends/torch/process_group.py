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
group name (which the members share), and non-members get None. Under another default
backend, torch calls the creator on the members only: without a runtime yet, they start
one among themselves (see ``create``).

Rendezvous: the core bootstraps itself (MPI under ``mpiexec``, torchrun's store under
``torchrun``); the store torch hands to the creator is not used for data. The rank
torch was told must be the core's rank: a mismatch is refused with advice.
"""
from __future__ import annotations

import datetime
import logging
import sys

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import mcrdl_core as core
from mcrdl_core.world import bootstrap as _bootstrap
from mcrdl_core.world.group import next_round
from mcrdl_core.base.errors import InvalidArgumentError, McrdlError, UnsupportedError
from mcrdl_core.base.ops import ReduceOp
from mcrdl_core.engine.progress import engine as _engine
from mcrdl_core.dispatch.selection import parse_override

from .pg_work import PGWork, seconds
from .tensors import CORE_DTYPES, as_bytes, write_back
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


# --- tensors the core does not take as they are -----------------------------------------
# torch's Gloo accepts outputs that are not contiguous, bool on every op, complex sums and
# any dtype on calls that only move data; the core takes contiguous memory of its own
# dtypes (mcrdl_core.base.dtypes.SUPPORTED). Each call hands the core a stand-in instead: a
# contiguous copy written back when the call is done, the tensor's bytes, bool as uint8
# (with the reduction Gloo computes on bool), complex as (real, imag) pairs.

# bool reductions as Gloo computes them: a sum or a maximum is "any", a product or a
# minimum is "all"; over 0/1 bytes these are MAX and MIN, and the bitwise ops are themselves
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
             ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN,
             ReduceOp.BAND: ReduceOp.BAND, ReduceOp.BOR: ReduceOp.BOR,
             ReduceOp.BXOR: ReduceOp.BXOR}


def _staged(t: torch.Tensor, after: list, copy_in: bool = True) -> torch.Tensor:
    """``t`` when the core can write it where it is (contiguous); else a contiguous
    copy -- of its values when ``copy_in`` (in-place calls read them) -- and a step
    appended to ``after`` that writes the result back into ``t`` once the call is done
    (transposed, strided, expanded and channels_last outputs land in their own memory)."""
    if t.layout is not torch.strided or t.is_contiguous():  # (sparse: refused by _b)
        return t
    tmp = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    after.append(lambda: write_back(t, tmp))
    return tmp


def _moved(t: torch.Tensor) -> torch.Tensor:
    """For calls that only move data: ``t``, or its bytes when the core does not take its
    dtype (bool, int16, uint16/32/64, float8, complex)."""
    if t.dtype in CORE_DTYPES or t.layout is not torch.strided:
        return t
    return as_bytes(t.contiguous())


def _reduced(t: torch.Tensor, op: ReduceOp, factor=None, inplace: bool = True):
    """(the tensor the core reduces, the core's op) for ``t`` reduced with ``op``, after
    PREMUL_SUM's ``factor`` is applied (to ``t`` itself when ``inplace``: its result
    overwrites it anyway; else to a copy, for inputs the caller keeps)."""
    if factor is not None:
        if t.dtype is torch.bool:
            raise UnsupportedError("PREMUL_SUM on a bool tensor has no meaning; use a "
                                   "floating or complex tensor")
        t = t.mul_(factor) if inplace else t * factor
    if t.dtype in CORE_DTYPES:
        return t, op
    if t.dtype is torch.bool:
        if op not in _BOOL_OPS:
            raise UnsupportedError(f"ReduceOp.{op.name} on bool tensors is not supported "
                                   "(Gloo refuses it too); use SUM/MAX (any), PRODUCT/MIN "
                                   "(all) or a bitwise op")
        return t.view(torch.uint8), _BOOL_OPS[op]
    if t.is_complex():
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise UnsupportedError(f"ReduceOp.{op.name} does not support complex tensors "
                                   "(complex numbers have no order; torch refuses it as "
                                   "well); use SUM, AVG or PREMUL_SUM")
        return torch.view_as_real(t.contiguous()), op
    return t, op  # the core refuses it, naming the dtype


def _flat(tensors) -> torch.Tensor:
    """One new 1-D tensor of the tensors' values, one after another (one dtype)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, lists) -> None:
    """Copy consecutive pieces of 1-D ``flat`` into the tensors of ``lists``, in order."""
    off = 0
    for ts in lists:
        for t in ts:
            write_back(t, flat[off:off + t.numel()].view(t.shape))
            off += t.numel()


def _when_done(works, steps) -> None:
    """Run ``steps`` once every one of ``works`` is complete (at once if all are), after
    the core's own finalizers; never after a failure (the tensors keep their values)."""
    pending = [w for w in works if not w.done]
    if any(w.error is not None for w in works if w.done):
        return
    if not pending:
        for step in steps:
            step()
        return
    left = [len(pending)]

    def one():
        left[0] -= 1
        if left[0] == 0:
            for step in steps:
                step()
    for w in pending:
        w.add_finalizer(one)


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
        self.choices = parse_options(options)
        self._timeout = seconds(timeout)
        group.timeout = self._timeout
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
        self._g.timeout = self._timeout

    def __repr__(self) -> str:
        return f"<McrdlProcessGroup {self._g.describe()} rank {self._g.rank}>"

    # --- plumbing -----------------------------------------------------------------------
    def _backend(self, op: str):
        return self.choices.get(op) or self.choices.get("*")

    def _issue(self, call, outputs, source=None, after=()) -> PGWork:
        """Run ``call()`` (a list of async core works, empty if it completed them) under
        the engine lock; the steps in ``after`` run once every work is complete (copies
        back into torch's tensors). ``outputs``: the Work's result and future value."""
        with _engine().lock:
            try:
                works = call()
            except McrdlError as exc:  # refused before anything was sent
                raise as_runtime_error(exc) from None
            if after:
                _when_done(works, after)
        if self._coalescing is not None:
            self._coalescing.extend(works)
        return PGWork(works, outputs, self._timeout, source)

    def _global(self, group_rank: int) -> int:
        return self._g.global_rank(int(group_rank))

    # --- all-reduce ---------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, *rest) -> PGWork:
        """``allreduce(tensors, AllreduceOptions)`` (also a ReduceOp for ``opts``); a
        sparse COO tensor takes ``_sparse_allreduce``."""
        t = _one(tensors, "allreduce")
        if t.layout is not torch.strided:
            return self._sparse_allreduce(t, opts)
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        be = self._backend("all_reduce")
        # torch's blocking dist.all_reduce says asyncOp=False and waits at once: make the
        # core's blocking call (its fast path) and hand back a completed Work
        blocking = getattr(opts, "asyncOp", True) is False and self._coalescing is None
        after = []
        x = _staged(t, after)

        def call():
            buf, rop = _reduced(x, op, factor)
            if blocking:
                core.all_reduce(_b(buf), rop, self._g, False, be)
                return []
            return [core.all_reduce(_b(buf), rop, self._g, True, be)]
        return self._issue(call, [t], after=after)

    def allreduce_coalesced(self, tensors, opts=None) -> PGWork:
        """One all-reduce of the tensors flattened together (same dtype), else one each."""
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        tensors = list(tensors)
        be = self._backend("all_reduce")
        if len({t.dtype for t in tensors}) == 1 and len(tensors) > 1:
            flat = _flat(tensors)

            def call():
                buf, rop = _reduced(flat, op, factor)
                return [core.all_reduce(_b(buf), rop, self._g, True, be)]
            return self._issue(call, tensors, after=[lambda: _unflat(flat, [tensors])])
        after = []
        xs = [_staged(t, after) for t in tensors]

        def each():
            works = []
            for x in xs:
                buf, rop = _reduced(x, op, factor)
                works.append(core.all_reduce(_b(buf), rop, self._g, True, be))
            return works
        return self._issue(each, tensors, after=after)

    def _sparse_allreduce(self, t: torch.Tensor, opts) -> PGWork:
        """SUM of sparse COO tensors, as Gloo does it (DDP's sparse embedding gradients):
        every rank's coalesced indices and values are gathered -- padded to the largest
        count, which a small all-gather tells every rank first -- and the coalesced sum
        replaces ``t``'s contents once the call is done."""
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        if t.layout is not torch.sparse_coo or op not in (ReduceOp.SUM, ReduceOp.AVG) or (
                op is ReduceOp.AVG and not t.dtype.is_floating_point):
            raise as_runtime_error(UnsupportedError(
                f"all_reduce of a sparse tensor (layout {t.layout}, ReduceOp.{op.name}): only "
                "SUM (and AVG, PREMUL_SUM of floating tensors) of sparse COO tensors is "
                "supported, as with Gloo; densify with .to_dense() for other reductions"))
        be = self._backend("all_gather")
        size = self._g.size
        c = t.detach().coalesce()
        idx, vals = c.indices(), c.values()
        counts = torch.empty(size, dtype=torch.int64)
        with _engine().lock:
            try:
                core.all_gather_into_tensor(_b(counts), _b(torch.tensor([idx.shape[1]])),
                                            self._g, False, be)
            except McrdlError as exc:
                raise as_runtime_error(exc) from None
        most = int(counts.max())
        pad_idx = idx.new_zeros((idx.shape[0], most))
        pad_idx[:, :idx.shape[1]] = idx
        pad_vals = vals.new_zeros((most,) + tuple(vals.shape[1:]))
        pad_vals[:vals.shape[0]] = vals
        all_idx = pad_idx.new_empty((size,) + tuple(pad_idx.shape))
        all_vals = pad_vals.new_empty((size,) + tuple(pad_vals.shape))

        def combine():
            keep = [int(k) for k in counts]
            total = torch.sparse_coo_tensor(
                torch.cat([all_idx[r, :, :k] for r, k in enumerate(keep)], dim=1),
                torch.cat([all_vals[r, :k] for r, k in enumerate(keep)]), t.shape).coalesce()
            if op is ReduceOp.AVG:
                total = total / size
            if factor is not None:
                total = total * factor
            with torch.no_grad():
                t.copy_(total)

        def call():
            return [core.all_gather_into_tensor(_b(_moved(o)), _b(_moved(i)), self._g, True, be)
                    for o, i in ((all_idx, pad_idx), (all_vals, pad_vals))]
        return self._issue(call, [t], after=[combine])

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
        after = []
        x = _moved(_staged(t, after))
        return self._issue(lambda: [core.broadcast(_b(x), src, self._g, True, be)], [t],
                           after=after)

    def reduce(self, tensors, opts=None, *rest) -> PGWork:
        t = _one(tensors, "reduce")
        if isinstance(opts, int):  # reduce(tensor, root, op)
            root, op, factor = opts, *_reduce_op(rest[0] if rest else ReduceOp.SUM)
        else:
            root = opts.rootRank
            op, factor = _reduce_op(opts)
        dst = self._global(root)
        be = self._backend("reduce")
        after = []
        x = _staged(t, after)

        def call():
            buf, rop = _reduced(x, op, factor)
            return [core.reduce(_b(buf), dst, rop, self._g, True, be)]
        return self._issue(call, [t], after=after)

    def gather(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``gather([[out per rank]] on the root, [] elsewhere, [input], opts)`` (also
        ``([outs], input, root)``). Result and future value: the root's list of outputs,
        ``[]`` elsewhere (as Gloo's)."""
        inp = _one(input_tensors, "gather")
        root = opts if isinstance(opts, int) else opts.rootRank
        outs = (_inner(output_tensors) if self._g.rank == root else None) or []
        dst = self._global(root)
        be = self._backend("gather")
        after = []
        xs = [_moved(_staged(o, after, False)) for o in outs]
        return self._issue(lambda: [core.gather(_b(_moved(inp)), [_b(x) for x in xs] or None,
                                                dst, self._g, True, be)], outs, after=after)

    def scatter(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``scatter([out], [[in per rank]] on the root, [] elsewhere, opts)``."""
        out = _one(output_tensors, "scatter")
        root = opts if isinstance(opts, int) else opts.rootRank
        ins = _inner(input_tensors) if self._g.rank == root else None
        src = self._global(root)
        be = self._backend("scatter")
        after = []
        x = _moved(_staged(out, after, False))
        srcs = [_moved(i) for i in ins] if ins else None
        return self._issue(lambda: [core.scatter(_b(x), [_b(i) for i in srcs] if srcs else None,
                                                 src, self._g, True, be)], [out], after=after)

    # --- all-gather ---------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensor, opts=None) -> PGWork:
        """``allgather([[out per rank]], [input])`` (also ``([outs], input)``). Result and
        future value: the list of outputs (as Gloo's)."""
        outs = _inner(output_tensors)
        inp = _one(input_tensor, "allgather")
        be = self._backend("all_gather")
        after = []
        xs = [_moved(_staged(o, after, False)) for o in outs]
        return self._issue(lambda: [core.all_gather([_b(x) for x in xs], _b(_moved(inp)), self._g,
                                                    True, be)], outs, after=after)

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> PGWork:
        """``output_lists[r][j]`` receives rank r's ``input_list[j]`` (torch's contract).
        One all-gather of the inputs flattened together when they share a dtype, else one
        per input. The future's value is Gloo's: the lists, or the only list at size 1."""
        ins = list(input_list)
        lists = [list(o) for o in output_lists]
        size = self._g.size
        if len(lists) != size or any(
                len(ol) != len(ins) or any(o.numel() != i.numel() for o, i in zip(ol, ins))
                for ol in lists):
            raise as_runtime_error(InvalidArgumentError(
                f"allgather_coalesced: give {size} output lists (one per rank), each with a "
                f"tensor of the size of every input tensor ({[i.numel() for i in ins]} "
                "elements)"))
        be = self._backend("all_gather")
        value = lists if size > 1 else lists[0]
        if ins and len({i.dtype for i in ins}) == 1:
            flat_in = _flat(ins)
            flat_out = flat_in.new_empty(size * flat_in.numel())
            if flat_in.numel() == 0:
                return self._issue(lambda: [], value)
            return self._issue(lambda: [core.all_gather_into_tensor(
                _b(_moved(flat_out)), _b(_moved(flat_in)), self._g, True, be)], value,
                after=[lambda: _unflat(flat_out, lists)])
        after = []
        columns = [[_moved(_staged(ol[j], after, False)) for ol in lists] for j in range(len(ins))]
        return self._issue(lambda: [core.all_gather([_b(x) for x in col], _b(_moved(i)), self._g,
                                                    True, be)
                                    for col, i in zip(columns, ins)], value, after=after)

    def _allgather_base(self, output, input, opts=None) -> PGWork:
        input = _apart(input, output)
        be = self._backend("all_gather")
        after = []
        out = _moved(_staged(output, after, False))
        return self._issue(lambda: [core.all_gather_into_tensor(_b(out), _b(_moved(input)),
                                                                self._g, True, be)], [output],
                           after=after)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> PGWork:
        be = self._backend("all_gather")
        after = []
        pairs = [(_moved(_staged(o, after, False)), _moved(_apart(i, o)))
                 for o, i in zip(outputs, inputs)]
        return self._issue(lambda: [core.all_gather_into_tensor(_b(o), _b(i), self._g, True, be)
                                    for o, i in pairs], list(outputs), after=after)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # --- reduce-scatter -----------------------------------------------------------------
    def _reduce_scatter_call(self, pairs, op, factor, list_form: bool):
        """The core calls of a reduce-scatter: ``pairs`` of (output, inputs), staged and
        converted here; the inputs are copied when scaled or aliasing the output."""
        be = self._backend("reduce_scatter")
        after = []
        staged = [(o, _staged(o, after, False), ins) for o, ins in pairs]

        def call():
            works = []
            for o, x, ins in staged:
                buf, rop = _reduced(x, op)
                srcs = [_reduced(_apart(i, o), op, factor, inplace=False)[0] for i in ins]
                if list_form:
                    works.append(core.reduce_scatter(_b(buf), [_b(s) for s in srcs], rop,
                                                     self._g, True, be))
                else:
                    works.append(core.reduce_scatter_tensor(_b(buf), _b(srcs[0]), rop, self._g,
                                                            True, be))
            return works
        return self._issue(call, [o for o, _ in pairs], after=after)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *rest) -> PGWork:
        """``reduce_scatter([out], [[in per rank]], opts)`` (also ``(out, [ins], op)``)."""
        out = _one(output_tensors, "reduce_scatter")
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        return self._reduce_scatter_call([(out, _inner(input_tensors))], op, factor, True)

    def _reduce_scatter_base(self, output, input, opts=None) -> PGWork:
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        return self._reduce_scatter_call([(output, [input])], op, factor, False)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> PGWork:
        op, factor = _reduce_op(opts if opts is not None else ReduceOp.SUM)
        return self._reduce_scatter_call([(o, [i]) for o, i in zip(outputs, inputs)], op,
                                         factor, False)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # --- all-to-all ---------------------------------------------------------------------
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=None) -> PGWork:
        """Uneven splits as in torch (empty lists: even). ``output`` may be ``input``: the
        input is then copied first."""
        src = _moved(_apart(input, output))
        osz = list(output_split_sizes) or None
        isz = list(input_split_sizes) or None
        be = self._backend("all_to_all")
        after = []
        out = _moved(_staged(output, after, False))
        return self._issue(lambda: [core.all_to_all_single(_b(out), _b(src), osz, isz, self._g,
                                                           True, be)], [output], after=after)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None) -> PGWork:
        outs, ins = list(output_tensors), list(input_tensors)
        be = self._backend("all_to_all")
        after = []
        xs = [_moved(_staged(o, after, False)) for o in outs]
        return self._issue(lambda: [core.all_to_all([_b(x) for x in xs],
                                                    [_b(_moved(i)) for i in ins], self._g, True,
                                                    be)], outs, after=after)

    # --- point to point -----------------------------------------------------------------
    def send(self, tensors, dstRank: int, tag: int = 0) -> PGWork:
        t = _one(tensors, "send")
        dst = self._global(dstRank)
        be = self._backend("send")
        return self._issue(lambda: [core.send(_b(_moved(t)), dst, self._g, tag, True, be)], [t])

    def recv(self, tensors, srcRank: int, tag: int = 0) -> PGWork:
        t = _one(tensors, "recv")
        src = self._global(srcRank)
        be = self._backend("recv")
        after = []
        x = _moved(_staged(t, after, False))
        return self._issue(lambda: [core.recv(_b(x), src, self._g, tag, True, be)], [t],
                           source=lambda: int(srcRank), after=after)

    def recv_anysource(self, tensors, tag: int = 0) -> PGWork:
        t = _one(tensors, "recv_anysource")
        be = self._backend("recv")
        after = []
        x = _moved(_staged(t, after, False))
        box = []

        def call():
            box.append(core.recv(_b(x), None, self._g, tag, True, be))
            return box

        return self._issue(call, [t], source=lambda: self._g.group_rank(box[0].value),
                           after=after)

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
        """torch 2.13 calls this on every rank for ``dist.new_group`` with global ranks in
        the group's order -- sorted by torch unless ``sort_ranks=False`` -- and maps group
        rank i to ``ranks[i]``; the core group keeps that order, so roots and peers agree
        with torch. Returns the member's group, None elsewhere. ``backend="gloo"`` gets a
        real torch Gloo group, any other backend but mcrdl is refused (see
        :func:`_requested_backend`)."""
        ranks = [int(r) for r in ranks]
        world_ranks = [self._global(r) for r in range(self._g.size)] if self._g.id != 0 else None
        if world_ranks is not None and any(r not in world_ranks for r in ranks):
            raise InvalidArgumentError(f"new_group: ranks {ranks} are not all in {self._g.describe()}")
        backend = _requested_backend()
        if backend == "gloo":
            return _gloo_group(ranks, timeout, group_name, group_desc)
        if backend not in (None, BACKEND_NAME):
            lib = backend if backend.isidentifier() else "mpi"
            raise as_runtime_error(UnsupportedError(
                f"new_group(backend={backend!r}) under an 'mcrdl' default group: torch 2.13 "
                "hands new_group to the default group without the backend's name, so the "
                "'mcrdl' group can only make 'mcrdl' and 'gloo' groups. Use "
                f"new_group(..., pg_options={lib!r}) for an 'mcrdl' group whose calls all "
                "run on that library"))
        g = core.new_group(ranks, name=group_name,
                           key=f"torch:{group_name}" if group_name else None)
        if not g.is_member:
            return None
        opts = pg_options if pg_options is not None else self.choices or None
        pg = McrdlProcessGroup(g, opts, timeout if timeout is not None else self._timeout)
        if group_name:
            pg._set_group_name(group_name)
        pg._set_group_desc(group_desc or "undefined")
        return with_cpu_backend(pg)

    def shutdown(self) -> None:
        """``destroy_process_group``: this group's in-flight work gets a short grace to
        finish (none after a failure); what is still pending then -- an operation no
        peer will match -- is given up and the group marked broken, with a warning,
        instead of waiting out the timeout (as Gloo returns at once). Never raises. The
        core runtime stays up (mcrdl_torch and mcrdl_core calls share it)."""
        from .pg_work import SHUTDOWN_GRACE_S, close_group

        close_group(self._g, "destroyed", SHUTDOWN_GRACE_S)

    def abort(self) -> None:
        """``_abort_process_group``: give up this group's pending work at once (its waits
        raise); never waits, never raises."""
        from .pg_work import close_group

        close_group(self._g, "aborted", 0.0)


def _requested_backend() -> str | None:
    """The backend named in the ``torch.distributed.new_group`` call being served (lower
    case), or None when it cannot be seen.

    torch 2.13's ``distributed_c10d._new_group_with_tag`` calls the default group's
    ``new_group`` without the backend's name and then registers what it gets back under
    that name, so ``new_group(backend="gloo")`` would silently be an 'mcrdl' group that
    ``get_backend`` calls "gloo". The name is only in that caller's local ``backend``
    (already defaulted to the default group's); it is read from the caller's frame."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if (frame.f_code.co_name == "_new_group_with_tag"
                and frame.f_globals.get("__name__") == "torch.distributed.distributed_c10d"):
            backend = frame.f_locals.get("backend")
            return str(backend).lower() if backend else None
        frame = frame.f_back
    return None


def _gloo_group(ranks, timeout, group_name, group_desc):
    """A torch Gloo group of ``ranks`` (group rank i is ``ranks[i]``), built as torch's
    ``_new_process_group_helper`` builds one, on the default group's store under the
    group's name and the round of that name (``next_round``: torch reuses its group names
    after destroy_process_group + init_process_group, on the same torchrun agent store,
    and a second group of a name must not read the first one's keys); torch registers it
    as "gloo" when it is returned. None on non-members (made by the members only, as
    torch makes it)."""
    me = dist.get_rank()
    if me not in ranks:
        return None
    rank, size = ranks.index(me), len(ranks)
    n = next_round(("torch gloo", group_name, tuple(ranks)))
    store = dist.PrefixStore(f"{_bootstrap.store_prefix()}/torch-gloo/{group_name}/{n}/",
                             dist.distributed_c10d._get_default_store())
    timeout = timeout if timeout is not None else default_pg_timeout
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout=timeout)
    gloo.options.global_ranks_in_group = list(ranks)
    gloo.options.group_name = group_name
    gloo._set_sequence_number_for_group()
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_group_name(group_name)
    pg._set_group_desc(group_desc or "undefined")
    return pg


def create(dist_opts, backend_options=None) -> McrdlProcessGroup:
    """The creator registered with ``extended_api=True``: torch calls it with a
    ``_DistributedBackendOptions`` (store, group rank/size, timeout, global ranks) and
    the user's ``pg_options``."""
    timeout = dist_opts.timeout
    secs = seconds(timeout) if isinstance(timeout, datetime.timedelta) else None
    ranks = list(dist_opts.global_ranks_in_group or [])
    boot = None
    if not ranks and not core.is_initialized() and not _bootstrap.launched_by_mpi():
        # torchrun, RANK/WORLD_SIZE set by hand, mp.spawn with rank=/world_size=: the core
        # bootstraps on the store torch made (never a second server on MASTER_PORT)
        store = dist.PrefixStore(_bootstrap.store_prefix(), dist_opts.store)
        boot = _bootstrap.EnvBootstrap(lambda _: store, dist_opts.group_rank,
                                       dist_opts.group_size)
    if ranks and not core.is_initialized():
        # a subgroup made by its members only under another default backend: the
        # runtime starts among the members, on the group's own store (Gloo only: MPI's
        # bootstrap would wait for every rank of the job)
        store = dist.PrefixStore(f"{_bootstrap.store_prefix()}/members", dist_opts.store)
        boot = _bootstrap.EnvBootstrap(
            lambda _: store, dist_opts.group_rank, dist_opts.group_size,
            mpi_reason=(f"the MCR-DL runtime was started by the members of "
                        f"new_group({ranks}, backend='mcrdl') only (the default group is "
                        f"{dist.get_backend()!r}), on Gloo; call mcrdl_core.init() on every "
                        "rank before making the group to use MPI"))
    rt = core.init(timeout=secs, bootstrap=boot)
    if boot is not None and ranks:
        _MEMBERS_ONLY.update(runtime=rt, ranks=list(ranks))
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
        group = rt.new_group(_core_ranks(rt, ranks), name=str(dist_opts.group_id),
                             key=f"torch:{dist_opts.group_id}")
    return with_cpu_backend(McrdlProcessGroup(group, backend_options, timeout))


#: the runtime started by a members-only subgroup and the torch ranks of its world
_MEMBERS_ONLY: dict = {}


def _core_ranks(rt, ranks: list) -> list:
    """The core ranks of torch's global ``ranks``: the same, except in a runtime started
    by the members of a subgroup (its world is those members, in torch's order)."""
    if _MEMBERS_ONLY.get("runtime") is not rt:
        return ranks
    world = _MEMBERS_ONLY["ranks"]
    outside = [r for r in ranks if r not in world]
    if outside:
        raise InvalidArgumentError(
            f"new_group({ranks}, backend='mcrdl'): the MCR-DL runtime of this process was "
            f"started by the members of an earlier mcrdl group ({world}) only, and ranks "
            f"{outside} are outside it; call mcrdl_core.init() on every rank (after "
            "init_process_group) before making any mcrdl subgroup, or make 'mcrdl' the "
            "default backend")
    return [world.index(r) for r in ranks]


def with_cpu_backend(pg: "McrdlProcessGroup") -> "McrdlProcessGroup":
    """Register the group's Gloo process group as ``pg``'s per-device backend for CPU.

    torch 2.13 cannot construct a ``c10d::Backend`` subclass from Python (its binding has
    no constructor), so MCR-DL's own calls stay on ``pg`` (the ProcessGroup subclass,
    whose methods torch calls); torch code that asks for a per-device backend instead
    (``pg._get_backend(cpu)``, ``_get_pg_default_device``, ``checkpoint.async_save``)
    gets the real ``ProcessGroupGloo`` over the same ranks, which the core keeps for the
    group anyway. Made while every member is in the call that makes the group."""
    g = pg.mcrdl_group
    gloo = core.get_runtime().backend("gloo").comm(g)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


def register() -> None:
    """Register "mcrdl" with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                  devices=["cpu", "cuda"])
