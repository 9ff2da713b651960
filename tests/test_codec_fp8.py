"""The fp8 (float8 e4m3, block-scaled) codec on one process, against NumPy and ml_dtypes
references, and the pure parts of the compressed all-to-all (spec, plan).

- The payload is ml_dtypes' float8_e4m3fn: the bit-level rounding equals its cast
  (exhaustively over the float32 values the codec can meet), and a whole encoding equals
  a NumPy reference built from the documented steps (block maximum, 20-bit scale word,
  one float32 multiplication, the cast).
- The error: within the stated bound on worst-case and on any-magnitude data, float32 or
  float64; the figure docs/compression.md lists for N(0, 1) data is what it measures.
- NaN, +Inf and -Inf arrive as themselves; only their blocks are flagged, the others'
  bytes are those of an encoding without them.
- Sizes: 0 elements is a no-op, every encoding a multiple of 8 bytes, known from n.
"""
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcrdl_core import dtypes as dt
from mcrdl_core.compress import Compression, make_codec, parse, plan, resolve
from mcrdl_core.compress import codecs as cc
from mcrdl_core.compress import spec as cz_spec
from mcrdl_core.base.errors import DtypeError, InvalidArgumentError, UnsupportedError
from mcrdl_core.base.ops import Op
from test_codec_edges import gaussian, rel_l2

F8 = ml_dtypes.float8_e4m3fn
DOC = Path(__file__).resolve().parent.parent / "docs" / "compression.md"


def round_trip(codec, x):
    """(decoded values in x's dtype, the encoding, intact); unwritten bytes stay 0xAB."""
    enc = np.full(codec.encoded_nbytes(x.shape[0]), 0xAB, np.uint8)
    codec.encode(x, enc)
    out = np.full(x.shape[0], 7, x.dtype)
    return out, enc, codec.decode(enc, out)


def reference(x, block=128):
    """The documented encoding, step by step in NumPy, for finite float32 data of
    float32's normal range: per block amax, its 20 significant bits (truncated) and
    exponent in one word, the factor 416 / amax' as a float32, one float32 product,
    ml_dtypes' cast. Returns (words, codes, decoded values)."""
    n = x.shape[0]
    nb = -(-n // block)
    pad = np.zeros(nb * block, np.float32)
    pad[:n] = x
    rows = pad.reshape(nb, block)
    amax = np.abs(rows).max(axis=1).astype(np.float64)
    m, e = np.frexp(amax)
    frac = np.floor((np.maximum(m, 0.5) - 0.5) * 2.0 ** 20)
    m_t = np.where(amax == 0, 0.0, 0.5 + frac * 2.0 ** -20)
    words = np.where(amax == 0, 0, ((e + 1100).astype(np.uint32) << 19) | frac.astype(np.uint32))
    inv = np.where(m_t > 0, np.ldexp(416 / np.where(m_t > 0, m_t, 1), -e), 0).astype(np.float32)
    codes = (rows * inv[:, None]).astype(F8)
    step = np.ldexp(m_t / 416, e).astype(np.float32)
    values = codes.astype(np.float32) * step[:, None]
    return words.astype(np.uint32), codes.view(np.uint8).reshape(-1)[:n], values.reshape(-1)[:n]


# --- the payload is float8 e4m3fn ------------------------------------------------------
def test_rounding_equals_ml_dtypes_cast_on_every_reachable_float32():
    """Every float32 bit pattern of magnitude below 464 (what the scaled blocks can hold:
    at most 416 * (1 + 2^-19)), both signs, in strides that hit every e4m3 tie and
    subnormal: the bit arithmetic is ml_dtypes' cast."""
    pos = np.arange(0, 0x43E80000, 7, dtype=np.uint32)
    for part in np.array_split(pos, 16):
        y = part.view(np.float32)
        y = np.concatenate([y, -y])
        assert np.array_equal(cc._e4m3_codes(y, np), y.astype(F8).view(np.uint8))


def test_exact_ties_and_edges_round_like_ml_dtypes():
    values = [0.0, -0.0, 2 ** -10, 3 * 2 ** -10, 5 * 2 ** -10, 2 ** -6, 2 ** -6 - 2 ** -10,
              2 ** -6 - 2 ** -11, 1.0625, 1.1875, 15.5, 17.0, 240.0, 248.0, 416.0, 432.0, 440.0]
    y = np.array(values + [-v for v in values], np.float32)
    assert np.array_equal(cc._e4m3_codes(y, np), y.astype(F8).view(np.uint8))


def test_value_table_is_ml_dtypes():
    table = cc._e4m3_values(np, np.float32)
    ref = np.arange(256, dtype=np.uint8).view(F8).astype(np.float32)
    assert np.array_equal(table, ref, equal_nan=True)
    assert np.array_equal(cc._e4m3_values(np, np.float64), ref.astype(np.float64), equal_nan=True)


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000, 4099])
def test_encoding_equals_the_numpy_reference_bit_for_bit(n):
    codec = make_codec("fp8")
    x = gaussian(n, n) * 3.7
    out, enc, intact = round_trip(codec, x)
    words, codes, values = reference(x)
    nb = -(-n // 128)
    assert intact
    assert np.array_equal(enc[:4 * nb].view(np.uint32), words)
    assert np.array_equal(enc[4 * nb:4 * nb + n], codes)
    assert np.array_equal(out, values)
    assert np.all(enc[4 * nb + n:] == 0xAB)  # the padding is never written


def test_block_maximum_maps_to_416():
    """The largest magnitude lands on 416 (0x7D), the largest e4m3 value below 448:
    finite values never take the codes +-448, which carry +-Inf."""
    x = gaussian(128 * 50, 4)
    _, enc, _ = round_trip(make_codec("fp8"), x)
    codes = enc[4 * 50:4 * 50 + x.shape[0]].reshape(50, 128)
    assert np.all((codes & 0x7F).max(axis=1) == 0x7D)
    assert not np.isin(codes, [0x7E, 0xFE, 0x7F, 0xFF]).any()


# --- sizes ---------------------------------------------------------------------------------
def test_sizes_depend_on_count_only_and_zero_is_a_no_op():
    codec = make_codec("fp8")
    assert codec.encoded_nbytes(0) == 0
    for n in (1, 7, 127, 128, 129, 1 << 16, 1000003):
        nb = -(-n // 128)
        assert codec.encoded_nbytes(n) == (4 * nb + n + 7) // 8 * 8
        assert codec.encoded_nbytes(n) % 8 == 0
    enc = np.zeros(0, np.uint8)
    out = np.zeros(0, np.float32)
    codec.encode(np.zeros(0, np.float32), enc)
    assert codec.decode(enc, out)
    assert codec.ratio(1 << 20) == pytest.approx(4 * 128 / 132, rel=1e-3)
    assert codec.ratio(1 << 20, 8) == pytest.approx(8 * 128 / 132, rel=1e-3)


def test_block_size_option_and_refusals():
    assert make_codec("fp8").name == "fp8:128"
    assert make_codec("fp8:256").block == 256
    assert parse("fp8:64@a2a") == Compression("fp8:64", "a2a")
    with pytest.raises(InvalidArgumentError, match="even number"):
        make_codec("fp8:3")
    with pytest.raises(InvalidArgumentError, match="fp8"):
        make_codec("fp8:x")


# --- error -----------------------------------------------------------------------------
def test_bound_formula():
    codec = make_codec("fp8")
    u = 2.0 ** -4 * (1 + 2.0 ** -19)
    assert codec.error_bound == pytest.approx(math.sqrt(u * u + 128 * 2.0 ** -20 / 416 ** 2))
    assert 0.0625 < codec.error_bound < 0.062501


def test_worst_case_stays_within_the_bound():
    """Values half an e4m3 step above a power of two (relative error 1/17 each), and
    blocks of values deep in e4m3's subnormals under one spike."""
    codec = make_codec("fp8")
    # a block maximum of 1 scales by 416 exactly; the others land just above 1.0625 * 2^k
    ties = (np.ldexp(np.full(4096, 1.0625 + 2.0 ** -12), np.arange(4096) % 13 - 4) / 416)
    ties = ties.astype(np.float32)
    ties[::128] = 1.0
    out, _, _ = round_trip(codec, ties)
    assert 0.05 < rel_l2(out, ties) <= codec.error_bound
    spiky = gaussian(4096, 5) * 1e-4
    spiky[::128] = 1.0
    out, _, _ = round_trip(codec, spiky)
    assert rel_l2(out, spiky) <= codec.error_bound


def test_measured_error_is_the_documented_one():
    """docs/compression.md lists fp8's error on 1 Mi N(0, 1) float32 values (seed 1, as
    for the other codecs); the figure must be within 10% of what the codec does."""
    x = gaussian(1 << 20, 1)
    err = rel_l2(round_trip(make_codec("fp8"), x)[0], x)
    assert err <= 1.2 * make_codec("fp8").typical_error
    m = re.search(r"^\| `fp8` \|[^|]*\|[^|]*\| ([0-9.e+-]+) \|", DOC.read_text(), re.M)
    assert m, "docs/compression.md has no row for fp8"
    assert abs(float(m.group(1)) - err) <= 0.1 * err, (m.group(1), err)


@settings(max_examples=80, deadline=None)
@given(f64=st.booleans(), n=st.integers(1, 700), exp2=st.integers(-1074, 1023),
       mant=st.floats(1.0, 1.999), spike=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_any_finite_block_decodes_finite_within_the_bound(f64, n, exp2, mant, spike, seed):
    """Any magnitude, float32 (normal or subnormal blocks) or any finite float64."""
    dtype = np.float64 if f64 else np.float32
    fi = np.finfo(dtype)
    exp2 = min(max(exp2, math.frexp(float(fi.smallest_normal))[1] + 12), fi.maxexp - 1)
    x64 = gaussian(n, seed, np.float64)
    if spike:
        x64 *= 1e-3
        x64[::128] = 1.0
    x = np.ldexp(x64 / np.abs(x64).max() * mant, exp2).astype(dtype)
    out, _, intact = round_trip(make_codec("fp8"), x)
    assert intact and np.isfinite(out).all()
    assert rel_l2(out, x) <= make_codec("fp8").error_bound


@pytest.mark.parametrize("scale", [1e-40, 1e-44, 3e38])
def test_float32_range_edges(scale):
    """float32 subnormal blocks (scaled by ldexp) and blocks at float32's maximum."""
    x = np.clip(gaussian(1000, 6).astype(np.float64) * scale, -3.4e38, 3.4e38).astype(np.float32)
    out, _, _ = round_trip(make_codec("fp8"), x)
    assert np.isfinite(out).all()
    if scale == 1e-44:  # a few multiples of 2^-149: integer codes, e4m3 keeps 4 bits
        assert rel_l2(out, x) <= make_codec("fp8").error_bound
    else:
        assert rel_l2(out, x) <= 0.035


@pytest.mark.parametrize("scale", [1e-300, 1e-320, 1e300])
def test_float64_outside_float32s_range(scale):
    x = gaussian(1000, 7, np.float64) * scale
    out, _, _ = round_trip(make_codec("fp8"), x)
    assert np.isfinite(out).all() and rel_l2(out, x) <= make_codec("fp8").error_bound


# --- NaN and Inf -------------------------------------------------------------------------
def test_nan_and_inf_survive_and_only_their_blocks_are_flagged():
    codec = make_codec("fp8")
    clean = gaussian(1000, 3)
    x = clean.copy()
    x[[5, 300, 301, 999]] = [np.nan, np.inf, -np.inf, np.nan]
    out, enc, intact = round_trip(codec, x)
    assert intact
    assert np.isnan(out[[5, 999]]).all() and out[300] == np.inf and out[301] == -np.inf
    fin = np.isfinite(x)
    assert np.isfinite(out[fin]).all() and rel_l2(out[fin], x[fin]) <= codec.error_bound
    words = enc[:4 * 8].view(np.uint32)
    assert ((words & cc._FLAG) != 0).tolist() == [True, False, True, False, False, False,
                                                  False, True]
    # the unflagged blocks hold exactly the bytes of the encoding without NaN/Inf
    _, ref, _ = round_trip(codec, clean)
    for b in (1, 3, 4, 5, 6):
        assert words[b] == ref[:32].view(np.uint32)[b]
        assert np.array_equal(enc[32 + 128 * b:32 + 128 * (b + 1)], ref[32 + 128 * b:32 + 128 * (b + 1)])


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_blocks_of_nothing_but_non_finite_values(fill):
    codec = make_codec("fp8")
    x = np.full(300, fill, np.float32)
    x[200] = -0.0
    out, _, intact = round_trip(codec, x)
    assert intact and np.array_equal(out[:200], x[:200], equal_nan=True)
    assert out[200] == 0 and np.array_equal(out[201:], x[201:], equal_nan=True)


def test_signed_zero_and_float64_output():
    codec = make_codec("fp8")
    x = np.array([-0.0, 0.0, 1.0, -2.0], np.float64)
    out, enc, _ = round_trip(codec, x)
    assert np.signbit(out[0]) and not np.signbit(out[1])
    assert out.dtype == np.float64 and rel_l2(out, x) <= codec.error_bound


# --- the compressed all-to-all's spec and plan (pure) --------------------------------------
def test_all_to_all_is_compressed_only_where_named(monkeypatch):
    """A bare MCRDL_COMPRESSION spec covers the three reducing/gathering ops, not
    all-to-all; the ``all_to_all=`` key (or the keyword) allows it."""
    monkeypatch.setenv("MCRDL_COMPRESSION", "int8")
    assert resolve(None, Op.ALL_GATHER, dt.float32) == Compression("int8")
    assert resolve(None, Op.ALL_TO_ALL, dt.float32) is None
    monkeypatch.setenv("MCRDL_COMPRESSION", "all_to_all=fp8,all_gather=fp16")
    assert resolve(None, Op.ALL_TO_ALL, dt.float32) == Compression("fp8")
    assert resolve(None, Op.REDUCE_SCATTER, dt.float32) is None
    assert resolve(None, Op.ALL_TO_ALL, dt.int32) is None  # process-wide: integers stay plain
    monkeypatch.setenv("MCRDL_COMPRESSION", "alltoall=fp8")
    with pytest.raises(InvalidArgumentError, match="all_to_all"):
        resolve(None, Op.ALL_TO_ALL, dt.float32)


def test_all_to_all_refusals():
    for name in ("fp8", "int8", "fp16", "bf16"):
        with pytest.raises(DtypeError, match="refuses int64"):
            resolve(name, Op.ALL_TO_ALL, dt.int64)
    assert resolve("none", Op.ALL_TO_ALL, dt.int64) == Compression("none")
    with pytest.raises(UnsupportedError, match="one algorithm"):
        resolve("int8@p2p", Op.ALL_TO_ALL, dt.float32)
    assert resolve("int8@a2a", Op.ALL_TO_ALL, dt.float32) == Compression("int8", "a2a")


def test_all_to_all_plans_byte_counts_from_element_counts():
    """Rank 1 of 3 sends 5, 0, 300 elements and receives 7, 0, 129: byte counts are the
    encodings' sizes, its own block moves none."""
    p = cz_spec.plan_all_to_all(Compression("fp8"), 3, 1, [7, 0, 129], [5, 0, 300])
    codec = make_codec("fp8")
    assert p.send_bytes == (codec.encoded_nbytes(5), 0, codec.encoded_nbytes(300))
    assert p.recv_bytes == (codec.encoded_nbytes(7), 0, codec.encoded_nbytes(129))
    assert p.raw_bytes == 305 * 4 and p.wire_bytes == 16 + 312
    assert "all_to_all a2a codec=fp8:128 P=3 rank=1" in str(p)
    p0 = cz_spec.plan_all_to_all(Compression("bf16"), 2, 0, [0, 0], [0, 0])
    assert p0.wire_bytes == 0 and sum(p0.recv_bytes) == 0
    even = plan(Op.ALL_TO_ALL, Compression("int8", chunks=4), 4, 1000)
    assert even.algorithm == "a2a" and even.chunks == 1
    assert even.wire_bytes == 3 * make_codec("int8").encoded_nbytes(1000)
    with pytest.raises(InvalidArgumentError, match="one per rank"):
        cz_spec.plan_all_to_all(Compression("fp8"), 3, 0, [1, 2], [1, 2, 3])


def test_torch_conversion_gives_the_same_bits():
    """The host fast path (torch's float8 conversion, used when torch is loaded) rounds
    like the bit arithmetic and ml_dtypes on every float32 the codec can meet."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    pos = np.arange(0, 0x43E80000, 11, dtype=np.uint32)
    for part in np.array_split(pos, 8):
        y = part.view(np.float32)
        y = np.concatenate([y, -y])
        assert np.array_equal(cc._e4m3_torch(y), y.astype(F8).view(np.uint8))


def _cupy_with_a_device():
    """CuPy, or a skip where it or a CUDA device is missing."""
    cupy = pytest.importorskip("cupy")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        devices = 0
    if devices < 1:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
def test_cupy_matches_numpy():
    """The same code on CuPy (no float8 type there: the bit arithmetic and the value
    table) gives the host's bytes and values, NaN/Inf included. Not run here: no GPU."""
    cupy = _cupy_with_a_device()
    codec = make_codec("fp8")
    for dtype in (np.float32, np.float64):
        x = gaussian(5001, 9, dtype)
        x[[3, 4000, 4001]] = [np.nan, -np.inf, np.inf]
        x[200:328] *= 1e-40 if dtype == np.float32 else 1e-300  # a block scaled by ldexp
        ref, ref_enc, _ = round_trip(codec, x)
        enc = cupy.zeros(codec.encoded_nbytes(x.shape[0]), cupy.uint8)
        codec.encode(cupy.asarray(x), enc)
        used = 4 * (-(-x.shape[0] // 128)) + x.shape[0]  # the padding is never written
        assert np.array_equal(cupy.asnumpy(enc)[:used], ref_enc[:used])
        out = cupy.empty(x.shape[0], dtype)
        assert codec.decode(enc, out)
        assert np.array_equal(cupy.asnumpy(out), ref, equal_nan=True)
