"""An XLA host callback that calls the core from inside a jitted program.

Under ``jax.jit``, calls that do not lower to mpi4jax (Gloo, uneven all-to-all, recv
from any source, and any backend a future module adds) become one ``mcrdl_host_call``
primitive: XLA calls back into Python with the operands as host arrays, the callback
runs the eager path of the core, and its results go back into the program.

Ordering: the primitive carries the *same* ordered effect as mpi4jax's primitives, so
JAX threads one token through every communication call of a jitted function, MPI and
host callbacks alike. Calls therefore run in program order on every rank, whatever
XLA's scheduler would otherwise do with two calls that share no data. (``jax's`` own
``io_callback`` has an ordered effect of its own, which XLA may reorder against
mpi4jax's: that is why this module has its own primitive.)

This uses JAX internals (``jax._src``), as mpi4jax does; ``compat.py`` checks them at
import against the versions the project supports and tests.
"""
from __future__ import annotations

import numpy as np

from .compat import check_internals, mpi4jax_effect

check_internals()  # a clear error naming the supported versions, before any jax._src use

from jax._src import core as jcore  # noqa: E402
from jax._src import dispatch, effects  # noqa: E402
from jax._src.callback import emit_python_callback  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402


class _CommEffect(effects.Effect):
    """mcrdl_jax's own ordered effect, used only when mpi4jax's cannot be shared (then
    nothing lowers to mpi4jax: see compat.py)."""
    __str__ = lambda self: "mcrdl-comm"  # noqa: E731


MPI4JAX, EFFECT = mpi4jax_effect()  # share mpi4jax's token: MPI and callbacks in one chain
if EFFECT is None:
    EFFECT = _CommEffect()
    for _kind in (effects.lowerable_effects, effects.ordered_effects,
                  effects.control_flow_allowed_effects,
                  effects.custom_derivatives_allowed_effects):
        _kind.add_type(_CommEffect)
# jax.checkpoint (remat) around a communicating layer: JAX never replays an effectful
# equation in the backward pass; it runs it once, in the forward pass, and keeps its
# outputs as residuals (partial_eval_jaxpr_custom). So no rank re-issues a collective
# that another rank would not, and the mpi4jax effect can be allowed there too.
effects.remat_allowed_effects.add_type(type(EFFECT))


class HostCall:
    """The static part of one callback: a function of host arrays returning a tuple of
    host arrays shaped like ``out_avals``. Hashed by identity (one per traced call)."""

    def __init__(self, fn, out_avals, what: str):
        self.fn = fn
        self.out_avals = tuple(out_avals)
        self.what = what

    def __call__(self, *args):
        outs = self.fn(*[np.asarray(a) for a in args])
        return tuple(np.asarray(o, dtype=a.dtype).reshape(a.shape)
                     for o, a in zip(outs, self.out_avals))

    def __repr__(self):
        return f"HostCall({self.what})"


host_call_p = jcore.Primitive("mcrdl_host_call")
host_call_p.multiple_results = True
host_call_p.def_impl(lambda *args, call: dispatch.apply_primitive(host_call_p, *args, call=call))
dispatch.prim_requires_devices_during_lowering.add(host_call_p)


@host_call_p.def_effectful_abstract_eval
def _abstract(*avals, call):
    return list(call.out_avals), {EFFECT}


def _lowering(ctx, *args, call):
    token = ctx.tokens_in.get(EFFECT)
    results, token, _ = emit_python_callback(
        ctx, call, token, list(args), ctx.avals_in, ctx.avals_out,
        has_side_effect=True, returns_token=True)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: token})))
    return results


mlir.register_lowering(host_call_p, _lowering, cacheable=False)


def host_call(fn, out_shapes, *args, what: str = "call"):
    """Run ``fn(*host_arrays)`` inside the jitted program, in comm order; ``out_shapes``
    are ``jax.ShapeDtypeStruct``-likes for its results. Returns a list of arrays."""
    avals = [jcore.ShapedArray(tuple(s.shape), np.dtype(s.dtype)) for s in out_shapes]
    return host_call_p.bind(*args, call=HostCall(fn, avals, what))
