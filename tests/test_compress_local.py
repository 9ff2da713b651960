"""Codecs and plans of compressed collectives, on one process (no communication)."""
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mcrdl_core import dtypes as dt
from mcrdl_core.compress import Compression, make_codec, parse, plan, resolve
from mcrdl_core.compress import spec as cz_spec
from mcrdl_core.base.errors import DtypeError, InvalidArgumentError, UnsupportedError
from mcrdl_core.base.ops import Op, ReduceOp

try:
    import zfpy  # noqa: F401
    ZFP = ["zfp:8", "zfp:16", "zfp:24"]
except ImportError:
    ZFP = []

CODECS = ["none", "bf16", "fp16", "int8", "int4"] + ZFP
LOSSY = [c for c in CODECS if c != "none"]
#: relative L2 error of one round trip on N(0, 1) float32 data must stay below these
#: (about 1.2x the measured figures that docs/compression.md lists)
BOUND = {"none": 0.0, "bf16": 2.1e-3, "fp16": 2.7e-4, "int8": 9e-3, "int4": 1.5e-1,
         "zfp:8": 6.5e-2, "zfp:16": 2.6e-4, "zfp:24": 1e-6}
SIZES = [1, 3, 127, 128, 255, 256, 257, 1000, 4099]


def gaussian(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def round_trip(codec, x, out_dtype=np.float32):
    enc = np.full(codec.encoded_nbytes(x.shape[0]), 0xAB, np.uint8)
    codec.encode(x, enc)
    out = np.empty(x.shape[0], out_dtype)
    intact = codec.decode(enc, out)
    return out, enc, intact


def rel_l2(a, b):
    b = b.astype(np.float64)
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def measured_errors(n=1 << 20):
    x = gaussian(n, 1)
    return {name: rel_l2(round_trip(make_codec(name), x)[0], x) for name in CODECS}


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_size_and_error(name, n):
    codec = make_codec(name)
    x = gaussian(n, n)
    out, enc, intact = round_trip(codec, x)
    assert intact
    assert enc.shape[0] % 8 == 0
    err = rel_l2(out, x)
    bound = codec.error_bound if codec.error_bound is not None else BOUND[name]
    assert err <= bound, (name, n, err, bound)
    if n >= 1000:
        assert err <= BOUND[name] * (1.5 if n < 4000 else 1.0) + 1e-12, (name, n, err)


@pytest.mark.parametrize("name", CODECS)
def test_encoded_size_depends_on_count_only(name):
    """Two different inputs of one length encode to the same number of bytes, which the
    codec announced beforehand (no size exchange between ranks)."""
    codec = make_codec(name)
    for n in (5, 1 << 12):
        sizes = set()
        for x in (gaussian(n), np.zeros(n, np.float32), np.full(n, 1e30, np.float32)):
            enc = np.zeros(codec.encoded_nbytes(n), np.uint8)
            codec.encode(x, enc)
            sizes.add(enc.shape[0])
        assert sizes == {codec.encoded_nbytes(n)}


@pytest.mark.skipif(not ZFP, reason="zfpy is not installed")
@pytest.mark.parametrize("rate", [3, 7, 8, 12, 16, 24, 32])
def test_zfp_stream_size_formula(rate):
    """zfpy's fixed-rate stream fits the slot reserved from n alone, and fills it but
    for the header's short form (52 bits less, so at most one 64-bit word)."""
    import zfpy

    codec = make_codec(f"zfp:{rate}")
    for n in (1, 4, 5, 1000, 1001, 4099):
        stream = zfpy.compress_numpy(gaussian(n), rate=rate)
        assert codec.stream_nbytes(n) - 8 <= len(stream) <= codec.stream_nbytes(n), (rate, n)


def test_measured_errors_match_the_docs():
    """docs/compression.md lists each codec's error as measured here (1 Mi N(0,1) float32
    values); the listed figure must be within 10% of what the codec does now."""
    errors = measured_errors()
    doc = (Path(__file__).resolve().parent.parent / "docs" / "compression.md").read_text()
    for name, err in errors.items():
        assert err <= BOUND[name], (name, err)
        if name == "none":
            continue
        m = re.search(rf"^\| `{re.escape(name)}` \|[^|]*\|[^|]*\| ([0-9.e+-]+) \|", doc, re.M)
        assert m, f"docs/compression.md has no row for {name}"
        listed = float(m.group(1))
        assert abs(listed - err) <= 0.1 * err, (name, listed, err)


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4"])
def test_nan_and_inf_survive(name):
    codec = make_codec(name)
    x = gaussian(1000, 3)
    x[[5, 300, 301, 999]] = [np.nan, np.inf, -np.inf, np.nan]
    out, _, intact = round_trip(codec, x)
    assert intact
    fin = np.isfinite(x)
    assert np.isnan(out[[5, 999]]).all()
    assert out[300] == np.inf and out[301] == -np.inf
    assert np.isfinite(out[fin]).all()
    assert rel_l2(out[fin], x[fin]) <= BOUND[name] * 1.5


@pytest.mark.skipif(not ZFP, reason="zfpy is not installed")
def test_zfp_flags_non_finite_blocks():
    codec = make_codec("zfp:16")
    x = gaussian(100)
    x[7] = np.inf
    out, _, intact = round_trip(codec, x)
    assert not intact and np.isnan(out).all()


def test_bf16_rounds_like_ml_dtypes():
    x = np.concatenate([gaussian(4096), np.array([3.4e38, -3.4e38, 1e-40, 0.0, -0.0],
                                                 np.float32)])
    out, _, _ = round_trip(make_codec("bf16"), x)
    ref = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp16:256", "int8", "int8:64", "int4", "fp8"])
def test_codecs_give_the_same_bits_with_or_without_torch(monkeypatch, name):
    """The codecs cast, scale, round and reduce through torch when torch is loaded and
    through NumPy otherwise: the same encoded bytes and decoded values either way (bf16's
    are ml_dtypes' own; a NaN decodes as a NaN), NaN of both signs, infinities,
    subnormals, values that round up to inf, blocks far from 1, scaled values exactly
    half-way between two codes (rint's ties to even), and 0/1 elements included."""
    import sys

    import torch  # noqa: F401  (loaded; hidden from the codecs for the NumPy path)
    from mcrdl_core.compress import codecs

    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-42,
                        0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)
    finite = special[4:]
    # amax 126 = 0.984375 * 2^7 (exact in the scale word): int8 scales by exactly 1
    ties = np.zeros(256, np.float32)
    ties[:8] = [126, 2.5, 3.5, -0.5, -1.5, 0.5, 125.5, -124.5]
    cases = [np.concatenate([gaussian(3000), finite]), gaussian(2048) * 1e30,
             gaussian(1500) * 1e-30, special[:1], special[:0], ties, gaussian(4096) * 7]
    if name == "bf16":
        cases.append(np.concatenate([gaussian(1000), special]))
    codec = make_codec(name)

    def run(x):
        enc = np.zeros(codec.encoded_nbytes(x.size), np.uint8)
        codec.encode(x, enc)
        out = np.empty_like(x)
        codec.decode(enc, out)
        return enc, out

    for x in cases:
        with_torch = run(x)
        if x.size:
            assert codecs._bf16_cast(np.empty(x.size, np.uint16), x)  # the torch path ran
        with monkeypatch.context() as m:
            m.delitem(sys.modules, "torch")
            assert not codecs._bf16_cast(np.empty(x.size, np.uint16), x)
            without = run(x)
        assert np.array_equal(with_torch[0], without[0])
        nan = np.isnan(without[1])  # a NaN decodes as a NaN (its payload may differ)
        assert np.array_equal(np.isnan(with_torch[1]), nan)
        assert np.array_equal(with_torch[1][~nan].view(np.uint32), without[1][~nan].view(np.uint32))
        if name == "bf16":
            ref = x.astype(ml_dtypes.bfloat16)
            assert np.array_equal(with_torch[1].view(np.uint32),
                                  ref.astype(np.float32).view(np.uint32))


def test_fp16_scale_avoids_overflow_and_keeps_small_blocks():
    codec = make_codec("fp16:256")
    x = np.concatenate([gaussian(256) * 1e30, gaussian(256) * 1e-30, gaussian(256)])
    out, _, _ = round_trip(codec, x)
    for blk in range(3):
        sl = slice(256 * blk, 256 * (blk + 1))
        assert rel_l2(out[sl], x[sl]) <= 2.0 ** -11, blk


@pytest.mark.parametrize("name", ["int8", "int4", "fp16"])
def test_block_sizes_and_worst_case_bound(name):
    """A spike per block is the worst case of absmax scaling: the stated bound holds."""
    codec = make_codec(f"{name}:64")
    x = gaussian(64 * 50) * 1e-3
    x[::64] = 1.0
    out, _, _ = round_trip(codec, x)
    assert rel_l2(out, x) <= codec.error_bound
    assert codec.encoded_nbytes(64 * 50) < make_codec(name).encoded_nbytes(64 * 50) + 50 * 4


def test_float64_and_float16_outputs():
    codec = make_codec("int8")
    x = gaussian(3000).astype(np.float64)
    out, _, _ = round_trip(codec, x, np.float64)
    assert rel_l2(out, x) <= BOUND["int8"]
    out16, _, _ = round_trip(codec, x.astype(np.float32), np.float32)
    assert np.allclose(out16, out, atol=1e-6)


# --- spec, refusal, plan ---------------------------------------------------------------
def test_default_is_off(monkeypatch):
    monkeypatch.delenv("MCRDL_COMPRESSION", raising=False)
    assert resolve(None, Op.ALL_GATHER, dt.float32) is None
    assert parse("off") is None and parse(None) is None


def test_environment_default_per_op(monkeypatch):
    monkeypatch.setenv("MCRDL_COMPRESSION", "all_gather=int8,reduce_scatter=fp16@a2a")
    assert resolve(None, Op.ALL_GATHER, dt.float32) == Compression("int8", "ring")
    assert resolve(None, Op.REDUCE_SCATTER, dt.float32) == Compression("fp16", "a2a")
    assert resolve(None, Op.ALL_REDUCE, dt.float32) is None
    assert resolve("bf16@p2p", Op.ALL_REDUCE, dt.float32) == Compression("bf16", "p2p")
    monkeypatch.setenv("MCRDL_COMPRESSION", "int4")
    assert resolve(None, Op.ALL_REDUCE, dt.float32).codec == "int4"
    monkeypatch.setenv("MCRDL_COMPRESSION", "broadcast=int8")
    with pytest.raises(InvalidArgumentError, match="unknown op"):
        resolve(None, Op.ALL_GATHER, dt.float32)


@pytest.mark.parametrize("dtype", [dt.int32, dt.int64, dt.int8, dt.uint8])
def test_lossy_codecs_refuse_integers(dtype):
    with pytest.raises(DtypeError, match="lossy"):
        resolve("int8", Op.ALL_GATHER, dtype)
    assert resolve("none", Op.ALL_GATHER, dtype).codec == "none"


def test_refusals_say_what_to_do():
    with pytest.raises(UnsupportedError, match="SUM and AVG"):
        resolve("int8", Op.REDUCE_SCATTER, dt.float32, ReduceOp.MAX)
    with pytest.raises(InvalidArgumentError, match="unknown codec"):
        parse("int9")
    with pytest.raises(InvalidArgumentError, match="algorithm"):
        parse("int8@tree")
    with pytest.raises(InvalidArgumentError, match="even"):
        make_codec("int8:7")
    with pytest.raises(InvalidArgumentError, match="chunks"):
        Compression("int8", chunks=0)
    if ZFP:
        for bad in ("zfp:40", "zfp:2"):
            with pytest.raises(InvalidArgumentError, match="3..32"):
                make_codec(bad)
        with pytest.raises(UnsupportedError, match="CPU only"):
            make_codec("zfp:16").check_device("cuda")


def test_plan_is_data():
    p = plan(Op.ALL_GATHER, parse("int8"), 4, 1 << 20)
    assert (p.algorithm, p.codec, p.group_size, p.count) == ("ring", "int8:256", 4, 1 << 20)
    assert p.raw_bytes == 4 << 20 and 3.9 < p.ratio < 4.0
    assert p.wire_bytes == 3 * p.encoded_bytes
    assert p.chunks == 1  # 1 MiB encoded: one chunk
    big = plan(Op.REDUCE_SCATTER, parse("fp16"), 2, 16 << 20)
    assert big.chunks == cz_spec.MAX_CHUNKS and sum(big.chunk_counts) == 16 << 20
    assert all(c % 1024 == 0 for c in big.chunk_counts)
    assert plan(Op.REDUCE_SCATTER, parse("fp16@a2a"), 2, 16 << 20).chunks == 1
    three = plan(Op.ALL_REDUCE, Compression("int8", chunks=3), 3, 1000)
    assert three.chunk_counts == (512, 488)  # 334 rounded up to whole 256-value blocks
    assert three.wire_bytes == 4 * sum(make_codec("int8").encoded_nbytes(c) for c in (512, 488))
    assert "ratio" in str(p) and "int8:256" in str(p)


@pytest.mark.parametrize("name", LOSSY)
def test_chunked_encoding_holds_the_same_bytes(name):
    """Chunk boundaries fall on codec blocks: a chunked encoding decodes to exactly the
    values of an unchunked one (so pipelining never changes results)."""
    codec = make_codec(name)
    x = gaussian(10000, 5)
    whole, _, _ = round_trip(codec, x)
    p = plan(Op.ALL_GATHER, Compression(name, chunks=3), 2, 10000)
    parts = []
    off = 0
    for c in p.chunk_counts:
        parts.append(round_trip(codec, x[off:off + c])[0])
        off += c
    assert np.array_equal(np.concatenate(parts), whole)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "bf16", "fp16", "int8", "int8:64", "int4"])
def test_cupy_codecs_match_numpy(name):
    """The same codec on CuPy writes the host's bytes (both start from the same fill, so
    bytes a codec leaves unwritten compare too) and decodes to the host's values."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    codec = make_codec(name)
    x = gaussian(5000, 9)
    x[[3, 4000]] = [np.nan, -np.inf]
    ref, ref_enc, _ = round_trip(codec, x)
    enc = cupy.full(codec.encoded_nbytes(x.shape[0]), 0xAB, cupy.uint8)
    codec.encode(cupy.asarray(x), enc)
    assert np.array_equal(cupy.asnumpy(enc), ref_enc)
    out = cupy.empty(x.shape[0], cupy.float32)
    assert codec.decode(enc, out)
    assert np.array_equal(cupy.asnumpy(out), ref, equal_nan=True)


def test_error_bounds_are_stated():
    for name in LOSSY:
        codec = make_codec(name)
        assert codec.typical_error is not None, name
        if not name.startswith("zfp"):
            assert codec.error_bound is not None and math.isfinite(codec.error_bound)


def test_auto_keeps_plain_on_fast_links_and_compresses_on_slow_ones():
    """decide() is pure: from a calibration (measured times at two sizes) to a variant."""
    from mcrdl_core.compress.auto import CAL_SIZES, Calibration, decide

    def cal(link_bps, latency_s, codec_rate):
        """Times of a P=2 ring on a link of ``link_bps`` bytes/s, with ``latency_s`` per
        call (+1 ms more for the Python ring) and codecs at ``codec_rate`` bytes/s."""
        times = {}
        for op in ("all_gather", "reduce_scatter"):
            times[(op, "plain")] = tuple(latency_s + b / link_bps for b in CAL_SIZES)
            for codec, ratio in (("int8", 3.94), ("fp16", 2.0)):
                times[(op, codec)] = tuple(latency_s + 1e-3 + b / ratio / link_bps
                                           + 3 * b / codec_rate for b in CAL_SIZES)
        return Calibration.from_times(2, times, {"int8": 2 * CAL_SIZES[1] / codec_rate,
                                                 "fp16": 2 * CAL_SIZES[1] / codec_rate})

    fast, slow = cal(5e9, 20e-6, 2e9), cal(0.125e9, 50e-6, 2e9)
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
        for n in (1 << 10, 1 << 14, 1 << 20, 1 << 24):
            assert decide(fast, op, n) is None, (op, n)  # shared memory: never
        assert decide(slow, op, 1 << 10) is None  # 4 KiB: the ring's fixed cost dominates
        assert decide(slow, op, 1 << 22) == Compression("int8", "ring"), op
    # a lucky ring timing (faster than its own codec allows) must not win where the
    # link is faster than the codec: the throughput bound rules it out
    lucky = dict(fast.fits)
    for op in ("all_gather", "reduce_scatter"):
        lucky[(op, "int8")] = (20e-6, 0.1e-9)  # 10 GB/s: impossible with a 1 GB/s codec
    noisy = Calibration(2, lucky, fast.kappa)
    assert noisy.predict(Op.ALL_GATHER, "int8", 1 << 24) * 1.25 < \
        noisy.predict(Op.ALL_GATHER, "plain", 1 << 24)  # the fits alone would compress
    assert noisy.bound(Op.ALL_GATHER, "int8") < 1.25
    assert decide(noisy, Op.ALL_GATHER, 1 << 22) is None
    assert decide(Calibration(2, lucky), Op.ALL_GATHER, 1 << 22) is not None  # unguarded
    assert slow.bound(Op.ALL_GATHER, "int8") == pytest.approx(3.94, rel=0.01)  # ratio-bound
    assert slow.predict(Op.ALL_REDUCE, "plain", 1 << 20) == pytest.approx(
        slow.predict(Op.ALL_GATHER, "plain", 1 << 20) + slow.predict(Op.REDUCE_SCATTER, "plain",
                                                                    1 << 20))
    with pytest.raises(InvalidArgumentError, match="name the codecs"):
        parse("auto")
    assert str(parse("auto:fp16+int8")) == "auto:fp16+int8"
    assert resolve("auto:int8", Op.ALL_GATHER, dt.int32) is None  # only where it can: plain


def test_process_wide_and_auto_specs_leave_what_they_cannot_compress_plain(monkeypatch):
    """An explicit codec refuses integers and MAX; MCRDL_COMPRESSION (one switch for a
    whole job) and auto:/table leave those calls uncompressed instead of failing them."""
    monkeypatch.setenv("MCRDL_COMPRESSION", "int8")
    assert resolve(None, Op.ALL_GATHER, dt.int64) is None
    assert resolve(None, Op.ALL_REDUCE, dt.float32, ReduceOp.MAX) is None
    assert resolve(None, Op.ALL_REDUCE, dt.float32, ReduceOp.SUM).codec == "int8"
    for spec in ("auto:int8", "table"):  # ("table" names no codec: integers are left
        assert resolve(spec, Op.ALL_REDUCE, dt.float32, ReduceOp.MAX) is None  # to auto.py)
    assert resolve("auto:int8", Op.REDUCE_SCATTER, dt.int32) is None
    with pytest.raises(DtypeError, match="lossy"):
        resolve("int8", Op.ALL_GATHER, dt.int64)
    with pytest.raises(UnsupportedError, match="SUM and AVG"):
        resolve("int8", Op.ALL_REDUCE, dt.float32, ReduceOp.MAX)


def test_fp16_host_casts_through_torch_give_numpy_bits(monkeypatch):
    """With torch loaded, fp16 casts run through torch (faster); the bytes must be those
    of the NumPy path, or ranks with and without torch would disagree."""
    pytest.importorskip("torch")
    import sys

    codec = make_codec("fp16")
    x = gaussian(5000, 11) * 100
    x[[7, 4000]] = [np.nan, -np.inf]
    with_torch, _, _ = round_trip(codec, x)
    enc_torch = round_trip(codec, x)[1]
    monkeypatch.setitem(sys.modules, "torch", None)
    without, enc_numpy, _ = round_trip(codec, x)
    assert np.array_equal(enc_torch, enc_numpy)
    assert np.array_equal(with_torch, without, equal_nan=True)
