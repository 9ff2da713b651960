"""MCR-DL core: framework-agnostic buffers, backends, selection and the progress engine.

This package imports neither torch nor jax; cupy is imported only inside functions that
handle CUDA buffers. Frontends (``mcrdl_torch``, ``mcrdl_jax``) convert their tensors
to :class:`Buffer` and call the functions below.
"""
from .base import dtypes
from .dispatch.api import (all_gather, all_gather_into_tensor, all_reduce, all_to_all,
                           all_to_all_single, barrier, broadcast, gather, irecv, isend, recv,
                           reduce, reduce_scatter, reduce_scatter_tensor, scatter, send)
from .world.backend import Backend, register_backend
from .memory.buffer import CPU, Buffer, Device, as_buffer
from .base.errors import (BackendUnavailableError, BrokenGroupError, CommFailedError,
                          CommTimeoutError, DtypeError, InvalidArgumentError, McrdlError,
                          MismatchError, NotInitializedError, TableError, UnsupportedError)
from .world.group import Group
from .base.ops import Op, ReduceOp
from .base.exact import exact  # no lossy codec inside (docs/compression.md)
from .reshard.api import plan_reshard, reshard
from .dispatch.runtime import Runtime, destroy, get_runtime, init, is_initialized
from .dispatch.selection import TuningTable
from .dispatch.p2p import P2POp, batch_isend_irecv
from .tools.stragglers import stale_ranks, stragglers
from .engine.work import CompletedWork, Work
from .observe.observer import Observer
from .observe.recorder import dump as _dump

def dump_trace(path: str | None = None) -> str | None:
    """Write this rank's flight-recorder dump now (``rank-N.json`` in MCRDL_TRACE_DIR,
    default ``$TMPDIR/mcrdl-trace-JOB``, or ``path``); returns its path, None where the
    recorder is off (``MCRDL_TRACE_ENTRIES=0``) or no runtime exists yet. Sends nothing:
    each rank calls it on its own (``mcrdl trace DIR`` reads them together)."""
    return _dump("dump_trace()", path)


__version__ = "0.1.0"


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (world by default); -1 if not a member."""
    rt = get_runtime()
    return rt.rank if group is None else group.rank


def get_world_size(group=None) -> int:
    rt = get_runtime()
    return rt.world_size if group is None else group.size


def new_group(ranks=None, name=None, backend=None, key=None) -> Group:
    """As torch.distributed.new_group: every rank calls it, or the members only; the
    ranks keep the order given. ``backend`` becomes the default of calls on this group;
    ``key``: the group's identity among its members (``Runtime.new_group``)."""
    return get_runtime().new_group(ranks, name, backend, key)


def available_backends() -> dict:
    """{backend name: None if usable here, else the reason it is not}."""
    return get_runtime().available_backends()
