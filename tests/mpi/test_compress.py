"""Compressed all-gather, reduce-scatter and all-reduce on every rank, against NumPy.

Every algorithm x codec x backend (mpi, gloo), at whatever size the launch has (1-3
ranks). Each rank can compute every rank's input (Gaussian, seeded by rank), so each
checks its own result against the exact NumPy one:
- all-gather (ring and a2a): block k is *bit-identical* to a local round trip of rank
  k's block through the codec, on every rank: one encoding, error independent of P;
  p2p re-encodes at every hop: within (P-1) round-trip bounds;
- reduce-scatter: within the codec's bound times the quantizations that reach the
  result (ring/p2p: P-1 partial sums; a2a: one per contribution);
- all-reduce: reduce-scatter then all-gather.
"""
import hashlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mcrdl_core as mc
import mcrdl_torch as dist
from conftest import BACKENDS, RANK, SIZE
from mcrdl_core.compress import NonFiniteError, make_codec
from mcrdl_core.base.errors import DtypeError, UnsupportedError

try:
    import zfpy  # noqa: F401
    CODECS = ["none", "bf16", "fp16", "int8", "int4", "zfp:16"]
except ImportError:
    CODECS = ["none", "bf16", "fp16", "int8", "int4"]
ALGOS = ["ring", "p2p", "a2a"]
#: per-codec relative L2 bound of one round trip on N(0,1) data (measured x ~1.3)
TOL = {"none": 1e-6, "bf16": 2.2e-3, "fp16": 3e-4, "int8": 9.5e-3, "int4": 1.6e-1,
       "zfp:16": 3e-4}
N = 3000  # elements per rank's block: several codec blocks and a partial one


def data(rank, count, salt=0):
    return np.random.default_rng(1000 * salt + rank).standard_normal(count).astype(np.float32)


def rel(a, b):
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def local_round_trip(codec_name, x):
    codec = make_codec(codec_name)
    enc = np.empty(codec.encoded_nbytes(x.shape[0]), np.uint8)
    codec.encode(x, enc)
    out = np.empty_like(x)
    codec.decode(enc, out)
    return out


def same_on_every_rank(arr) -> bool:
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    digests = MPI.COMM_WORLD.allgather(digest)
    return len(set(digests)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", CODECS)
def test_all_gather(codec, algo, backend):
    x = data(RANK, N)
    out = np.empty(SIZE * N, np.float32)
    mc.all_gather_into_tensor(out, x, backend=backend, compression=f"{codec}@{algo}")
    blocks = out.reshape(SIZE, N)
    for k in range(SIZE):
        xk = data(k, N)
        if algo == "p2p":
            if k == RANK:
                assert np.array_equal(blocks[k], xk)  # p2p compresses on the wire only
            hops = (RANK - k) % SIZE
            assert rel(blocks[k], xk) <= TOL[codec] * max(hops, 1), (k, rel(blocks[k], xk))
        else:
            assert np.array_equal(blocks[k], local_round_trip(codec, xk)), k
            assert rel(blocks[k], xk) <= TOL[codec]
    if algo != "p2p":
        assert same_on_every_rank(out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", CODECS)
def test_reduce_scatter(codec, algo, backend):
    x = data(RANK, SIZE * N, 1)
    out = np.empty(N, np.float32)
    mc.reduce_scatter_tensor(out, x, backend=backend, compression=f"{codec}@{algo}")
    exact = sum(data(k, SIZE * N, 1).astype(np.float64) for k in range(SIZE))[RANK * N:][:N]
    quantizations = 1 if algo == "a2a" else max(SIZE - 1, 1)
    assert rel(out, exact) <= TOL[codec] * quantizations, rel(out, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", CODECS)
def test_all_reduce(codec, algo, backend):
    n = N + 7  # not a multiple of the group size: padded blocks
    x = data(RANK, n, 2)
    mc.all_reduce(x, backend=backend, compression=f"{codec}@{algo}")
    exact = sum(data(k, n, 2).astype(np.float64) for k in range(SIZE))
    hops = 1 if algo == "a2a" else max(SIZE - 1, 1)
    assert rel(x, exact) <= TOL[codec] * (hops + (SIZE - 1 if algo == "p2p" else 1))
    if algo != "p2p":
        assert same_on_every_rank(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_pipeline_gives_the_same_bits(backend):
    """Chunks fall on codec blocks: pipelining changes when, never what, is computed."""
    from mcrdl_core.compress import Compression

    x = data(RANK, 20000, 3)
    one, three = np.empty(SIZE * 20000, np.float32), np.empty(SIZE * 20000, np.float32)
    mc.all_gather_into_tensor(one, x, backend=backend, compression=Compression("int8", chunks=1))
    mc.all_gather_into_tensor(three, x, backend=backend, compression=Compression("int8", chunks=3))
    assert np.array_equal(one, three)
    r1, r3 = np.empty(20000 // 4, np.float32), np.empty(20000 // 4, np.float32)
    y = data(RANK, SIZE * (20000 // 4), 4)
    mc.reduce_scatter_tensor(r1, y, backend=backend, compression=Compression("fp16", chunks=1))
    mc.reduce_scatter_tensor(r3, y, backend=backend, compression=Compression("fp16", chunks=3))
    assert np.array_equal(r1, r3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_dtypes_lists_and_async(dtype, backend):
    """mcrdl_torch passes compression= through; list forms, async_op and AVG."""
    x = torch.from_numpy(data(RANK, 1000, 5)).to(dtype)
    outs = [torch.empty(1000, dtype=dtype) for _ in range(SIZE)]
    work = dist.all_gather(outs, x, async_op=True, backend=backend, compression="int8")
    work.wait()
    for k in range(SIZE):
        xk = torch.from_numpy(data(k, 1000, 5)).to(dtype).double().numpy()
        assert rel(outs[k].double().numpy(), xk) <= TOL["int8"] + 4e-3
    ins = [torch.from_numpy(data(RANK, 1000, 6 + k)).to(dtype) for k in range(SIZE)]
    out = torch.empty(1000, dtype=dtype)
    dist.reduce_scatter(out, ins, op=dist.ReduceOp.AVG, backend=backend, compression="fp16@a2a")
    exact = sum(data(k, 1000, 6 + RANK).astype(np.float64) for k in range(SIZE)) / SIZE
    assert rel(out.double().numpy(), exact) <= TOL["fp16"] + 4e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_integers_travel_exact_on_the_plain_ring_and_lossy_codecs_refuse_them(backend):
    x = np.arange(10, dtype=np.int64) + 100 * RANK
    out = np.empty(10, np.int64)
    mc.reduce_scatter_tensor(out, np.tile(x, SIZE), backend=backend, compression="none")
    assert np.array_equal(out, sum(np.arange(10) + 100 * k for k in range(SIZE)))
    with pytest.raises(DtypeError, match="lossy"):  # refused before anything is sent
        mc.all_gather_into_tensor(np.empty(10 * SIZE, np.int64), x, backend=backend,
                                  compression="int8")
    with pytest.raises(UnsupportedError, match="SUM and AVG"):
        mc.all_reduce(np.ones(4, np.float32), op="max", backend=backend, compression="int8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_survive_int8(backend):
    x = data(RANK, 600, 7)
    x[[RANK, 300, 599]] = [np.nan, np.inf, -np.inf]
    out = np.empty(SIZE * 600, np.float32)
    mc.all_gather_into_tensor(out, x, backend=backend, compression="int8")
    for k in range(SIZE):
        b = out[k * 600:(k + 1) * 600]
        assert np.isnan(b[k]) and b[300] == np.inf and b[599] == -np.inf
        assert np.isfinite(np.delete(b, [k, 300, 599])).all()


@pytest.mark.skipif("zfp:16" not in CODECS, reason="zfpy is not installed")
@pytest.mark.parametrize("backend", BACKENDS)
def test_zfp_refuses_non_finite_on_every_rank(backend):
    """zfp cannot carry NaN/Inf: the collective completes everywhere, then every rank
    whose result holds the block raises (no rank is left waiting)."""
    x = data(RANK, 100, 8)
    if RANK == 0:
        x[3] = np.inf
    out = np.empty(SIZE * 100, np.float32)
    with pytest.raises(NonFiniteError, match="int8, int4, fp16 or bf16"):
        mc.all_gather_into_tensor(out, x, backend=backend, compression="zfp:16")
    assert np.isnan(out[:100]).all()
    ok = np.empty(SIZE * 100, np.float32)  # the next call works: nothing was left behind
    mc.all_gather_into_tensor(ok, data(RANK, 100, 8), backend=backend, compression="zfp:16")


def test_environment_default_and_keyword_override(monkeypatch):
    monkeypatch.setenv("MCRDL_COMPRESSION", "all_gather=int4")
    x = data(RANK, 500, 9)
    out = np.empty(SIZE * 500, np.float32)
    mc.all_gather_into_tensor(out, x, backend="mpi")
    assert np.array_equal(out[RANK * 500:][:500], local_round_trip("int4", x))
    mc.all_gather_into_tensor(out, x, backend="mpi", compression="none")
    assert np.array_equal(out[RANK * 500:][:500], x)
    monkeypatch.delenv("MCRDL_COMPRESSION")
    mc.all_gather_into_tensor(out, x, backend="mpi")
    assert np.array_equal(out[RANK * 500:][:500], x)


def test_compressed_gloo_and_mpi_in_flight_together():
    """A compressed all-gather over Gloo in flight while an MPI all-reduce runs: the
    progress engine drives both (no wait blocks inside one library)."""
    x = data(RANK, 4000, 10)
    out = np.empty(SIZE * 4000, np.float32)
    w1 = mc.all_gather_into_tensor(out, x, async_op=True, backend="gloo", compression="fp16")
    y = np.full(1000, RANK + 1.0, np.float32)
    w2 = mc.all_reduce(y, async_op=True, backend="mpi")
    w2.wait()
    w1.wait()
    assert np.all(y == SIZE * (SIZE + 1) / 2)
    assert rel(out[RANK * 4000:][:4000], x) <= TOL["fp16"]


def test_subgroup():
    ranks = list(range(SIZE))[::-1][:2] if SIZE > 1 else [0]
    g = mc.new_group(ranks)
    if RANK not in ranks:
        return
    me = ranks.index(RANK)
    x = data(RANK, 256 * 3, 11)
    out = np.empty(len(ranks) * x.shape[0], np.float32)
    mc.all_gather_into_tensor(out, x, group=g, backend="mpi", compression="int8")
    for i, k in enumerate(ranks):
        assert np.array_equal(out[i * x.shape[0]:][:x.shape[0]],
                              local_round_trip("int8", data(k, x.shape[0], 11))), (i, me)


@pytest.mark.parametrize("backend", ["mpi"])
def test_auto_makes_one_choice_on_every_rank(backend):
    """auto calibrates once (collectively, figures agreed with MAX), so every rank takes
    the same variant; the result is the plain one or a correct compressed one. (One
    backend: the calibration costs ~50 collectives, and the code is the same for all.)"""
    from mcrdl_core.compress import auto

    spec = "auto:fp16+int8"
    x = data(RANK, 1 << 16, 12)
    out = np.empty(SIZE << 16, np.float32)
    mc.all_gather_into_tensor(out, x, backend=backend, compression=spec)
    choice = auto.describe(spec, "all_gather", SIZE, 1 << 16, backend)
    assert len(set(MPI.COMM_WORLD.allgather(choice))) == 1, choice
    mine = out[RANK << 16:][:1 << 16]
    if choice == "plain":
        assert np.array_equal(mine, x)
    else:
        assert np.array_equal(mine, local_round_trip(choice.split("@")[0], x)), choice
    y = data(RANK, 3 * SIZE, 13)  # a few values: the plain collective, whatever the link
    mc.all_reduce(y, backend=backend, compression=spec)
    assert rel(y, sum(data(k, 3 * SIZE, 13).astype(np.float64) for k in range(SIZE))) < 1e-6


@pytest.mark.skipif(SIZE != 2, reason="run at 2 ranks only, for its cost (one rank would "
                    "compress nothing); bench/compression.py --fsdp runs any size")
def test_fsdp2_through_the_registered_backend_trains_to_the_same_loss():
    """FSDP2 on init_process_group("mcrdl") with MCRDL_COMPRESSION=int8 (its all-gathers
    and reduce-scatters compressed) ends within 1% of the uncompressed loss; the 200-step
    figure is bench/compression.py --fsdp 200 (docs/compression.md)."""
    import importlib.util
    import pathlib

    import torch.distributed as tdist

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "compression.py"
    spec = importlib.util.spec_from_file_location("mcrdl_bench_compression", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tdist.init_process_group("mcrdl")
    try:
        plain, _ = bench.fsdp_losses(20, None)
        comp, _ = bench.fsdp_losses(20, "int8")
    finally:
        tdist.destroy_process_group()
    assert plain[-1] < 0.5 * plain[0]  # it learns
    assert comp != plain  # compression was in the path
    final_plain, final_comp = np.mean(plain[-5:]), np.mean(comp[-5:])
    assert abs(final_comp - final_plain) <= 0.01 * final_plain, (final_plain, final_comp)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_calls_follow_the_process_default(monkeypatch, jit):
    """MCRDL_COMPRESSION reaches mcrdl_jax's eager calls and, under jit, its calls on
    any backend (a compressed call runs in the host callback, mpi included)."""
    jax = pytest.importorskip("jax")
    import mcrdl_jax as mj

    monkeypatch.setenv("MCRDL_COMPRESSION", "all_gather=int8")
    x = data(RANK, 512, 14)
    for backend in ("gloo", "mpi"):
        fn = (lambda a, b=backend: mj.all_gather(a, backend=b, tiled=True))
        y = np.asarray((jax.jit(fn) if jit else fn)(jax.numpy.asarray(x)))
        for k in range(SIZE):
            assert np.array_equal(y[k * 512:(k + 1) * 512],
                                  local_round_trip("int8", data(k, 512, 14)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("jit", [False, True])
def test_jax_compression_keyword(backend, jit):
    """compression= on mcrdl_jax's all_gather, reduce_scatter and all_reduce, eager and
    under jit, against NumPy on every rank; the plain call in the same program is exact."""
    jax = pytest.importorskip("jax")
    import mcrdl_jax as mj

    x = data(RANK, SIZE * N, 17)
    exact = sum(data(k, SIZE * N, 17).astype(np.float64) for k in range(SIZE))

    def program(a):
        return (mj.all_gather(a[:N], backend=backend, tiled=True, compression="int8"),
                mj.reduce_scatter(a, backend=backend, compression="fp16"),
                mj.all_reduce(a, backend=backend, compression="bf16"),
                mj.all_reduce(a, backend=backend))

    gathered, scattered, reduced, plain = (np.asarray(v) for v in (
        (jax.jit(program) if jit else program)(jax.numpy.asarray(x))))
    for k in range(SIZE):
        assert np.array_equal(gathered[k * N:(k + 1) * N],
                              local_round_trip("int8", data(k, SIZE * N, 17)[:N]))
    hops = max(SIZE - 1, 1)
    assert rel(scattered, exact[RANK * N:(RANK + 1) * N]) <= TOL["fp16"] * hops
    assert rel(reduced, exact) <= TOL["bf16"] * (hops + 1)
    np.testing.assert_allclose(plain, exact, rtol=1e-5, atol=1e-4)
    with pytest.raises(DtypeError, match="lossy"):  # refused before anything is sent
        mj.all_gather(jax.numpy.arange(4), backend=backend, compression="int8")


def test_jax_grad_of_a_compressed_all_gather_is_a_compressed_reduce_scatter():
    """d/dx sum(w * all_gather(x)) = reduce_scatter(w), through the same codec (fp16):
    within fp16's bound of the exact sum of every rank's weights."""
    jax = pytest.importorskip("jax")
    import mcrdl_jax as mj

    x = jax.numpy.asarray(data(RANK, N, 18))
    w = jax.numpy.asarray(data(RANK, SIZE * N, 19))
    g = jax.jit(jax.grad(lambda a: (w * mj.all_gather(a, tiled=True,
                                                       compression="fp16")).sum()))(x)
    exact = sum(data(k, SIZE * N, 19).astype(np.float64) for k in range(SIZE))
    assert rel(np.asarray(g), exact[RANK * N:(RANK + 1) * N]) <= TOL["fp16"] * max(SIZE - 1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paired_schedule_of_stream_backends(backend, monkeypatch):
    """The schedule NCCL gets (each receive issued with the send of its step, nothing
    posted ahead), run here on a host backend: same bits as the pre-posted one."""
    from mcrdl_core.compress import Compression
    from mcrdl_core.compress.schedule import Channel

    x = data(RANK, 5000, 15)
    y = data(RANK, SIZE * 2000, 16)
    results = []
    for paired in (False, True):
        monkeypatch.setattr(Channel, "force_paired", paired)
        out = np.empty(SIZE * 5000, np.float32)
        mc.all_gather_into_tensor(out, x, backend=backend, compression=Compression("int8", chunks=2))
        rs = np.empty(2000, np.float32)
        mc.reduce_scatter_tensor(rs, y, backend=backend, compression=Compression("int4", chunks=3))
        results.append((out, rs))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])
