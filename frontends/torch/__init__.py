"""mcrdl_torch: torch.distributed's functions, run by MCR-DL on the best backend per call.

Replace ``import torch.distributed as dist`` by ``import mcrdl_torch as dist``: the
names, signatures and semantics are torch.distributed's (``src``/``dst`` are global
ranks; collectives are in place; ``async_op=True`` returns a Work with ``wait()`` and
``is_completed()``), and every call also takes ``backend=`` ("mpi", "gloo", "nccl",
"auto" or None). Where this frontend differs from torch.distributed:

- ``init_process_group`` is optional: the first call initializes from the launcher
  (mpiexec or torchrun); ``init_method``/``store`` are not needed and are ignored.
- ``new_group(ranks, backend=...)`` sets the default backend for calls on the group;
  ``init_process_group(backend=...)`` does the same for the world. The group keeps the
  ranks in the order given (group rank i is ``ranks[i]``, torch's ``sort_ranks=False``)
  unless ``sort_ranks=True``; torch sorts them by default.
- ``barrier()`` completes after the group's earlier collectives (not its pending
  point-to-point work), as torch's Gloo barrier does.
- non-contiguous *input* tensors are copied to contiguous ones instead of refused;
  outputs must be contiguous, as in torch.
- ``gather_list``/``scatter_list`` on non-root ranks are ignored instead of refused.
- ``compression=`` on all_reduce, all_gather(_into_tensor), reduce_scatter(_tensor) and
  all_to_all(_single) allows a lossy codec ("int8", "fp16@a2a", "fp8", ...;
  docs/compression.md); off by default. Inside ``with mcrdl_torch.exact():`` no codec
  applies; torch.distributed.checkpoint saves and loads, the state-dict helpers and
  ``DTensor.full_tensor`` enter it by themselves (``exact.py``).
"""
from __future__ import annotations

import mcrdl_core as _core
from mcrdl_core import Group, ReduceOp, Work  # noqa: F401  (public names)
from mcrdl_core.base.errors import InvalidArgumentError

from mcrdl_core.dispatch import fastpath as _fp
from mcrdl_core.dispatch.runtime import get_runtime as _rt

from .exact import exact, install as _install_exact
from .facts import many as _many, one as _one, two as _two
from .tensors import MISS as _MISS
from .tensors import DTYPES as _DTYPES
from .tensors import PLAIN as _PLAIN
from .tensors import to_buffer as _b
from .tensors import to_buffers as _bs

GroupMember = Group
_install_exact()


def _seconds(timeout) -> float | None:
    """A ``timeout=`` (timedelta or seconds) in seconds; None stays None."""
    if timeout is None:
        return None
    secs = float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout)
    if not secs > 0:
        raise InvalidArgumentError(f"timeout={timeout!r}: give a positive duration "
                                   "(seconds or a datetime.timedelta)")
    return secs


def init_process_group(backend: str | None = None, init_method=None, timeout=None,
                       world_size: int = -1, rank: int = -1, store=None, **_ignored) -> None:
    """Initialize MCR-DL (idempotent). ``backend`` becomes the world's default backend;
    ``timeout`` (timedelta or seconds) bounds every wait that names no timeout of its
    own, as ``MCRDL_TIMEOUT`` does. Both apply also where the runtime already exists (an
    earlier call, or an implicit start: ``get_rank()`` first); a group's own timeout
    (``new_group(timeout=)``) still wins on that group."""
    timeout = _seconds(timeout)
    rt = _core.init(timeout=timeout)
    if timeout is not None:  # (a runtime made before this call kept its own)
        rt.engine.timeout = timeout
    for name, given, actual in (("world_size", world_size, rt.world_size), ("rank", rank, rt.rank)):
        if given not in (-1, None) and given != actual:
            raise InvalidArgumentError(f"init_process_group: {name}={given} but the launcher "
                                       f"says {actual}; drop the argument or fix the launch")
    if backend not in (None, "auto") and "gloo" in str(backend) and "nccl" in str(backend):
        backend = None  # torch's "cpu:gloo,cuda:nccl": let the policy choose by device
    backend = None if backend in (None, "auto") else str(backend)
    if rt.world.backend != backend:  # the memo's plans chose under the old default
        rt.world.backend = backend
        rt.choices.clear()


def is_initialized() -> bool:
    return _core.is_initialized()


def destroy_process_group(group=None) -> None:
    if group is None:
        _core.destroy()


def get_rank(group=None) -> int:
    return _core.get_rank(group)


def get_world_size(group=None) -> int:
    return _core.get_world_size(group)


def get_global_rank(group, group_rank: int) -> int:
    return (group or _core.get_runtime().world).global_rank(group_rank)


def get_group_rank(group, global_rank: int) -> int:
    return (group or _core.get_runtime().world).group_rank(global_rank)


def new_group(ranks=None, timeout=None, backend: str | None = None, pg_options=None,
              sort_ranks: bool = False, **_ignored) -> Group:
    """Collective over the world, like torch's: every rank calls it with the same ranks.
    Group rank i is ``ranks[i]`` (torch's ``sort_ranks=False``); ``sort_ranks=True``
    sorts them first, as torch does by default. ``timeout`` (timedelta or seconds): the
    group's own, for every wait on its calls that names none (``Group.timeout``; else
    the runtime's, ``MCRDL_TIMEOUT``), on every backend."""
    timeout = _seconds(timeout)
    if ranks is not None and sort_ranks:
        ranks = sorted(ranks)
    g = _core.new_group(ranks, backend=None if backend in (None, "auto") else backend)
    if timeout is not None:
        g.timeout = timeout
    return g


def available_backends() -> dict:
    return _core.available_backends()


# --- point to point ------------------------------------------------------------------------
# Each call on plain contiguous CPU tensors first tries the call bound to its arguments
# (``_K_*`` keys in the runtime's memo: the core's bound calls, mcrdl_core/dispatch/
# fastpath.py), then the core's fast path on the tensors' facts (address, elements, core
# dtype: no Buffer is made), which binds the key; a MISS of both takes the general path,
# which checks everything, raises its errors and fills the memo.
_K_SEND, _K_RECV, _K_BCAST, _K_REDUCE, _K_AR, _K_AG, _K_RS, _K_A2A, _K_A2AV, _K_BARRIER = (
    f"bound:torch.{name}" for name in ("send", "recv", "broadcast", "reduce", "all_reduce",
                                       "all_gather_into_tensor", "reduce_scatter_tensor",
                                       "all_to_all_single", "all_to_all_single_v", "barrier"))
_K_AGL, _K_RSL, _K_A2AL, _K_GATHER, _K_SCATTER = (
    f"bound:torch.{name}" for name in ("all_gather", "reduce_scatter", "all_to_all", "gather",
                                       "scatter"))


def _p2p(fast, general, kind, tensor, peer, group, tag, async_op, backend):
    if type(tensor) in _PLAIN and (facts := _one(tensor)) is not None:
        ptr, count = facts
        rt = _rt()
        key = (kind, dt := tensor.dtype, peer, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(ptr, count, tag, tensor)
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = fast(rt, ptr, count, dtype, tensor, peer, tag, group, async_op, backend, None,
                        key)
            if done is not _MISS:
                return done
    return general(_b(tensor), peer, group, tag, async_op, backend)


def send(tensor, dst: int, group=None, tag: int = 0, backend=None) -> None:
    _p2p(_fp.send, _core.send, _K_SEND, tensor, dst, group, tag, False, backend)


def recv(tensor, src: int | None = None, group=None, tag: int = 0, backend=None) -> int:
    return _p2p(_fp.recv, _core.recv, _K_RECV, tensor, src, group, tag, False, backend)


def isend(tensor, dst: int, group=None, tag: int = 0, backend=None) -> Work:
    return _p2p(_fp.send, _core.send, _K_SEND, tensor, dst, group, tag, True, backend)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, backend=None) -> Work:
    return _p2p(_fp.recv, _core.recv, _K_RECV, tensor, src, group, tag, True, backend)


# --- collectives ---------------------------------------------------------------------------
def broadcast(tensor, src: int = 0, group=None, async_op: bool = False, backend=None):
    if type(tensor) in _PLAIN and (facts := _one(tensor)) is not None:
        ptr, count = facts
        rt = _rt()
        key = (_K_BCAST, dt := tensor.dtype, src, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(ptr, count, tensor)
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.broadcast(rt, ptr, count, dtype, tensor, src, group, async_op, backend,
                                 None, key)
            if done is not _MISS:
                return done
    return _core.broadcast(_b(tensor), src, group, async_op, backend)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, backend=None,
               compression=None):
    if compression is None and type(tensor) in _PLAIN and (facts := _one(tensor)) is not None:
        ptr, count = facts
        rt = _rt()
        key = (_K_AR, dt := tensor.dtype, op, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(ptr, count, tensor)
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.host_all_reduce(rt, ptr, count, dtype, tensor, op, group, async_op,
                                       backend, None, key)
            if done is not _MISS:
                return done
    return _core.all_reduce(_b(tensor), op, group, async_op, backend, compression)


def reduce(tensor, dst: int = 0, op=ReduceOp.SUM, group=None, async_op: bool = False,
           backend=None):
    if type(tensor) in _PLAIN and (facts := _one(tensor)) is not None:
        ptr, count = facts
        rt = _rt()
        key = (_K_REDUCE, dt := tensor.dtype, dst, op, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(ptr, count, tensor)
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.reduce(rt, ptr, count, dtype, tensor, dst, op, group, async_op, backend,
                              None, key)
            if done is not _MISS:
                return done
    return _core.reduce(_b(tensor), dst, op, group, async_op, backend)


def _listed(fast, kind, lf, ptr, count, like, extra, owners, group, async_op, backend):
    """A list form's bound call or fast entry (``fast(rt, lf, ptr, count, dtype, owners,
    *extra, group, async_op, backend, None, key)``), or MISS: ``lf`` the list facts,
    ``ptr``/``count`` the one tensor's (all_to_all: ``ptr`` the input's list facts)."""
    rt = _rt()
    key = (kind, dt := like.dtype, *extra, group, backend, async_op)
    try:
        bound = rt.choices.get(key)
    except TypeError:  # an unhashable argument: the general path judges it
        bound = key = None
    if bound is not None:
        done = bound(lf, ptr, count, owners)
        if done is not _MISS:
            return done
    dtype = _DTYPES.get(dt)
    if dtype is None:
        return _MISS
    if fast is _fp.all_to_all_list:
        return fast(rt, lf, ptr, dtype, owners, group, async_op, backend, None, key)
    return fast(rt, lf, ptr, count, dtype, owners, *extra, group, async_op, backend, None, key)


def _root_list(ts, like, writes):
    """The list facts of a gather's (``writes``) or scatter's list, None where none is
    given, or False where it is not plain tensors of ``like``'s dtype (the general path
    judges)."""
    if ts is None:
        return None
    return _many(ts, like, _PLAIN, writes) or False


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, backend=None,
               compression=None):
    if compression is None and type(tensor) in _PLAIN and (f := _one(tensor)) is not None \
            and (lf := _many(tensor_list, tensor, _PLAIN, True)) is not None:
        done = _listed(_fp.all_gather_list, _K_AGL, lf, f[0], f[1], tensor, (),
                       (tuple(tensor_list), tensor), group, async_op, backend)
        if done is not _MISS:
            return done
    return _core.all_gather(_bs(tensor_list, "tensor_list"), _b(tensor), group, async_op, backend,
                            compression)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False,
                           backend=None, compression=None):
    out, inp = output_tensor, input_tensor
    if compression is None and type(out) in _PLAIN and type(inp) in _PLAIN \
            and (facts := _two(out, inp)) is not None:
        out_ptr, out_count, _, in_ptr, in_count, _ = facts
        rt = _rt()
        key = (_K_AG, dt := inp.dtype, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(out_ptr, out_count, in_ptr, in_count, (out, inp))
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.all_gather(rt, out_ptr, out_count, in_ptr, in_count, dtype, (out, inp),
                                  group, async_op, backend, None, key)
            if done is not _MISS:
                return done
    return _core.all_gather_into_tensor(_b(output_tensor), _b(input_tensor), group, async_op,
                                        backend, compression)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   backend=None, compression=None):
    if compression is None and type(output) in _PLAIN and (f := _one(output)) is not None \
            and (lf := _many(input_list, output, _PLAIN, False)) is not None:
        done = _listed(_fp.reduce_scatter_list, _K_RSL, lf, f[0], f[1], output, (op,),
                       (output, tuple(input_list)), group, async_op, backend)
        if done is not _MISS:
            return done
    return _core.reduce_scatter(_b(output), _bs(input_list, "input_list"), op, group, async_op,
                                backend, compression)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False,
                          backend=None, compression=None):
    if compression is None and type(output) in _PLAIN and type(input) in _PLAIN \
            and (facts := _two(output, input)) is not None:
        out_ptr, out_count, _, in_ptr, in_count, _ = facts
        rt = _rt()
        key = (_K_RS, dt := input.dtype, op, group, backend, async_op)
        try:
            bound = rt.choices.get(key)
        except TypeError:  # an unhashable argument: the general path judges it
            bound = key = None
        if bound is not None:
            done = bound(out_ptr, out_count, in_ptr, in_count, (output, input))
            if done is not _MISS:
                return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.reduce_scatter(rt, out_ptr, out_count, in_ptr, in_count, dtype,
                                      (output, input), op, group, async_op, backend, None, key)
            if done is not _MISS:
                return done
    return _core.reduce_scatter_tensor(_b(output), _b(input), op, group, async_op, backend,
                                       compression)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, backend=None, compression=None):
    if compression is None and type(output) in _PLAIN and type(input) in _PLAIN \
            and (facts := _two(output, input)) is not None:
        out_ptr, oc, orows, in_ptr, ic, irows = facts
        rt = _rt()
        dt = input.dtype
        if not output_split_sizes and not input_split_sizes:  # even (as the core judges)
            key = (_K_A2A, dt, group, backend, async_op)
            try:
                bound = rt.choices.get(key)
            except TypeError:  # an unhashable argument: the general path judges it
                bound = key = None
            if bound is not None:
                done = bound(out_ptr, oc, orows, in_ptr, ic, irows, (output, input))
                if done is not _MISS:
                    return done
        else:
            key = (_K_A2AV, dt, group, backend, async_op)
            try:
                bound = rt.choices.get(key)
            except TypeError:  # an unhashable argument: the general path judges it
                bound = key = None
            if bound is not None:
                done = bound(out_ptr, oc, orows, in_ptr, ic, irows, output_split_sizes or None,
                             input_split_sizes or None, (output, input))
                if done is not _MISS:
                    return done
        dtype = _DTYPES.get(dt)
        if dtype is not None:
            done = _fp.all_to_all(rt, out_ptr, oc, orows, in_ptr, ic, irows, dtype,
                                  (output, input), output_split_sizes, input_split_sizes, group,
                                  async_op, backend, None, key)
            if done is not _MISS:
                return done
    return _core.all_to_all_single(_b(output), _b(input), output_split_sizes, input_split_sizes,
                                   group, async_op, backend, compression)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False,
               backend=None, compression=None):
    ins = input_tensor_list
    if compression is None and type(ins) in (list, tuple) and ins and type(ins[0]) in _PLAIN \
            and (olf := _many(output_tensor_list, ins[0], _PLAIN, True)) is not None \
            and (ilf := _many(ins, ins[0], _PLAIN, False)) is not None:
        done = _listed(_fp.all_to_all_list, _K_A2AL, olf, ilf, 0, ins[0], (),
                       (tuple(output_tensor_list), tuple(ins)), group, async_op, backend)
        if done is not _MISS:
            return done
    return _core.all_to_all(_bs(output_tensor_list, "output_tensor_list"),
                            _bs(input_tensor_list, "input_tensor_list"), group, async_op, backend,
                            compression)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False,
           backend=None):
    if type(tensor) in _PLAIN and (f := _one(tensor)) is not None \
            and (lf := _root_list(gather_list, tensor, True)) is not False:
        done = _listed(_fp.gather, _K_GATHER, lf, f[0], f[1], tensor, (dst,),
                       (tensor, gather_list and tuple(gather_list)), group, async_op, backend)
        if done is not _MISS:
            return done
    return _core.gather(_b(tensor), _bs(gather_list, "gather_list"), dst, group, async_op, backend)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False,
            backend=None):
    if type(tensor) in _PLAIN and (f := _one(tensor)) is not None \
            and (lf := _root_list(scatter_list, tensor, False)) is not False:
        done = _listed(_fp.scatter, _K_SCATTER, lf, f[0], f[1], tensor, (src,),
                       (tensor, scatter_list and tuple(scatter_list)), group, async_op, backend)
        if done is not _MISS:
            return done
    return _core.scatter(_b(tensor), _bs(scatter_list, "scatter_list"), src, group, async_op,
                         backend)


P2POp = _core.P2POp


def batch_isend_irecv(p2p_op_list, backend=None) -> list:
    """torch.distributed's ``batch_isend_irecv`` (``mcrdl_core.batch_isend_irecv``):
    one Work per op. Where every op is a ``P2POp`` of a plain contiguous CPU tensor on
    one group, the ops go to the core's fast path on their tensors' facts
    (``fastpath.batch_ops``, which reads them in one loop); otherwise, or where it steps
    aside, to the core's call."""
    ops = p2p_op_list
    if type(ops) is list and ops and type(ops[0]) is P2POp:
        done = _fp.batch_ops(_rt(), ops, backend, _one, _DTYPES, _PLAIN)
        if done is not _MISS:
            return done
    return _core.batch_isend_irecv(p2p_op_list, backend)


def barrier(group=None, async_op: bool = False, device_ids=None, backend=None):
    rt = _rt()
    key = (_K_BARRIER, group, backend, async_op)
    try:
        bound = rt.choices.get(key)
    except TypeError:  # an unhashable argument: the general path judges it
        bound = key = None
    if bound is not None:
        done = bound()
        if done is not _MISS:
            return done
    done = _fp.barrier(rt, group, async_op, backend, None, key)
    if done is not _MISS:
        return done
    return _core.barrier(group, async_op, backend)


from .resharding import layout as reshard_layout, reshard  # noqa: E402  (docs/resharding.md)
