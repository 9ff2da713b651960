"""mcrdl_jax inside JAX transformations, beyond the arguments' types: a concrete array
closed over by a jitted function communicates on every run (not once while tracing);
an eager vmap runs eagerly without compiling per call; eager calls made by derivative
rules under an eager jax.grad wait for in-flight jitted communication like any eager
call. Checked against NumPy on every rank."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcrdl_jax as mj
from conftest import RANK, SIZE

N = 2


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_closed_over_array_communicates_inside_the_program(backend):
    """``x + all_reduce(c)`` with ``c`` closed over, and with a NumPy array made inside
    the function: the all-reduce is part of the jitted program (it was run once while
    tracing and baked in as a constant)."""
    c = jnp.full(N, RANK + 1.0)

    def f(x):
        made_inside = np.full(N, 10.0 * (RANK + 1), np.float32)
        return x + mj.all_reduce(c, backend=backend) + mj.all_reduce(made_inside,
                                                                      backend=backend)

    text = str(jax.make_jaxpr(f)(jnp.zeros(N)))
    calls = text.count("mcrdl_host_call[") + text.count("allreduce_mpi[")
    assert calls == 2, text
    total = sum(r + 1.0 for r in range(SIZE))
    g = jax.jit(f)
    for x in (0.0, 1.0):  # every run communicates (and agrees with NumPy)
        np.testing.assert_allclose(np.asarray(g(jnp.full(N, x))), x + 11 * total,
                                   err_msg=f"rank {RANK}")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_fori_loop_of_recvs_into_a_closed_over_template(backend):
    """Rank 0 sends three messages; rank 1 receives them in a jitted fori_loop whose
    recv template is closed over: it must receive three times (the sum of the three
    messages), not once at trace time."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    template = jnp.zeros(N, jnp.float32)
    if RANK == 0:
        for k in (1.0, 2.0, 3.0):
            mj.send(jnp.full(N, k), 1, tag=21, backend=backend)
    elif RANK == 1:
        body = lambda i, acc: acc + mj.recv(template, 0, tag=21, backend=backend)  # noqa: E731
        got = jax.jit(lambda: jax.lax.fori_loop(0, 3, body, jnp.zeros(N)))()
        np.testing.assert_allclose(np.asarray(got), 6.0, err_msg=f"rank {RANK}")
    mj.barrier()  # nothing left pending for later tests


def _count_compiles():
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen, lambda: jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_eager_vmap_does_not_compile_per_call(backend):
    """An eager vmap of a collective runs the collective on the concrete batch: after a
    first call, repeated calls compile nothing (they compiled a new program per call,
    20-25 ms each, growing JAX's cache without bound)."""
    f = jax.vmap(lambda x: mj.all_reduce(x, backend=backend))
    xb = jnp.stack([jnp.full(N, RANK + s, jnp.float32) for s in range(3)])
    want = np.stack([np.full(N, sum(r + s for r in range(SIZE))) for s in range(3)])
    np.testing.assert_allclose(np.asarray(f(xb)), want)  # warm-up
    seen, stop = _count_compiles()
    try:
        for _ in range(3):
            np.testing.assert_allclose(np.asarray(f(xb)), want, err_msg=f"rank {RANK}")
    finally:
        stop()
    assert not seen, f"rank {RANK}: {len(seen)} compilations in 3 eager vmap calls"


def test_eager_calls_under_grad_wait_for_jitted_communication(monkeypatch):
    """Under an eager jax.grad the forward and backward calls run eagerly from the
    derivative rules: like every eager call they first wait for communication that
    jitted programs left in flight (jax.effects_barrier)."""
    jax.jit(lambda x: mj.all_reduce(x, backend="mpi"))(jnp.ones(N)).block_until_ready()
    waits = []
    real = jax.effects_barrier
    monkeypatch.setattr(jax, "effects_barrier", lambda: (waits.append(1), real())[1])
    g = jax.grad(lambda x: jnp.sum(mj.all_reduce(x, backend="gloo") ** 2))(jnp.ones(N))
    np.testing.assert_allclose(np.asarray(g), 2.0 * SIZE * SIZE, err_msg=f"rank {RANK}")
    assert len(waits) >= 2, f"rank {RANK}: {len(waits)} waits for 2 eager calls under grad"
