"""What mcrdl_jax's calls become under jax.jit: sendrecv selects each direction's backend
from its own size, as the eager call does (a table that sends small messages over MPI
and large ones over Gloo must not hang it); reduce_scatter on MPI is a real
reduce-scatter (each rank receives its 1/n block), not an all-reduce and a slice.
Checked against NumPy on every rank."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcrdl_core as mc
import mcrdl_jax as mj
from conftest import RANK, SIZE
from mcrdl_core.dispatch.selection import SCHEMA, TuningTable


@pytest.fixture
def small_on_mpi_large_on_gloo():
    """A tuning table: send and recv of <= 64 bytes over mpi, larger over gloo."""
    rt = mc.get_runtime()
    before = rt.table
    for name in ("mpi", "gloo"):  # communicators are created collectively, on first use:
        mc.barrier(backend=name)  # create both here, in the same order on every rank
    entries = [{"op": op, "world_size": SIZE, "hosts": 1, "device": "cpu",
                "dtype_class": "float", "ranges": [[64, "mpi"], [None, "gloo"]]}
               for op in ("send", "recv")]
    rt.set_table(TuningTable({"schema": SCHEMA, "entries": entries}))
    yield
    rt.set_table(before)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_sendrecv_selects_each_direction_by_its_own_size(small_on_mpi_large_on_gloo, mode):
    """Rank 0 sends 16 bytes to rank 1 and receives 256 bytes back; rank 1 the other
    way round. Each direction's pair of ranks agrees on its backend (16 B: mpi, 256 B:
    gloo) only if every rank selects each direction from that direction's size."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    if RANK > 1:
        return
    peer = 1 - RANK
    small, large = jnp.full(4, 1.0 + RANK), jnp.full(64, 10.0 + RANK)
    send, like = (small, jnp.zeros(64)) if RANK == 0 else (large, jnp.zeros(4))
    f = lambda s, lk: mj.sendrecv(s, lk, source=peer, dest=peer, tag=31)  # noqa: E731
    got = (jax.jit(f) if mode == "jit" else f)(send, like)
    want = np.full(64, 11.0) if RANK == 0 else np.full(4, 1.0)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"rank {RANK}")


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_jit_reduce_scatter_on_mpi_is_a_reduce_scatter(dt):
    """The lowered program holds no all-reduce, and the call the core runs is MPI's
    reduce-scatter (the comm logger records the op and backend), whose result on each
    rank is its block: 1/n of the input."""
    rows = 2 * SIZE
    x = jnp.asarray((np.arange(rows * 3).reshape(rows, 3) + RANK) % 7, dt)
    f = jax.jit(lambda v: mj.reduce_scatter(v, backend="mpi"))
    text = f.lower(x).as_text()
    assert "mpi_allreduce" not in text and "python_cpu_callback" in text, text[-2000:]
    log = mc.get_runtime().logger
    was, log.enabled = log.enabled, True
    log.clear()
    try:
        y = f(x)
        y.block_until_ready()
        records = list(log.records)
    finally:
        log.enabled = was
        log.clear()
    full = sum(((np.arange(rows * 3).reshape(rows, 3) + r) % 7).astype(np.float64)
               for r in range(SIZE))
    np.testing.assert_allclose(np.asarray(y, np.float64), full[2 * RANK:2 * RANK + 2],
                               err_msg=f"rank {RANK}")
    assert y.shape == (2, 3) and y.dtype == x.dtype
    assert [(op, be) for op, _, be, *_ in records] == [("reduce_scatter", "mpi")], records


def test_mpi4jax_off_runs_mpi_calls_in_the_host_callback(monkeypatch):
    """MCRDL_JAX_MPI4JAX=0: jitted MPI calls hold no mpi4jax primitive (those block in
    MPI with no timeout) but the host callback, where waits have MCRDL_TIMEOUT, and
    give the same results: all-reduce, gather to the last rank, and a ring sendrecv."""
    monkeypatch.setenv("MCRDL_JAX_MPI4JAX", "0")
    x = jnp.asarray(np.arange(6, dtype=np.float32) + RANK)
    root, nxt, prv = SIZE - 1, (RANK + 1) % SIZE, (RANK - 1) % SIZE

    def f(v):
        return (mj.all_reduce(v, backend="mpi"), mj.gather(v, dst=root, backend="mpi"),
                mj.sendrecv(v, jnp.zeros_like(v), source=prv, dest=nxt, tag=41, backend="mpi"))

    text = jax.jit(f).lower(x).as_text()
    assert "mpi_" not in text.replace("mpi4jax", "") and "python_cpu_callback" in text, \
        text[-2000:]
    s, g, r = jax.jit(f)(x)
    base = np.arange(6, dtype=np.float64)
    np.testing.assert_array_equal(np.asarray(s), SIZE * base + sum(range(SIZE)),
                                  err_msg=f"rank {RANK}")
    want_g = np.stack([base + k for k in range(SIZE)]) if RANK == root else base + RANK
    np.testing.assert_array_equal(np.asarray(g), want_g, err_msg=f"rank {RANK}")
    np.testing.assert_array_equal(np.asarray(r), base + prv, err_msg=f"rank {RANK}")
