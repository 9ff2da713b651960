"""Differentiation and vmap for mcrdl_jax's ops on traced values.

Convention. A multi-process program is one function of every rank's inputs to every
rank's outputs, and the quantity differentiated is the *sum over ranks* of what each
rank differentiates. So the cotangent of an input gathers the cotangents of every
output it reached, on whichever rank they are:

=================  ===========================================================
forward            backward (the cotangent travels back)
=================  ===========================================================
all_reduce SUM     all_reduce SUM of the cotangent (AVG: then divide by n)
reduce SUM/AVG     broadcast from the root
broadcast          reduce SUM to the root (zeros elsewhere)
all_gather         reduce_scatter SUM
reduce_scatter     all_gather (SUM; AVG divides by n)
all_to_all         all_to_all with the splits swapped
gather             scatter from the root
scatter            gather to the root (zeros elsewhere)
send(x, dst)       recv from dst into x's cotangent
recv(like, src)    send the cotangent to src
sendrecv           sendrecv with source and dest swapped
=================  ===========================================================

This is the convention of ``torch.distributed.nn`` and of JAX's ``psum`` under
``pmap``. mpi4jax differs for all-reduce (its transpose is the identity, treating
the result as one replicated value): differentiate each rank's own share of a loss,
not an all-reduced copy of it, or divide by the group size. Other reduce ops (MAX,
MIN, PRODUCT, bitwise) and recv from any source are not differentiable: a clear error
when the gradient is asked for, before anything is sent.

JAX differentiates only what the output depends on, so a rank takes part in a backward
communication only if its forward call lies between a differentiated input and the
output. Two rules follow for point-to-point, since the pair must meet:

- ``send`` returns a token (a float32 zero): make it part of what you differentiate
  (``return loss + tok``), or the sender never waits for the cotangent;
- ``recv``'s cotangent goes back only if ``like`` depends on a differentiated input
  (pass the stage input you differentiate; see bench/apps/jax_pipeline.py).
``sendrecv`` and the collectives need nothing more than every rank differentiating the
same program.

vmap: every op maps, as B independent calls made as one call on the batch. Ops that
split the leading axis (reduce_scatter, all_to_all, scatter) and ops that stack a new
leading axis (all_gather, gather) move the batch axis out of the way and back. Under
vmap, ``recv``'s ``like`` must be batched like the sender's array.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from mcrdl_core.observe import debug as _debug
from mcrdl_core.base.errors import UnsupportedError
from mcrdl_core.base.ops import ReduceOp

from . import eager, gpu, lowering
from .compat import trace_state_clean

_trace_state_clean = trace_state_clean()

# where the batch axis goes in the first array so that the op sees its own axis first
_IN_AXIS = {"reduce_scatter": 1, "all_to_all": 1, "scatter": 1}


def concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def run(name, arrays, statics):
    """The op on concrete arrays outside any trace (eager, after ``eager.ready``: the
    placement check and the wait for in-flight jitted communication), else on traced
    ones (the jit lowering, mappable). Derivative rules run eagerly under an eager
    ``jax.grad``, and the vmap rule under an eager ``jax.vmap``: both come here."""
    if concrete(*arrays) and _trace_state_clean():
        return getattr(gpu if eager.ready(*arrays) else eager, name)(*arrays, *statics)
    return _mappable(name, list(arrays), statics)


def _mappable(name, arrays, statics):
    fn = getattr(lowering, name)
    in_axis = _IN_AXIS.get(name, 0)

    @custom_vmap
    def call(*arrs):
        return fn(*arrs, *statics)

    @call.def_vmap
    def rule(axis_size, in_batched, *arrs):
        arrs = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, b in zip(arrs, in_batched)]
        first = jnp.moveaxis(arrs[0], 0, in_axis)
        # concrete arrays (an eager vmap) run eagerly: building a new mappable for them
        # would compile a new program on every call; nested vmaps nest here
        out = run(name, [first, *arrs[1:]], statics)
        if name == "send":
            return out, False  # the token is one scalar
        if name in ("all_gather", "gather"):  # a new leading axis where one was stacked
            out_axis = 1 if out.ndim > first.ndim else 0
        else:
            out_axis = 0 if name == "scatter" else in_axis
        return jnp.moveaxis(out, out_axis, 0), True

    return call(*arrays)


def _rank(group):
    import mcrdl_core as _core

    return _core.get_rank(), _core.get_runtime().group(group)


def _linear(op, name):
    op = ReduceOp.coerce(op)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise UnsupportedError(f"mcrdl_jax.{name}: only SUM and AVG are differentiable, not "
                               f"{op.name}; wrap the call in jax.lax.stop_gradient if no "
                               "gradient should flow through it")
    return op


def _scale(ct, op, group):
    return ct / _rank(group)[1].size if op is ReduceOp.AVG else ct


def _vjp(name, n_arrays, n_statics, check, bwd):
    """A custom_vjp op: ``check(*statics)`` runs when a gradient is asked for (before
    anything is sent); ``bwd(statics, residual_arrays, ct)`` returns the cotangents.

    Both rules are written with the differentiable ops themselves (the forward rule
    calls the op, the backward rule calls the ops of the table above), so that the
    derivative can be differentiated again (Hessian-vector products, reverse over
    reverse). The backward rule's calls carry the debug role "backward of <op>"."""
    statics_at = tuple(range(n_arrays, n_arrays + n_statics))
    role = f"backward of {name}"
    _debug.declare_role(role)

    def primal(*args):
        return run(name, args[:n_arrays], args[n_arrays:])

    f = jax.custom_vjp(primal, nondiff_argnums=statics_at)

    def fwd(*args):
        check(*args[n_arrays:])
        return f(*args), tuple(args[:n_arrays])

    def back(*args):
        *statics, res, ct = args
        with _debug.role(role):
            return tuple(bwd(statics, res, ct))

    f.defvjp(fwd, back)
    return f


def _none(*statics):
    return None


def _zero_after(zeros, used):
    """``zeros``, made to depend on ``used`` (the output of a call this rank made in a
    backward rule and does not need): a second derivative then reaches that call on
    this rank too, as it does on the ranks that use its output, and the ranks meet."""
    return zeros + 0 * used


# --- the ops ------------------------------------------------------------------------------
def _all_reduce_bwd(st, res, ct):
    op, group, backend, compression = st
    return [all_reduce(ct, op, group, backend, compression)]


all_reduce = _vjp("all_reduce", 1, 4, lambda op, g, b, c: _linear(op, "all_reduce"),
                  _all_reduce_bwd)


def _reduce_bwd(st, res, ct):
    dst, op, group, backend = st
    from_root = _scale(broadcast(ct, dst, group, backend), ReduceOp.coerce(op), group)
    me, _ = _rank(group)
    return [from_root if me == dst else ct + from_root]


reduce = _vjp("reduce", 1, 4, lambda dst, op, g, b: _linear(op, "reduce"), _reduce_bwd)


def _broadcast_bwd(st, res, ct):
    src, group, backend = st
    total = reduce(ct, src, ReduceOp.SUM, group, backend)
    return [total if _rank(group)[0] == src else _zero_after(jnp.zeros_like(ct), total)]


broadcast = _vjp("broadcast", 1, 3, _none, _broadcast_bwd)


# a compressed op's derivative uses the same codec (a compressed all-gather's backward
# is a compressed reduce-scatter, as ZeRO++ pairs qwZ with qgZ)
def _all_gather_bwd(st, res, ct):
    group, backend, compression = st
    (x,) = res
    return [reduce_scatter(ct, ReduceOp.SUM, group, backend, compression).reshape(x.shape)]


all_gather = _vjp("all_gather", 1, 3, _none, _all_gather_bwd)


def _reduce_scatter_bwd(st, res, ct):
    op, group, backend, compression = st
    (x,) = res
    full = all_gather(ct, group, backend, compression).reshape(x.shape)
    return [_scale(full, ReduceOp.coerce(op), group)]


reduce_scatter = _vjp("reduce_scatter", 1, 4,
                      lambda op, g, b, c: _linear(op, "reduce_scatter"), _reduce_scatter_bwd)


def _all_to_all_bwd(st, res, ct):
    group, backend, in_splits, out_splits, compression = st
    (x,) = res
    if in_splits or out_splits:
        # a missing list means "even split of x" in the forward call; in the backward
        # call it would mean "even split of the cotangent", which is not the same when
        # the other list is uneven: make both explicit before swapping them
        n = _rank(group)[1].size
        even = (x.shape[0] // n,) * n
        in_splits, out_splits = in_splits or even, out_splits or even
    return [all_to_all(ct, group, backend, out_splits, in_splits, compression)]


all_to_all = _vjp("all_to_all", 1, 5, _none, _all_to_all_bwd)


def _gather_bwd(st, res, ct):
    dst, group, backend = st
    (x,) = res
    me, g = _rank(group)
    if me == dst:
        return [scatter(ct, dst, group, backend)]
    # off the root the output was the input itself; the scatter still needs this rank
    block = scatter(jnp.zeros((g.size, *x.shape), ct.dtype), dst, group, backend)
    return [ct + block]


gather = _vjp("gather", 1, 3, _none, _gather_bwd)


def _scatter_bwd(st, res, ct):
    src, group, backend = st
    (x,) = res
    stacked = gather(ct, src, group, backend)
    return [stacked if _rank(group)[0] == src else _zero_after(jnp.zeros_like(x), stacked)]


scatter = _vjp("scatter", 1, 3, _none, _scatter_bwd)


def _send_bwd(st, res, ct):
    dst, group, tag, backend = st
    (x,) = res
    return [recv(x, dst, group, tag, backend)]


send = _vjp("send", 1, 4, _none, _send_bwd)


def _recv_check(src, group, tag, backend):
    if src is None:
        raise UnsupportedError("mcrdl_jax.recv: a recv from any source is not differentiable "
                               "(the cotangent would not know where to go); name the source")


def _recv_bwd(st, res, ct):
    src, group, tag, backend = st
    token = send(ct, src, group, tag, backend)
    # the token joins the (zero) cotangent of ``like``, as the send rule asks of every
    # objective, so that a second derivative reaches this send too
    return [_zero_after(jnp.zeros_like(ct), token.astype(ct.dtype))]


recv = _vjp("recv", 1, 4, _recv_check, _recv_bwd)


def _sendrecv_bwd(st, res, ct):
    source, dest, group, tag, backend = st
    sendbuf, _ = res
    back = sendrecv(ct, sendbuf, dest, source, group, tag, backend)
    return [back, jnp.zeros_like(ct)]


sendrecv = _vjp("sendrecv", 2, 5, _none, _sendrecv_bwd)


# the derivative of each op as a (backward rule, check) pair: the split-phase calls of
# nonblocking.py differentiate through the same rules as the blocking ones
RULES = {
    "all_reduce": (_all_reduce_bwd, lambda op, g, b, c: _linear(op, "all_reduce")),
    "reduce": (_reduce_bwd, lambda dst, op, g, b: _linear(op, "reduce")),
    "broadcast": (_broadcast_bwd, _none),
    "all_gather": (_all_gather_bwd, _none),
    "reduce_scatter": (_reduce_scatter_bwd, lambda op, g, b, c: _linear(op, "reduce_scatter")),
    "all_to_all": (_all_to_all_bwd, _none),
    "gather": (_gather_bwd, _none),
    "scatter": (_scatter_bwd, _none),
    "send": (_send_bwd, _none),
    "recv": (_recv_bwd, _recv_check),
    "sendrecv": (_sendrecv_bwd, _none),
}
