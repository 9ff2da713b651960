"""mcrdl_jax: every op x {mpi, gloo} x {eager, jit} x {float32, bfloat16, float16,
int32} x {world, subgroup} against NumPy on every rank; inputs are never mutated; calls
of two backends in one jitted function keep their order; bad input is refused with
clear errors (debug mode: shapes that differ across ranks, at trace time)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mcrdl_jax as mj
from conftest import RANK, SIZE, grp  # noqa: F401  (fixture)
from mcrdl_core.base.errors import (BackendUnavailableError, DtypeError, InvalidArgumentError,
                                    UnsupportedError)

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
          "int32": np.int32}
N = 4

pytestmark = [pytest.mark.parametrize("backend", ["mpi", "gloo"]),
              pytest.mark.parametrize("mode", ["eager", "jit"]),
              pytest.mark.parametrize("dt", list(DTYPES))]


@pytest.fixture
def run(mode):
    """run(fn, *arrays, **static): fn(*arrays, **static), eagerly or under jax.jit."""
    def call(fn, *arrays, **static):
        if mode == "jit":
            return jax.jit(lambda *a: fn(*a, **static))(*arrays)
        return fn(*arrays, **static)
    return call


def vals(rank, shape, dt, salt=0):
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + rank * 3 + salt) % 5 + 1).reshape(shape).astype(DTYPES[dt])


def jx(a):
    return jnp.asarray(a)


def same(actual, expected):
    a = np.asarray(actual).astype(np.float64)
    np.testing.assert_allclose(a, np.asarray(expected).astype(np.float64), rtol=1e-2,
                               err_msg=f"rank {RANK}")


def test_all_reduce_and_input_unchanged(grp, backend, dt, run):
    group, ranks, me = grp
    x = jx(vals(RANK, (N,), dt))
    y = run(mj.all_reduce, x, op="sum", group=group, backend=backend)
    same(y, sum(vals(r, (N,), dt).astype(np.float64) for r in ranks))
    same(x, vals(RANK, (N,), dt))  # functional: the input is untouched
    assert isinstance(y, jax.Array) and y.dtype == x.dtype


def test_reduce(grp, backend, dt, run):
    group, ranks, me = grp
    x = jx(vals(RANK, (N,), dt))
    y = run(mj.reduce, x, dst=ranks[-1], op="max", group=group, backend=backend)
    same(y, np.max([vals(r, (N,), dt).astype(np.float64) for r in ranks], 0)
         if RANK == ranks[-1] else vals(RANK, (N,), dt))


def test_broadcast(grp, backend, dt, run):
    group, ranks, me = grp
    same(run(mj.broadcast, jx(vals(RANK, (2, N), dt)), src=ranks[0], group=group, backend=backend),
         vals(ranks[0], (2, N), dt))


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather(grp, backend, dt, tiled, run):
    group, ranks, me = grp
    y = run(mj.all_gather, jx(vals(RANK, (2, N), dt)), group=group, backend=backend,
            tiled=tiled)
    exp = np.stack([vals(r, (2, N), dt) for r in ranks])
    same(y, exp.reshape(-1, N) if tiled else exp)


def test_reduce_scatter(grp, backend, dt, run):
    group, ranks, me = grp
    n = len(ranks)
    y = run(mj.reduce_scatter, jx(vals(RANK, (n * 2, N), dt)), op="sum", group=group,
            backend=backend)
    full = sum(vals(r, (n * 2, N), dt).astype(np.float64) for r in ranks)
    same(y, full[me * 2:(me + 1) * 2])


def test_all_to_all_even_and_uneven(grp, backend, dt, run, mode):
    group, ranks, me = grp
    n = len(ranks)
    y = run(mj.all_to_all, jx(vals(RANK, (n * 2, N), dt)), group=group, backend=backend)
    same(y, np.concatenate([vals(r, (n * 2, N), dt)[me * 2:(me + 1) * 2] for r in ranks]))
    cnt = lambda i, j: (i + 2 * j) % 3 + 1  # noqa: E731
    ins, outs = [cnt(me, j) for j in range(n)], [cnt(j, me) for j in range(n)]
    y = run(mj.all_to_all, jx(vals(RANK, (sum(ins), N), dt)), group=group, backend=backend,
            input_split_sizes=ins, output_split_sizes=outs)
    parts = []
    for j, r in enumerate(ranks):
        start = sum(cnt(j, k) for k in range(me))
        parts.append(vals(r, (sum(cnt(j, k) for k in range(n)), N), dt)[start:start + cnt(j, me)])
    same(y, np.concatenate(parts))


def test_gather_scatter(grp, backend, dt, run):
    group, ranks, me = grp
    n, root = len(ranks), ranks[0]
    y = run(mj.gather, jx(vals(RANK, (N,), dt)), dst=root, group=group, backend=backend)
    same(y, np.stack([vals(r, (N,), dt) for r in ranks]) if RANK == root else vals(RANK, (N,), dt))
    z = run(mj.scatter, jx(vals(RANK, (n, N), dt)), src=root, group=group, backend=backend)
    same(z, vals(root, (n, N), dt)[me])


def test_send_recv_sendrecv(grp, backend, dt, run):
    group, ranks, me = grp
    n = len(ranks)
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    y = run(mj.sendrecv, jx(vals(RANK, (N,), dt)), jnp.zeros(N, DTYPES[dt]), source=prv,
            dest=nxt, group=group, tag=5, backend=backend)
    same(y, vals(prv, (N,), dt))
    if me == 0:
        run(mj.send, jx(vals(RANK, (N,), dt)), dst=nxt, group=group, tag=6, backend=backend)
    elif me == 1:
        same(run(mj.recv, jnp.zeros(N, DTYPES[dt]), src=prv, group=group, tag=6,
                 backend=backend), vals(prv, (N,), dt))
    # any source: rank 1 of the group sends to rank 0
    if me == 1:
        run(mj.send, jx(vals(RANK, (N,), dt, 2)), dst=ranks[0], group=group, tag=7,
            backend=backend)
    elif me == 0:
        same(run(mj.recv, jnp.zeros(N, DTYPES[dt]), src=None, group=group, tag=7,
                 backend=backend), vals(ranks[1], (N,), dt, 2))


def test_bad_input(backend, dt, mode, run):
    with pytest.raises(InvalidArgumentError, match="must be a JAX"):
        mj.all_reduce([1, 2, 3], backend=backend)
    x = jnp.ones(3, DTYPES[dt])
    if dt == "int32":
        with pytest.raises(UnsupportedError, match="AVG needs a floating dtype"):
            run(mj.all_reduce, x, op="avg", backend=backend)
    else:
        with pytest.raises(UnsupportedError, match="BAND is bitwise and needs an integer"):
            run(mj.all_reduce, x, op="band", backend=backend)
    # a backend that cannot take this array here (no GPU: unavailable; with one: CPU array)
    with pytest.raises((BackendUnavailableError, UnsupportedError), match="nccl"):
        run(mj.all_reduce, x, backend="nccl")
    with pytest.raises(DtypeError, match="complex64, which MCR-DL does not communicate"):
        run(mj.all_reduce, jnp.ones(3, jnp.complex64), backend=backend)
    if SIZE > 1:
        with pytest.raises(InvalidArgumentError, match="multiple of the group size"):
            run(mj.reduce_scatter, jnp.ones((SIZE * 2 + 1, 2), DTYPES[dt]), backend=backend)
    with pytest.raises(InvalidArgumentError, match="split sizes"):
        run(mj.all_to_all, jnp.ones((SIZE, 2), DTYPES[dt]), backend=backend,
            input_split_sizes=[1] * (SIZE + 1), output_split_sizes=[1] * (SIZE + 1))


def test_two_backends_in_one_jit_keep_program_order(backend, dt, mode):
    """Two collectives with no data dependency, one on each backend, in one jitted
    function: if XLA ran them in different orders on different ranks, the ranks would
    wait on each other forever (Gloo's wait would time out). They share one ordered
    effect, so they run in program order everywhere; both orders are tried."""
    if mode != "jit":
        pytest.skip("a jit property")
    other = {"mpi": "gloo", "gloo": "mpi"}[backend]

    @jax.jit
    def f(a, b, c):
        return (mj.all_reduce(a, backend=backend), mj.all_gather(b, backend=other),
                mj.broadcast(c, src=SIZE - 1, backend=backend))

    s, g, c = f(jx(vals(RANK, (N,), dt)), jx(vals(RANK, (2,), dt, 1)), jx(vals(RANK, (3,), dt)))
    same(s, sum(vals(r, (N,), dt).astype(np.float64) for r in range(SIZE)))
    same(g, np.stack([vals(r, (2,), dt, 1) for r in range(SIZE)]))
    same(c, vals(SIZE - 1, (3,), dt))
    text = f.lower(jx(vals(RANK, (N,), dt)), jx(vals(RANK, (2,), dt, 1)),
                   jx(vals(RANK, (3,), dt))).as_text()
    # the MPI calls lower to mpi4jax, the Gloo call to a host callback, in one token chain
    assert "mpi_allreduce_ffi" in text or "mpi_bcast_ffi" in text or "mpi_allgather_ffi" in text
    assert "python_cpu_callback" in text


def test_debug_mode_refuses_shapes_that_differ_across_ranks(backend, dt, mode):
    """MCRDL_DEBUG=1: a traced collective whose shape differs between ranks is a clear
    MismatchError at trace time on every rank, not a hang or garbage."""
    if mode != "jit" or SIZE < 2:
        pytest.skip("a jit property, needs 2 ranks")
    from mcrdl_core.base.errors import MismatchError
    rt = __import__("mcrdl_core").get_runtime()
    rt.debug = True
    try:
        shape = (2, 3) if RANK == 0 else (3, 2)  # same element count, different shape
        with pytest.raises(MismatchError, match=r"shape \(3, 2\) where group rank 0 has shape "
                                                r"\(2, 3\)"):
            jax.jit(lambda v: mj.all_reduce(v, backend=backend))(jnp.ones(shape, DTYPES[dt]))
        # the same call with equal shapes passes the check
        y = jax.jit(lambda v: mj.all_reduce(v, backend=backend))(jnp.ones((2, 3), DTYPES[dt]))
        same(y, np.full((2, 3), SIZE))
    finally:
        rt.debug = False
