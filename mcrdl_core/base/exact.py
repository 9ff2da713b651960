"""``exact()``: a scope in which no lossy codec applies (docs/compression.md, "Exact
unless asked").

A lossy codec (``MCRDL_COMPRESSION=all_gather=int8``, ``compression="fp8"``) is what a
training step may want and never what a user saves: a checkpoint, a full state dict or
a ``DTensor.full_tensor()`` must hold the parameters' own values. Inside ``with
mcrdl_core.exact():`` every call of this thread runs without any codec -- the
environment's and an explicit ``compression=`` alike -- so its result is what the
plain collective gives. The torch frontend enters it by itself around
``torch.distributed.checkpoint`` saves and loads, the ``state_dict`` helpers and
``DTensor.full_tensor`` (``mcrdl_torch.exact``, docs/torch_backend.md).

The scope is per thread (a checkpoint thread does not make the training thread's
calls exact) and nests. Like every input of a call's selection it must be the same on
every rank of the group: enter it on every rank around the same calls (a checkpoint
save is collective anyway). The codec choice reads it through :func:`active`
(``dispatch.pipeline.compression_for``).
"""
from __future__ import annotations

import contextlib
import threading

_local = threading.local()


def active() -> bool:
    """True inside an ``exact()`` scope on this thread."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def exact():
    """Run the calls of the ``with`` body (this thread) with no lossy codec, whatever
    ``MCRDL_COMPRESSION`` or ``compression=`` say. Also a decorator
    (``@mcrdl_core.exact()``)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
