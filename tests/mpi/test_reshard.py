"""Cross-mesh resharding end to end, on every rank: random meshes over the world's ranks
(ranks in both meshes, in one, in neither), random specs, uneven, empty and 0-d shapes,
dtypes bool/float16/bfloat16/float32/int64, every method on mpi and gloo, with host maps
that make the ranks one host, each its own host, or pairs; then DTensor and JAX. Every
destination rank's tile must equal the NumPy slice of the global tensor (so every
method gives the same result)."""
import ml_dtypes
import numpy as np
import pytest
import torch

import mcrdl_core as mc
from mcrdl_core.base.errors import InvalidArgumentError, MismatchError
from mcrdl_core.reshard import Layout, Mesh

from conftest import RANK, SIZE

DTYPES = [np.float32, np.bool_, np.float16, ml_dtypes.bfloat16, np.int64]
METHODS = ["broadcast", "send_recv", "send_recv_allgather"]


def _mesh(rng, names):
    k = int(rng.integers(1, SIZE + 1))
    ranks = rng.permutation(SIZE)[:k]
    shape = [k] if k in (1, 3) or rng.random() < 0.5 else [2, k // 2]
    return Mesh(ranks.reshape(shape), names[:len(shape)])


def _layout(rng, ndim, names):
    mesh = _mesh(rng, names)
    spec = [[] for _ in range(ndim)]
    for a in mesh.axis_names:
        d = int(rng.integers(-1, ndim)) if ndim else -1
        if d >= 0:
            spec[d].append(a)
    return Layout(mesh, [tuple(e) for e in spec], "flat" if rng.random() < 0.5 else "nested")


def _global(rng, shape, dtype):
    v = rng.integers(0, 64, size=shape)
    return (v % 2).astype(bool) if dtype is np.bool_ else (v / 4).astype(dtype)


def _slice(arr, box):
    return arr[tuple(slice(lo, hi) for lo, hi in box)] if box else arr[...]


def _cases(seed, n):
    rng = np.random.default_rng(seed)  # the same cases on every rank
    for i in range(n):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(x) for x in rng.integers(0, 7, size=ndim))
        if ndim and rng.random() < 0.6:
            shape = tuple(max(s, 2) for s in shape)  # mostly non-empty
        src = _layout(rng, ndim, ("a", "b"))
        dst = _layout(rng, ndim, ("x", "y"))
        dtype = DTYPES[i % len(DTYPES)]
        hosts = [None, "auto", 2][i % 3]
        yield shape, dtype, src, dst, hosts, _global(rng, shape, dtype)


def _raw(a):
    """The bytes of an array (bool, float16 and bfloat16 compared bit for bit)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _check(y, G, dst, shape):
    box = dst.tile(shape, RANK)
    if box is None:
        assert y is None
        return
    exp = _slice(G, box)
    assert y.shape == exp.shape and y.dtype == exp.dtype, (y.shape, exp.shape, y.dtype)
    assert np.array_equal(_raw(y), _raw(exp)), \
        f"rank {RANK}: got {y} expected {exp}"


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("method", METHODS)
def test_random_layouts_match_numpy(method, backend):
    for i, (shape, dtype, src, dst, hosts, G) in enumerate(_cases(13, 12)):
        box = src.tile(shape, RANK)
        local = None if box is None else _slice(G, box).copy()
        y = mc.reshard(local, src, dst, shape, dtype=dtype, method=method, backend=backend,
                       hosts=hosts, overlap=i % 4 != 3)
        _check(y, G, dst, shape)


@pytest.mark.parametrize("go", [False, True])
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_chain_broadcast_segments_and_balancing_options(backend, go, monkeypatch):
    """Chains with 40-byte segments on both backends, every balance and round order,
    overlapped or waited round by round, with or without the go message before a chain
    with relays, non-contiguous boxes, and a destination written into ``out``."""
    import sys

    monkeypatch.setattr(sys.modules["mcrdl_core.reshard.execute"], "GO_MIN_BYTES",
                        0 if go else 1 << 60)
    rng = np.random.default_rng(5)
    shape = (5, 7, 3)
    G = _global(rng, shape, np.float32)
    src = Layout(Mesh(np.arange(SIZE), ("a",)), [None, "a"])
    dst = Layout(Mesh(np.arange(SIZE)[::-1], ("x",)), [None, None, "x"])
    for balance in ("lpt", "least_load", "first"):
        for order, overlap in (("rounds", True), ("naive", True), ("rounds", False)):
            box = dst.tile(shape, RANK)
            out = np.full(tuple(hi - lo for lo, hi in box), -1, np.float32)
            local = _slice(G, src.tile(shape, RANK)).copy()
            y = mc.reshard(local, src, dst, shape, backend=backend, chain=True, segment=40,
                           balance=balance, order=order, hosts=1, out=out, overlap=overlap)
            assert y is out
            _check(y, G, dst, shape)
            # every rank gets the whole tensor: chains through all the others (relays)
            whole = Layout(Mesh(np.roll(np.arange(SIZE), 1), ("x",)), [])
            y = mc.reshard(local, src, whole, shape, backend=backend, chain=True,
                           segment=40, balance=balance, order=order, hosts=1,
                           overlap=overlap)
            _check(y, G, whole, shape)


@pytest.mark.skipif(SIZE < 3, reason="a chain with a relay needs three ranks")
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_async_relay_returns_at_once_and_keeps_each_pairs_order(backend):
    """An async broadcast reshard chained 0 -> 1 -> 2: rank 1 (the relay) returns from
    its start before rank 0 has sent anything (rank 0 sends only once rank 1 says so:
    a start that waited for the data would hang here), and a later reshard's direct
    send 1 -> 2 issued while the relay's forward is still queued reaches rank 2 after
    it, into the later reshard's tile (one pair's messages keep their order)."""
    G = np.arange(64, dtype=np.float32)
    one = Layout(Mesh([0], ("a",)), [None])
    both = Layout(Mesh([1, 2], ("x",)), [None])
    at1, at2 = Layout(Mesh([1], ("a",)), [None]), Layout(Mesh([2], ("x",)), [None])
    kw = dict(dtype=np.float32, chain=True, hosts=1, backend=backend)
    for a, b, x in ((one, both, G if RANK == 0 else None), (at1, at2, G if RANK == 1 else None)):
        _check(mc.reshard(x, a, b, G.shape, method="broadcast" if a is one else "send_recv",
                          **kw), G, b, G.shape)  # each plan checked across ranks once
    flag = np.zeros(1, np.float32)
    if RANK == 0:
        mc.recv(flag, 1, backend=backend)  # rank 1's start has returned
        assert mc.reshard(G * 2, one, both, G.shape, **kw) is None
        assert mc.reshard(None, at1, at2, G.shape, method="send_recv", **kw) is None
        return
    work, y = mc.reshard(None, one, both, G.shape, async_op=True, **kw)
    if RANK == 1:
        mc.send(flag, 0, backend=backend)
    work2, y2 = mc.reshard(-G if RANK == 1 else None, at1, at2, G.shape, method="send_recv",
                           async_op=True, **kw)
    for w in (work2, work):  # (waited in the other order: the queue moves either way)
        if w is not None:
            w.wait()
    _check(y, G * 2, both, G.shape)
    _check(y2, -G, at2, G.shape)


def test_plan_is_printable_serializable_and_reusable():
    src = Layout(Mesh([0], ("a",)), [])
    dst = Layout(Mesh(np.arange(SIZE), ("x",)), ["x"])
    plan = mc.plan_reshard((6, 2), np.int64, src, dst, hosts=None)
    assert "transfers" in str(plan) and plan.fingerprint() == type(plan).from_json(
        plan.to_json()).fingerprint()
    G = np.arange(12, dtype=np.int64).reshape(6, 2)
    for _ in range(2):  # a plan can be reused (its groups and fingerprint check are cached)
        y = mc.reshard(G.copy() if RANK == 0 else None, plan=plan, backend="mpi")
        _check(y, G, dst, (6, 2))


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_ranks_holding_different_plans_are_told_before_anything_moves():
    src = Layout(Mesh(np.arange(SIZE), ("a",)), [])
    dst = Layout(Mesh(np.arange(SIZE), ("x",)), ["x"])
    G = np.ones((4, 4), np.float32)
    with pytest.raises(MismatchError, match="another plan"):
        mc.reshard(G.copy(), src, dst, G.shape, balance="first" if RANK == 0 else "lpt",
                   backend="mpi", hosts=1)


def test_wrong_local_tile_is_refused():
    src = Layout(Mesh(np.arange(SIZE), ("a",)), ["a"])
    dst = Layout(Mesh([0], ("x",)), [])
    with pytest.raises(InvalidArgumentError, match="pass that tile"):
        mc.reshard(np.zeros((99,), np.float32), src, dst, (SIZE * 2,))
    with pytest.raises(InvalidArgumentError, match="dtype="):
        mc.reshard(None, src, dst, (4,))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_dtensor_to_another_mesh(backend):
    """DTensor in (on ranks [0..k) sharded on rows), DTensor out on the reversed ranks,
    sharded on columns; redistribute would refuse: it is another mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import mcrdl_torch.resharding as tr

    k = min(SIZE, 2)
    shape = (5, 3)
    G = torch.arange(15, dtype=torch.bfloat16).reshape(shape)
    src_mesh = DeviceMesh("cpu", torch.arange(k), mesh_dim_names=("dp",), _init_backend=False,
                          _rank=RANK)
    dst_ranks = torch.arange(SIZE).flip(0).reshape(1, SIZE)
    dst_mesh = DeviceMesh("cpu", dst_ranks, mesh_dim_names=("pp", "tp"), _init_backend=False,
                          _rank=RANK)
    dst = (dst_mesh, [Replicate(), Shard(1)])
    if RANK < k:
        lay = tr.layout(src_mesh, [Shard(0)])
        local = _slice(G, lay.tile(shape, RANK)).clone()
        x = DTensor.from_local(local, src_mesh, [Shard(0)], run_check=False,
                               shape=torch.Size(shape), stride=(3, 1))
        y = tr.reshard(x, dst=dst, backend=backend)
    else:
        y = tr.reshard(None, (src_mesh, [Shard(0)]), dst, shape, dtype=torch.bfloat16,
                       backend=backend)
    assert isinstance(y, DTensor) and tuple(y.shape) == shape
    assert y.placements == (Replicate(), Shard(1)) and y.device_mesh is dst_mesh
    box = tr.layout(*dst).tile(shape, RANK)
    assert torch.equal(y.to_local(), _slice(G, box))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_jax_eager_and_jit(backend):
    import jax
    import jax.numpy as jnp

    import mcrdl_jax.resharding as jr

    shape = (4, 6)
    G = np.arange(24, dtype=np.float32).reshape(shape)
    src = Layout(Mesh(np.arange(SIZE), ("a",)), ["a"])
    dst = Layout(Mesh(np.arange(SIZE).reshape(1, SIZE), ("x", "y")), [None, "y"])
    local = jnp.asarray(_slice(G, src.tile(shape, RANK)))
    y = jr.reshard(local, src, dst, shape, backend=backend)
    np.testing.assert_array_equal(np.asarray(y), _slice(G, dst.tile(shape, RANK)))

    @jax.jit
    def f(x):
        return jr.reshard(x * 2, src, dst, shape, backend=backend) + 1

    np.testing.assert_array_equal(np.asarray(f(local)), _slice(G, dst.tile(shape, RANK)) * 2 + 1)

    # a concrete array closed over by a jitted function still communicates in the program
    # (once per run), not once while tracing with its result baked in as a constant
    def g(s):
        return jr.reshard(local, src, dst, shape, backend=backend) * s

    assert "mcrdl_host_call" in str(jax.make_jaxpr(g)(1.0))
    np.testing.assert_array_equal(np.asarray(jax.jit(g)(3.0)), _slice(G, dst.tile(shape, RANK)) * 3)


@pytest.mark.parametrize("method", ["broadcast", "send_recv_allgather"])
def test_pipeline_across_meshes_matches_single_process(method):
    """bench/apps/jax_mesh_pipeline.py: stage 0 data parallel on the first half of the
    ranks, stage 1 tensor parallel on the rest (rank 0 holds both at 1 rank), joined by
    reshard both ways; its parameters equal a single-process run's."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "apps"))
    import jax_mesh_pipeline as app

    args = app.parser().parse_args(["--steps", "3", "--micro", "2", "--batch", "6",
                                    "--hidden", "10", "--method", method, "--check"])
    res = app.train(args)
    diffs = [v for k, v in res.items() if k.endswith("_max_diff")]
    assert diffs and max(diffs) < 1e-5, f"rank {RANK}: {res}"
