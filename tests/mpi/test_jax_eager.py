"""mcrdl_jax eager: every op x {mpi, gloo} x {float32, bfloat16, int32} x {world,
subgroup} against NumPy on every rank; inputs are never mutated; bad input is refused."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mcrdl_jax as mj
from conftest import RANK, grp  # noqa: F401  (fixture)
from mcrdl_core.errors import InvalidArgumentError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32}
N = 4

pytestmark = [pytest.mark.parametrize("backend", ["mpi", "gloo"]),
              pytest.mark.parametrize("dt", list(DTYPES))]


def vals(rank, shape, dt, salt=0):
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + rank * 3 + salt) % 5 + 1).reshape(shape).astype(DTYPES[dt])


def jx(a):
    return jnp.asarray(a)


def same(actual, expected):
    a = np.asarray(actual).astype(np.float64)
    np.testing.assert_allclose(a, np.asarray(expected).astype(np.float64), rtol=1e-2,
                               err_msg=f"rank {RANK}")


def test_all_reduce_and_input_unchanged(grp, backend, dt):
    group, ranks, me = grp
    x = jx(vals(RANK, (N,), dt))
    y = mj.all_reduce(x, "sum", group, backend)
    same(y, sum(vals(r, (N,), dt).astype(np.float64) for r in ranks))
    same(x, vals(RANK, (N,), dt))  # functional: the input is untouched
    assert isinstance(y, jax.Array) and y.dtype == x.dtype


def test_reduce(grp, backend, dt):
    group, ranks, me = grp
    x = jx(vals(RANK, (N,), dt))
    y = mj.reduce(x, ranks[-1], "max", group, backend)
    same(y, np.max([vals(r, (N,), dt).astype(np.float64) for r in ranks], 0)
         if RANK == ranks[-1] else vals(RANK, (N,), dt))


def test_broadcast(grp, backend, dt):
    group, ranks, me = grp
    same(mj.broadcast(jx(vals(RANK, (2, N), dt)), ranks[0], group, backend),
         vals(ranks[0], (2, N), dt))


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather(grp, backend, dt, tiled):
    group, ranks, me = grp
    y = mj.all_gather(jx(vals(RANK, (2, N), dt)), group, backend, tiled=tiled)
    exp = np.stack([vals(r, (2, N), dt) for r in ranks])
    same(y, exp.reshape(-1, N) if tiled else exp)


def test_reduce_scatter(grp, backend, dt):
    group, ranks, me = grp
    n = len(ranks)
    y = mj.reduce_scatter(jx(vals(RANK, (n * 2, N), dt)), "sum", group, backend)
    full = sum(vals(r, (n * 2, N), dt).astype(np.float64) for r in ranks)
    same(y, full[me * 2:(me + 1) * 2])


def test_all_to_all_even_and_uneven(grp, backend, dt):
    group, ranks, me = grp
    n = len(ranks)
    y = mj.all_to_all(jx(vals(RANK, (n * 2, N), dt)), group, backend)
    same(y, np.concatenate([vals(r, (n * 2, N), dt)[me * 2:(me + 1) * 2] for r in ranks]))
    cnt = lambda i, j: (i + 2 * j) % 3 + 1  # noqa: E731
    ins, outs = [cnt(me, j) for j in range(n)], [cnt(j, me) for j in range(n)]
    y = mj.all_to_all(jx(vals(RANK, (sum(ins), N), dt)), group, backend, ins, outs)
    parts = []
    for j, r in enumerate(ranks):
        start = sum(cnt(j, k) for k in range(me))
        parts.append(vals(r, (sum(cnt(j, k) for k in range(n)), N), dt)[start:start + cnt(j, me)])
    same(y, np.concatenate(parts))


def test_gather_scatter(grp, backend, dt):
    group, ranks, me = grp
    n, root = len(ranks), ranks[0]
    y = mj.gather(jx(vals(RANK, (N,), dt)), root, group, backend)
    same(y, np.stack([vals(r, (N,), dt) for r in ranks]) if RANK == root else vals(RANK, (N,), dt))
    z = mj.scatter(jx(vals(RANK, (n, N), dt)), root, group, backend)
    same(z, vals(root, (n, N), dt)[me])


def test_send_recv_sendrecv(grp, backend, dt):
    group, ranks, me = grp
    n = len(ranks)
    if n < 2:
        pytest.skip("point-to-point needs 2 ranks in the group")
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    y = mj.sendrecv(jx(vals(RANK, (N,), dt)), jnp.zeros(N, DTYPES[dt]), prv, nxt, group, 5, backend)
    same(y, vals(prv, (N,), dt))
    if me == 0:
        mj.send(jx(vals(RANK, (N,), dt)), nxt, group, 6, backend)
    elif me == 1:
        same(mj.recv(jnp.zeros(N, DTYPES[dt]), prv, group, 6, backend), vals(prv, (N,), dt))


def test_bad_input(backend, dt):
    with pytest.raises(InvalidArgumentError, match="must be a JAX"):
        mj.all_reduce([1, 2, 3], backend=backend)
    with pytest.raises(InvalidArgumentError, match="traced value"):
        jax.jit(lambda v: mj.all_reduce(v, backend=backend))(jnp.ones(3, DTYPES[dt]))
