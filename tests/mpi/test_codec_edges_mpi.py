"""Codec edges through the compressed collectives, on every rank, against NumPy
(issue 21, items 4 and 5).

- Zero elements: a 0-element compressed all-gather, reduce-scatter and all-reduce is a
  no-op on every codec x algorithm x backend (zfp used to kill every rank with SIGBUS),
  and the group works afterwards.
- float64 data far outside float32's range and tiny float32 blocks arrive within the
  codec's bound (they used to arrive as inf, NaN or 0).
- The reduce-scatter bound of docs/compression.md holds relative to the contributions'
  norms, and not relative to the result's: with contributions that cancel, the error
  relative to the (tiny) result is far above the codec's bound.
"""
import numpy as np
import pytest
import torch

import mcrdl_core as mc
import mcrdl_torch as dist
from conftest import BACKENDS, RANK, SIZE
from mcrdl_core.compress import make_codec

try:
    import zfpy  # noqa: F401
    CODECS = ["none", "bf16", "fp16", "int8", "int4", "zfp:16"]
except ImportError:
    CODECS = ["none", "bf16", "fp16", "int8", "int4"]
ALGOS = ["ring", "p2p", "a2a"]
N = 1500


def data(rank, count, salt=0, dtype=np.float64):
    return np.random.default_rng(7000 + 100 * salt + rank).standard_normal(count).astype(dtype)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = np.abs(b).max()
    return float(np.linalg.norm((a - b) / s) / np.linalg.norm(b / s))


@pytest.fixture(autouse=True)
def group_still_works():
    """After each test a plain and a compressed call still line up on every rank."""
    yield
    t = torch.ones(5)
    dist.all_reduce(t, backend="mpi")
    assert torch.equal(t, torch.full((5,), float(SIZE)))
    out = np.empty(SIZE * 4, np.float32)
    mc.all_gather_into_tensor(out, np.full(4, RANK, np.float32), backend="gloo",
                              compression="int8")
    assert np.array_equal(out, np.repeat(np.arange(SIZE, dtype=np.float32), 4))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", CODECS)
def test_zero_elements_are_a_no_op(codec, algo, backend):
    spec = f"{codec}@{algo}"
    out = np.empty(0, np.float32)
    mc.all_gather_into_tensor(out, np.empty(0, np.float32), backend=backend, compression=spec)
    mc.reduce_scatter_tensor(out, np.empty(0, np.float32), backend=backend, compression=spec)
    mc.all_reduce(np.empty(0, np.float32), backend=backend, compression=spec)
    t = torch.empty(0, dtype=torch.float64)
    dist.all_gather_into_tensor(torch.empty(0, dtype=torch.float64), t, backend=backend,
                                compression=spec)
    work = dist.reduce_scatter_tensor(torch.empty(0, dtype=torch.float64), t, backend=backend,
                                      compression=spec, async_op=True)
    work.wait()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
def test_float64_outside_float32s_range(codec, algo, backend):
    """Every rank's block at a magnitude of its own (1e300, 1e-300, 1e-310, ...): the
    all-gather returns each within one round trip's bound of the sender's data."""
    scale = [1e300, 1e-300, 1e-310, 1e40][:SIZE]
    x = data(RANK, N, 1) * scale[RANK]
    out = np.empty(SIZE * N, np.float64)
    mc.all_gather_into_tensor(out, x, backend=backend, compression=f"{codec}@{algo}")
    c = make_codec(codec)
    bound = c.error_bound if c.error_bound is not None else 4 * c.typical_error
    hops = max(SIZE - 1, 1) if algo == "p2p" else 1
    assert np.isfinite(out).all()
    for k in range(SIZE):
        assert rel(out[k * N:(k + 1) * N], data(k, N, 1) * scale[k]) <= bound * hops, k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp16"])
def test_tiny_float32_blocks_reduce(codec, backend):
    """A reduce-scatter of float32 data around 1e-38 (int8 used to zero it)."""
    x = (data(RANK, SIZE * N, 2) * 1e-38).astype(np.float32)
    out = np.empty(N, np.float32)
    mc.reduce_scatter_tensor(out, x, backend=backend, compression=f"{codec}@a2a")
    parts = [(data(k, SIZE * N, 2) * 1e-38).astype(np.float32)[RANK * N:(RANK + 1) * N]
             for k in range(SIZE)]
    exact = sum(p.astype(np.float64) for p in parts)
    err = np.linalg.norm(out.astype(np.float64) - exact)
    norms = sum(np.linalg.norm(p.astype(np.float64)) for k, p in enumerate(parts) if k != RANK)
    assert err <= make_codec(codec).error_bound * norms + 1e-45
    assert np.count_nonzero(out) > N // 2


@pytest.mark.skipif(SIZE < 2, reason="contributions cancel only between ranks")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ["ring", "a2a"])
@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_reduce_scatter_bound_is_relative_to_the_contributions(codec, algo, backend):
    """Rank 0 contributes y, rank 1 contributes -y + d (||d|| = ||y|| / 100), the others
    0: the sum is d. The documented bound holds: ring ||error|| <= (P-1) eps
    (1+eps)^(P-2) times the sum of the other ranks' contributions' norms, a2a eps times
    that sum. Relative to the result the error exceeds even (P-1) eps, the bound the
    docs used to state relative to the result."""
    y = data(0, SIZE * N, 3)
    d = 1e-2 * data(1, SIZE * N, 4)
    mine = {0: y, 1: -y + d}.get(RANK, np.zeros(SIZE * N))
    out = np.empty(N, np.float64)
    mc.reduce_scatter_tensor(out, mine, backend=backend, compression=f"{codec}@{algo}")
    block = slice(RANK * N, (RANK + 1) * N)
    parts = {0: y[block], 1: (-y + d)[block]}
    exact = d[block]
    eps = make_codec(codec).error_bound
    others = sum(np.linalg.norm(p) for k, p in parts.items() if k != RANK)
    factor = 1.0 if algo == "a2a" else (SIZE - 1) * (1 + eps) ** (SIZE - 2)
    err = np.linalg.norm(out - exact)
    assert err <= factor * eps * others
    assert err / np.linalg.norm(exact) > (SIZE - 1) * eps
