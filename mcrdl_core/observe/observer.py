"""Observers: what watches calls without changing them (torchcomms' pre and post hooks,
DeepSpeed's timed ops). The debug checks are one (``observe/debug.py``); a user's own
(a tracer, a counter) is another, added with ``Runtime.watch``.

``before`` sees each collective about to run, on every rank, after its arguments were
checked and its backend selected and before anything is sent, with the call's
signature: ``reduce_op``, ``root`` (group rank), ``count`` (elements per rank),
``counts`` (an all-to-all's split counts), and where the caller knows them ``shape``,
``role_name`` and ``compression`` (a compressed call's spec). It may raise to refuse the
call; the debug checks raise the same MismatchError on every rank. ``after`` sees each
work the general path issued, with the bytes the call moves (nccl-tests' size).

While a runtime has an observer, every call takes the general path: the fast path
(``dispatch/fastpath.py``) calls none. The comm logger is not an observer: it records
from inside the fast path, which costs it well under a microsecond a call.
"""
from __future__ import annotations


class Observer:
    """Base class: both hooks do nothing by default."""

    def before(self, rt, group, op, backend, buf, **signature) -> None:
        """A collective ``op`` on ``group``, about to run on ``backend`` (a Backend
        instance) with ``buf`` (a Buffer; metadata only for a traced JAX call)."""

    def after(self, rt, work, nbytes: int) -> None:
        """``work`` was just issued (not yet complete; add a finalizer to see its end)."""
