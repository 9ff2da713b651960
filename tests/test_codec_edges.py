"""Codec edge cases on one process, against NumPy references (issue 21, items 4 and 5).

- Zero elements are a no-op for every codec: a 0-byte encoding, nothing written, no call
  into zfpy (which dies of SIGBUS on an empty array, so those checks run in a child).
- Range edges: every lossy codec keeps its documented bound on float32 blocks of any
  magnitude (tiny blocks whose LEVELS/amax overflows float32, blocks at float32's
  maximum) and on float64 blocks of any finite magnitude, float32's range or not.
- The docs say what the code does (chunking threshold).
"""
import math
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcrdl_core.compress import Compression, make_codec, plan
from mcrdl_core.compress import spec as cz_spec
from mcrdl_core.base.ops import Op

try:
    import zfpy  # noqa: F401
    ZFP = ["zfp:3", "zfp:8", "zfp:16", "zfp:24", "zfp:32"]
except ImportError:
    ZFP = []

ROOT = Path(__file__).resolve().parent.parent
BOUNDED = ["bf16", "fp16", "fp16:64", "int8", "int8:64", "int4", "int4:32"]
ALL = ["none"] + BOUNDED + ZFP
F32, F64 = np.finfo(np.float32), np.finfo(np.float64)


def gaussian(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def round_trip(codec, x):
    enc = np.full(codec.encoded_nbytes(x.shape[0]), 0xAB, np.uint8)
    codec.encode(x, enc)
    out = np.full(x.shape[0], 7, x.dtype)
    intact = codec.decode(enc, out)
    return out, intact


def rel_l2(a, b):
    """||a - b|| / ||b||, scaled first so that neither norm over- or underflows."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = np.abs(b).max()
    return float(np.linalg.norm((a - b) / s) / np.linalg.norm(b / s))


# --- item 4: zero elements ---------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_zero_elements_are_a_no_op(name):
    """Encoding 0 values takes 0 bytes (as every plan of a 0-element call assumes) and
    touches nothing; decoding them reports an intact block. Run in a child process: on
    zfp the old code died of SIGBUS inside zfpy, which would take pytest with it."""
    code = f"""
import numpy as np
from mcrdl_core.compress import make_codec
c = make_codec({name!r})
assert c.encoded_nbytes(0) == 0, c.encoded_nbytes(0)
for dtype in (np.float32, np.float64):
    enc = np.zeros(0, np.uint8)
    c.encode(np.zeros(0, dtype), enc)
    assert c.decode(enc, np.zeros(0, dtype)) is True
    spare = np.full(16, 0xAB, np.uint8)  # a slot with room to spare stays untouched
    c.encode(np.zeros(0, dtype), spare)
    assert (spare == 0xAB).all()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr)


@pytest.mark.parametrize("name", ALL)
def test_zero_element_plans_move_no_bytes(name):
    """A 0-element compressed call plans 0 encoded bytes on the wire for every codec
    (zfp reserved a 32-byte stream slot for nothing)."""
    for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE):
        p = plan(op, Compression(name), 3, 0)
        assert (p.encoded_bytes, p.wire_bytes, p.ratio) == (0, 0, 1.0), (op, p)


# --- item 5: int8 / int4 on tiny blocks ----------------------------------------------------
def int_reference_error_bound(name, x):
    """Per element, what absmax quantization with LEVELS steps promises: |out - x| at most
    half a step (amax/LEVELS, amax the block's largest magnitude, in float64), plus the
    rounding of the decoded value to x's dtype. Computed in float64 from x alone."""
    codec = make_codec(name)
    x64 = x.astype(np.float64)
    n, b = x.shape[0], codec.block
    pad = np.zeros(-(-n // b) * b)
    pad[:n] = np.abs(x64)
    step = np.repeat(pad.reshape(-1, b).max(axis=1) / codec.LEVELS, b)[:n]
    ulp = np.spacing(np.abs(x).astype(x.dtype) + step.astype(x.dtype)).astype(np.float64)
    return step * (0.5 + 2.0 ** -16) + ulp


@pytest.mark.parametrize("name", ["int8", "int8:64", "int4", "int4:32"])
@pytest.mark.parametrize("exp2", [0, -100, -118, -121, -122, -126, -130, -135, -140, -145])
def test_int_codecs_keep_tiny_float32_blocks(name, exp2):
    """A block whose largest magnitude is below ~3.7e-37 used to decode as zeros
    (LEVELS/amax overflowed float32). Every value is now within half a quantization step
    of its input, and blocks whose steps stay above float32's subnormal spacing keep
    the same relative error as at magnitude 1."""
    codec = make_codec(name)
    x = (gaussian(1000, 7).astype(np.float64) * 2.0 ** exp2).astype(np.float32)
    out, intact = round_trip(codec, x)
    assert intact and np.isfinite(out).all()
    assert (np.abs(out.astype(np.float64) - x) <= int_reference_error_bound(name, x)).all()
    assert rel_l2(out, x) <= codec.error_bound
    if exp2 >= -121:  # steps are normal floats: the scale-free result of magnitude 1
        one, _ = round_trip(codec, gaussian(1000, 7))
        assert math.isclose(rel_l2(out, x), rel_l2(one, gaussian(1000, 7)), rel_tol=1e-3)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_int_codecs_on_float32_subnormal_blocks(name):
    """Blocks of subnormal float32 values (down to the smallest one, 2^-149) decode to
    nonzero values within half a step (plus float32's spacing there)."""
    codec = make_codec(name)
    for scale in (2.0 ** -149, 2.0 ** -140, 1e-40, 1e-38):
        x = np.round(gaussian(512, 3).astype(np.float64) * 40) * scale
        x = x.astype(np.float32)
        out, _ = round_trip(codec, x)
        assert np.count_nonzero(out) > 0, scale
        assert (np.abs(out.astype(np.float64) - x) <= int_reference_error_bound(name, x)).all()


# --- item 5: fp16 at float32's maximum, and a NumPy reference for fp16 ----------------------
def fp16_reference(x, block):
    """The documented scheme in float64: each block divided by 2^(e-15) (amax < 2^e), cast
    to float16 (NumPy, round to nearest even), multiplied back, then rounded to x's
    dtype with finite inputs saturating at its largest finite value."""
    x64 = x.astype(np.float64)
    out = np.empty_like(x64)
    fin = np.finfo(x.dtype).max
    for lo in range(0, x.shape[0], block):  # a reference, not the codec: a loop is fine
        b = x64[lo:lo + block]
        amax = np.abs(b[np.isfinite(b)]).max(initial=0.0)
        k = math.frexp(amax)[1] - 15 if amax > 0 else 0
        h = np.ldexp(b, -k).astype(np.float16).astype(np.float64)
        out[lo:lo + block] = np.ldexp(h, k)
    sat = np.isfinite(x64) & (np.abs(out) > fin)
    out[sat] = np.copysign(fin, out[sat])
    return out.astype(x.dtype)


def test_fp16_keeps_finite_values_at_float32s_maximum():
    """Values that round up to 2^128 under fp16's 11 bits used to decode as +-inf; they
    saturate at float32's largest value (closer to the input than 2^128 was)."""
    codec = make_codec("fp16")
    x = gaussian(3000, 2) * np.float32(5e37)
    x[[0, 1, 1500, 2999]] = [F32.max, -F32.max, np.float32(3.4e38), -np.float32(3.3999e38)]
    out, intact = round_trip(codec, x)
    assert intact and np.isfinite(out).all()
    assert out[0] == F32.max and out[1] == -F32.max
    assert np.array_equal(out, fp16_reference(x, codec.block))
    assert (np.abs(out.astype(np.float64) - x) <= 2.0 ** -11 * np.abs(x.astype(np.float64))).all()
    x[5] = np.inf  # a real infinity still arrives as one
    out, _ = round_trip(codec, x)
    assert out[5] == np.inf and np.isfinite(np.delete(out, 5)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fp16_matches_its_numpy_reference_at_every_magnitude(dtype):
    """Bit for bit the float64 reference of the documented scheme, from the smallest
    subnormal to the largest finite value of the dtype (each block's largest value
    has the dtype's largest mantissa, 2 - eps: the one fp16 rounds up to 2^e)."""
    codec = make_codec("fp16:256")
    fi = np.finfo(dtype)
    lo, hi = math.frexp(float(fi.smallest_subnormal))[1], fi.maxexp
    for e in list(range(lo, hi + 1, 7)) + [lo, lo + 1, hi - 1, hi]:
        g = np.clip(gaussian(700, e % 97).astype(np.float64), -1.9, 1.9)
        g[::256] = 2.0  # a maximum in every block
        x = np.ldexp(g / 2 * (2 - float(fi.eps)), e - 1).astype(dtype)
        with np.errstate(over="ignore"):  # the reference's float64 cast at float64's top
            ref = fp16_reference(x, 256)
        out, _ = round_trip(codec, x)
        assert np.array_equal(out, ref), e


# --- item 5: float64 data outside float32's range -----------------------------------------
@pytest.mark.parametrize("name", BOUNDED + ZFP[1:4])
@pytest.mark.parametrize("exp10", [-320, -310, -300, -200, -46, -40, 39, 100, 300, 307])
def test_float64_outside_float32s_range(name, exp10):
    """The docs promise float64 tensors are handled in float64: data far outside
    float32's range used to come back as inf, NaN or 0 under every lossy codec."""
    codec = make_codec(name)
    x = gaussian(2000, 5, np.float64) * 10.0 ** exp10
    out, intact = round_trip(codec, x)
    assert intact and np.isfinite(out).all(), (name, exp10)
    err = rel_l2(out, x)
    if codec.error_bound is not None:
        assert err <= codec.error_bound, (name, exp10, err)
    if exp10 >= -300:  # normal float64 values: the error of the same mantissas near 1
        near1 = np.ldexp(x, -math.frexp(10.0 ** exp10)[1])
        one, _ = round_trip(codec, near1)
        assert math.isclose(err, rel_l2(one, near1), rel_tol=1e-9), (name, exp10)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "bf16"])
def test_float64_power_of_two_scaling_is_exact(name):
    """Block scales are powers of two (fp16, bf16) or a mantissa and an exponent (int8,
    int4): multiplying the data by 2^p multiplies the decoded values by exactly 2^p,
    across float64's whole normal range."""
    codec = make_codec(name)
    x = gaussian(3000, 11, np.float64)
    base, _ = round_trip(codec, x)
    for p in (-1000, -500, -130, 130, 500, 1000):
        out, _ = round_trip(codec, np.ldexp(x, p))
        assert np.array_equal(out, np.ldexp(base, p)), p


def test_bf16_on_float64_matches_its_numpy_reference():
    """bf16 on float64 data: each block of 1024 divided by 2^(e-64) (amax < 2^e) before
    the cast to bfloat16 (ml_dtypes, through float32 as the codec does), so float64
    data of any magnitude keeps bfloat16's relative precision."""
    codec = make_codec("bf16")
    x = np.concatenate([gaussian(1024, 1, np.float64) * 1e300,
                        gaussian(1024, 2, np.float64) * 1e-300,
                        gaussian(1000, 3, np.float64)])
    ref = np.empty_like(x)
    for lo in range(0, x.shape[0], 1024):
        b = x[lo:lo + 1024]
        k = math.frexp(np.abs(b).max())[1] - 64
        h = np.ldexp(b, -k).astype(np.float32).astype(ml_dtypes.bfloat16)
        ref[lo:lo + 1024] = np.ldexp(h.astype(np.float64), k)
    out, _ = round_trip(codec, x)
    assert np.array_equal(out, ref)
    assert rel_l2(out, x) <= codec.error_bound


@pytest.mark.skipif(not ZFP, reason="zfpy is not installed")
@pytest.mark.parametrize("rate", [8, 16, 32])
@pytest.mark.parametrize("dtype,exps", [(np.float32, (-110, -100, -95, -60, 60, 125)),
                                        (np.float64, (-1000, -960, -500, 500, 1020))])
def test_zfp_is_exact_under_power_of_two_scaling(rate, dtype, exps):
    """zfp itself returns garbage (errors ~5x the data) for blocks below ~2^-94 (float32)
    or ~2^-958 (float64) and is exactly power-of-two invariant above: tiny encodings are
    scaled into its range first, so data of any magnitude decodes as the same mantissas
    near 1 do, times the power of two."""
    codec = make_codec(f"zfp:{rate}")
    x = gaussian(1001, rate, np.float64)
    x /= np.abs(x).max()
    base, _ = round_trip(codec, x.astype(dtype))
    for p in exps:
        out, intact = round_trip(codec, np.ldexp(x, p).astype(dtype))
        assert intact and np.array_equal(out, np.ldexp(base, p).astype(dtype)), p


@pytest.mark.skipif(not ZFP, reason="zfpy is not installed")
@pytest.mark.parametrize("rate", [8, 16, 32])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zfp_on_subnormal_data(rate, dtype):
    """Subnormal data decodes within the error zfp has on the same values scaled near 1
    plus the rounding of each decoded value to the dtype's subnormal spacing, instead
    of garbage."""
    codec = make_codec(f"zfp:{rate}")
    fi = np.finfo(dtype)
    for p in (fi.minexp - 4, fi.minexp - 12, fi.minexp - fi.nmant + 3):
        x = np.ldexp(gaussian(1001, rate, np.float64), p).astype(dtype)
        out, intact = round_trip(codec, x)
        near1 = np.ldexp(x.astype(np.float64), -p)
        ref, _ = round_trip(codec, near1.astype(dtype))
        spacing = math.ldexp(1.0, fi.minexp - fi.nmant - p)  # relative to near1
        grid = math.sqrt(x.shape[0]) * spacing / 2 / np.linalg.norm(near1)
        assert intact and rel_l2(out, x) <= rel_l2(ref, near1) + grid, p


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(BOUNDED), f64=st.booleans(), n=st.integers(1, 700),
       exp2=st.integers(-1074, 1023), mant=st.floats(1.0, 1.999), spike=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_any_finite_block_decodes_finite_within_the_bound(name, f64, n, exp2, mant, spike,
                                                          seed):
    """Whatever the magnitude: finite in, finite out, and the relative L2 error within the
    codec's stated bound (on data of float32's range for float32, any finite float64)."""
    dtype = np.float64 if f64 else np.float32
    fi = np.finfo(dtype)
    exp2 = min(max(exp2, math.frexp(float(fi.smallest_normal))[1] + 12), fi.maxexp - 1)
    x64 = gaussian(n, seed, np.float64)
    if spike:  # the worst case of absmax scaling: one spike per block over small values
        x64 *= 1e-3
        x64[::make_codec(name).block] = 1.0
    x64 = x64 / np.abs(x64).max() * mant
    x = np.ldexp(x64, exp2).astype(dtype)
    if name == "bf16" and not f64:
        x = np.clip(x, -3.3e38, 3.3e38)  # bf16 is a plain cast of float32 (see docs)
    out, intact = round_trip(make_codec(name), x)
    assert intact and np.isfinite(out).all()
    assert rel_l2(out, x) <= make_codec(name).error_bound


# --- docs say what the code does ------------------------------------------------------------
def test_docs_state_the_chunking_threshold_the_code_uses():
    """docs/compression.md's chunking rule, read from its text, against plan(): a ring
    block is cut only once its encoding reaches the stated size, into floor(encoded /
    CHUNK_BYTES) chunks, at most the stated number."""
    doc = (ROOT / "docs" / "compression.md").read_text()
    rule = (r"encoding is at least (\d+) MiB is cut into floor\(encoded bytes / (\d+) MiB\) "
            r"chunks, at most (\d+)")
    m = re.search(rule.replace(" ", r"\s+"), doc)
    assert m, "docs/compression.md does not state the chunking rule the code follows"
    threshold, per, most = (int(g) for g in m.groups())
    assert (per << 20, most) == (cz_spec.CHUNK_BYTES, cz_spec.MAX_CHUNKS)
    codec = make_codec("fp16")
    for count in (1 << 18, (threshold << 20) // 2 - 4096, (threshold << 20) // 2,
                  (threshold << 20) // 2 + 4096, 5 << 20, 64 << 20):
        enc = codec.encoded_nbytes(count)
        expect = 1 if enc < threshold << 20 else min(most, enc // (per << 20))
        assert plan(Op.ALL_GATHER, Compression("fp16"), 2, count).chunks == expect, count
        assert plan(Op.ALL_GATHER, Compression("fp16", "p2p"), 2, count).chunks == 1
