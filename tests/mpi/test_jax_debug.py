"""MCRDL_DEBUG=1 and rank-dependent objectives under jax.grad: when rank 0's objective
uses an all_reduce output and the other ranks' do not, JAX skips the backward
all_reduce on those ranks, so rank 0's backward call would meet their next call (wrong
data, then a crash). Debug mode compares each collective's role ("call" or "backward
of all_reduce") across ranks, eagerly and in jitted programs at run time, and raises a
MismatchError on every rank that says what to do; the documented remedy (make every
objective depend on the output) then gives the single-process gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcrdl_core as mc
import mcrdl_jax as mj
from conftest import RANK, SIZE
from mcrdl_core.base.errors import MismatchError

N = 3


@pytest.fixture
def debug_mode():
    rt = mc.get_runtime()
    rt.debug = True
    yield
    rt.debug = False


@pytest.mark.parametrize("backend, mode", [("mpi", "jit"), ("gloo", "eager")])
def test_rank_dependent_objective_is_caught_then_remedied(debug_mode, backend, mode):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    x = jnp.arange(N, dtype=jnp.float32) + RANK

    def uses(x):
        return jnp.sum(jnp.arange(1.0, N + 1) * mj.all_reduce(x, backend=backend))

    def ignores(x):
        y = mj.all_reduce(x, backend=backend)  # noqa: F841  (called, then not used)
        return jnp.sum(x * x)

    def wrap(f):
        return jax.jit(jax.grad(f)) if mode == "jit" else jax.grad(f)

    with pytest.raises(Exception, match="called inconsistently") as info:
        np.asarray(wrap(uses if RANK == 0 else ignores)(x))  # rank 0 raises here
        mj.all_reduce(x, backend=backend)  # in eager mode the other ranks raise here
    assert isinstance(info.value, MismatchError) or mode == "jit", info.value
    msg = str(info.value)
    assert "role" in msg and "'backward of all_reduce'" in msg and "0 * jnp.sum(y)" in msg, msg

    def ignores_but_joins(x):  # the remedy the error message gives
        y = mj.all_reduce(x, backend=backend)
        return jnp.sum(x * x) + 0 * jnp.sum(y)

    g = wrap(uses if RANK == 0 else ignores_but_joins)(x)
    want = np.arange(1.0, N + 1) + (0 if RANK == 0 else 2 * np.asarray(x))
    np.testing.assert_allclose(np.asarray(g), want, err_msg=f"rank {RANK}")
