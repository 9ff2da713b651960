"""Numerics where features meet (issue 48), against NumPy on every rank.

- The two-level all-reduce (``backend="hier"``) on 16-bit floats accumulates as the flat
  path does (float32) and rounds once: a host's partial is never rounded to float16 or
  bfloat16 between the levels. Hierarchical where hosts are emulated
  (``MCRDL_RANKS_PER_HOST=2`` at 4 ranks); elsewhere the same calls run flat and must
  give the same rounded-once results.
- A compressed collective gives the same bits under ``jax.jit`` (whose host callbacks
  run on an XLA thread with flush-to-zero and denormals-are-zero set) as eagerly: the
  codecs do not depend on the calling thread's floating-point mode.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import mcrdl_torch as dist
from conftest import RANK, SIZE
from mcrdl_core.base import config as _config

K = _config.get("MCRDL_RANKS_PER_HOST") or 0  # ranks per emulated host
EMULATED = K >= 2 and SIZE % K == 0 and SIZE // K >= 2  # as tests/mpi/test_hier.py

# --- the two-level all-reduce of 16-bit floats ----------------------------------------
#: per rank (rank % 4) one row; every column is a case where rounding a host's partial
#: to 16 bits between the levels (hosts {0, 1} and {2, 3}) changes the result
_ROWS = {
    # float16 SUM: hosts' partials 80000 and -79008 overflow float16 (inf - inf = NaN);
    # exact, rounded once: 992. Then a sum whose partials lose their low bits.
    ("float16", "sum"): [[40000, 2048, 1], [40000, 1, 1], [-40000, 1, 2048], [-39000, 0, 1]],
    # float16 PRODUCT: 300 * 300 overflows float16; rounded once: 9
    ("float16", "prod"): [[300, 1, 2], [300, 1, 3], [0.01, 1, 0.5], [0.01, 1, 1]],
    ("float16", "avg"): [[40000, 3, 8], [40000, 1, 9], [-40000, 2, 9], [-39000, 4, 2]],
    # bfloat16 SUM: 256 + 1 rounds to 256 on host 0, then 256 + 1 + 0 to 256 again;
    # exact 258, which bfloat16 holds
    ("bfloat16", "sum"): [[256, 3, 1], [1, 0.0078125, 1], [1, 0, 256], [0, 0, 0.5]],
}
_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _inputs(dtype, op):
    """Every rank's input, already rounded to ``dtype`` (as the ranks hold them)."""
    rows = _ROWS[(dtype, op)]
    return np.array([rows[r % 4] for r in range(SIZE)], np.float64).astype(_NP[dtype])


def _rounded_once(dtype, op):
    """The exact reduction of the rounded inputs (float64 holds these sums and
    products exactly, or within float32's rounding), rounded to ``dtype`` once."""
    xs = _inputs(dtype, op).astype(np.float64)
    exact = {"sum": xs.sum(0), "prod": xs.prod(0), "avg": xs.mean(0)}[op]
    with np.errstate(over="ignore"):
        return exact.astype(_NP[dtype])


def _all_reduce(dtype, op, backend):
    mine = _inputs(dtype, op)[RANK]
    t = torch.from_numpy(mine.astype(np.float32)).to(_TORCH[dtype])
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                           "avg": dist.ReduceOp.AVG}[op], backend=backend)
    return t.to(torch.float32).numpy()


@pytest.mark.parametrize("dtype,op", list(_ROWS))
@pytest.mark.parametrize("backend", ["hier", "hier:mpi", "hier:gloo", "mpi"])
def test_a_16_bit_all_reduce_rounds_once(backend, dtype, op):
    """Rounded once wherever the call accumulates in float32: every two-level run and
    flat MPI. Where the group is not hierarchical, ``hier:gloo`` is the flat Gloo call
    (torch's Gloo reduces 16-bit floats in their own type), and must give its result."""
    got = _all_reduce(dtype, op, backend)
    if backend == "hier:gloo" and not EMULATED:
        want = _all_reduce(dtype, op, "gloo")
    else:
        want = _rounded_once(dtype, op).astype(np.float32)
    np.testing.assert_array_equal(got, want, err_msg=f"rank {RANK}: {backend} {dtype} {op}")


def test_a_16_bit_all_reduce_of_many_blocks_rounds_once():
    """More elements than ranks per host, not a multiple of them (the padded block of
    the reduce-scatter), async, with a plain call in flight beside it."""
    n = 1001
    base = np.array(_ROWS[("float16", "sum")], np.float64)
    xs = np.stack([np.resize(base[r % 4], n) * (1 + (np.arange(n) % 3)) for r in range(SIZE)])
    xs = xs.astype(np.float16)
    t = torch.from_numpy(xs[RANK].copy())
    other = torch.full((5,), float(RANK + 1))
    works = [dist.all_reduce(t, backend="hier", async_op=True),
             dist.all_reduce(other, backend="gloo", async_op=True)]
    for w in works:
        w.wait()
    with np.errstate(over="ignore"):
        want = xs.astype(np.float64).sum(0).astype(np.float16)
    np.testing.assert_array_equal(t.numpy(), want)
    assert torch.equal(other, torch.full((5,), SIZE * (SIZE + 1) / 2))


# --- compressed collectives whatever the thread's floating-point mode -----------------
def _small_values(rank, n, subnormal_inputs):
    """Blocks of 128 whose largest value is 1 and the rest 1e-5 .. 1e-4: scaled to
    fp8's range most land in e4m3's subnormal codes (and int8's small codes);
    optionally some float32 subnormals among them (not where the result adds them)."""
    rng = np.random.default_rng(100 + rank)
    x = (rng.uniform(1e-5, 1e-4, n) * rng.choice([-1, 1], n)).astype(np.float32)
    x[::128] = 1.0
    if subnormal_inputs:
        x[5::7] = np.float32(2.0 ** -140) * (1 + np.arange(x[5::7].shape[0]) % 50)
    return x


@pytest.mark.parametrize("codec", ["fp8", "int8", "fp16", "bf16"])
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_jitted_compressed_collective_gives_the_eager_bits(backend, codec):
    """Under jax.jit the call runs in a host callback on an XLA thread, which has
    flush-to-zero and denormals-are-zero set; eagerly it runs on this thread."""
    jax = pytest.importorskip("jax")
    import mcrdl_jax as mj

    x = jax.numpy.asarray(_small_values(RANK, 1000, False))
    g = jax.numpy.asarray(_small_values(RANK, 1000, True))

    def calls(a, b):
        return (mj.all_reduce(a, backend=backend, compression=codec),
                mj.all_gather(b, backend=backend, compression=codec))
    eager = [np.asarray(r) for r in calls(x, g)]
    jitted = [np.asarray(r) for r in jax.jit(calls)(x, g)]
    for what, e, j in zip(("all_reduce", "all_gather"), eager, jitted):
        diff = int((e.view(np.uint32) != j.view(np.uint32)).sum())
        assert diff == 0, f"rank {RANK}: {codec} {what} on {backend}: {diff} of {e.size} differ"


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_compressed_collective_after_set_flush_denormal_gives_the_same_bits(backend):
    def run():
        t = torch.from_numpy(_small_values(RANK, 1000, False))
        dist.all_reduce(t, backend=backend, compression="fp8")
        u = torch.from_numpy(_small_values(RANK, 1000, True))
        out = torch.empty(SIZE * 1000)
        dist.all_gather_into_tensor(out, u, backend=backend, compression="fp8")
        return t.numpy().view(np.uint32), out.numpy().view(np.uint32)
    want = run()
    assert torch.set_flush_denormal(True)
    try:
        got = run()
    finally:
        torch.set_flush_denormal(False)
    for w, g in zip(want, got):
        assert np.array_equal(w, g), f"rank {RANK}: {int((w != g).sum())} values differ"
