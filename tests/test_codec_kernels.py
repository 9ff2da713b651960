"""The host codecs' compiled kernels (mcrdl_core/compress/codec_kernels.c, loaded by
``compress.native``) against the codecs' NumPy/torch path: the same bytes and the same
decoded bits for int8, fp8 and fp16 at any block size, count and magnitude, with zeros,
signed zeros, subnormals, NaN and Inf mixed in (the kernels hand those blocks back to the
Python path, which must then produce the whole result); decoding arbitrary bytes agrees
too. The kernels must really run on ordinary data (not silently decline), decline what
they do not handle, stay off under MCRDL_CODEC_KERNELS=0, and a library built from
another version of the source is refused. fp16 has two kernels (the CPU's F16C
conversions where it has them, and bit arithmetic): both are checked against the Python
path. Where ``make install`` did not build the library, the tests build one of their own:
nothing here is skipped."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcrdl_core.compress import make_codec, native
from mcrdl_core.tools import build_codecs


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The library the codecs use: the installed one, else one built here."""
    found, why = native.library()
    if found is not None:
        return found
    path = build_codecs.build(quiet=True, out=tmp_path_factory.mktemp("kernels") / "k.so")
    found, why = native.load(path)
    assert found is not None, why
    return found


@pytest.fixture
def kernels(lib, monkeypatch):
    """Switch between the kernels (True) and the Python path (False)."""
    monkeypatch.setattr(native, "_LIB", lib)

    def use(on: bool):
        monkeypatch.setenv("MCRDL_CODEC_KERNELS", "1" if on else "0")
    yield use
    lib.mcrdl_fp16_simd(1)


def cpu_has_f16c() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f
                      if line.startswith("flags")), [])
    return "avx2" in flags and "f16c" in flags


def fp16_kernels(lib, name: str) -> list:
    """The fp16 kernels to compare (1: F16C, 0: bit arithmetic); one pass for the
    other codecs. The F16C one must be in use wherever the CPU has it."""
    if name != "fp16":
        return [None]
    lib.mcrdl_fp16_simd(1)
    simd = lib.mcrdl_fp16_simd(-1)
    assert simd == (platform.machine() == "x86_64" and cpu_has_f16c()), simd
    return [1, 0] if simd else [0]


def round_trip(codec, x):
    enc = np.full(codec.encoded_nbytes(x.shape[0]), 0xAB, np.uint8)
    codec.encode(x, enc)
    out = np.full(x.shape[0], 7, np.float32)
    ok = codec.decode(enc, out)
    return enc, out.view(np.uint32), ok


def both(kernels, codec, x):
    kernels(False)
    want = round_trip(codec, x)
    lib = native._LIB
    for simd in fp16_kernels(lib, codec.kind):
        if simd is not None:
            lib.mcrdl_fp16_simd(simd)
        kernels(True)
        got = round_trip(codec, x)
        assert np.array_equal(got[0], want[0]), f"{codec} (simd {simd}): bytes differ"
        assert np.array_equal(got[1], want[1]), f"{codec} (simd {simd}): decoded bits differ"
        assert got[2] == want[2]


CODECS = ["int8", "fp8", "fp16"]
SPECIAL = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-40, 1.1754944e-38,
                    3.4028235e38, -3.4028235e38], np.float32)


@st.composite
def data(draw):
    n = draw(st.integers(1, 2100))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 2.0 ** draw(st.integers(-150, 127))
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    for _ in range(draw(st.integers(0, 4))):  # a few special values at random places
        x[rng.integers(n)] = SPECIAL[rng.integers(SPECIAL.shape[0])]
    if draw(st.booleans()):  # whole blocks of zeros
        x[: n // 2] = 0.0
    return x


# the fixture only sets the variable each input reads: nothing to reset between inputs
@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(CODECS), st.sampled_from([2, 16, 128, 256, 1024]), data())
def test_the_kernels_give_the_python_paths_bytes_and_values(kernels, name, block, x):
    both(kernels, make_codec(f"{name}:{block}"), x)


def test_ordinary_and_edge_data_at_the_default_blocks(kernels):
    rng = np.random.default_rng(7)
    for name in CODECS:
        codec = make_codec(name)
        for n in (1, 2, 127, 128, 129, 1023, 1024, 1025, 100_003):
            for scale in (1e-38, 1e-30, 1e-6, 1.0, 3.7, 1e20, 3e38):
                with np.errstate(over="ignore"):
                    x = (rng.standard_normal(n) * scale).astype(np.float32)
                both(kernels, codec, x)
        # every finite float32 magnitude, in blocks of neighbours
        bits = rng.integers(0, 0x7F800000, 200_000, dtype=np.uint32)
        bits |= rng.integers(0, 2, bits.shape[0], dtype=np.uint32) << 31
        both(kernels, codec, np.sort(bits).view(np.float32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the Python path on garbage
# the fixture only sets the variable each input reads: nothing to reset between inputs
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(CODECS), st.integers(1, 700), st.integers(0, 2 ** 32 - 1),
       st.sampled_from(["random", "plausible"]))
def test_decoding_any_bytes_agrees(kernels, name, n, seed, words):
    """What a peer sends is decoded alike whatever it holds: random payloads (NaN and
    Inf codes too) under random or plausible scale words."""
    codec = make_codec(name)
    rng = np.random.default_rng(seed)
    enc = rng.integers(0, 256, codec.encoded_nbytes(n), dtype=np.uint8)
    nb = codec.nblocks(n)
    if words == "plausible":
        w = enc[:4 * nb].view(np.uint32)
        if name == "fp16":
            w.view(np.int32)[...] = rng.integers(-140, 130, nb)
        else:
            w[...] = ((rng.integers(900, 1300, nb).astype(np.uint32) << 19)
                      | rng.integers(0, 1 << 19, nb).astype(np.uint32))
    def decoded(on: bool):
        kernels(on)
        out = np.full(n, 7, np.float32)
        ok = codec.decode(enc, out)
        return out.view(np.uint32), ok
    want = decoded(False)
    for simd in fp16_kernels(native._LIB, name):
        if simd is not None:
            native._LIB.mcrdl_fp16_simd(simd)
        got = decoded(True)
        assert np.array_equal(got[0], want[0]) and got[1] == want[1], simd


def test_the_kernels_run_on_ordinary_data_and_decline_the_rest(kernels):
    kernels(True)
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    for name, kind in (("int8", 0), ("fp8", 1)):
        codec = make_codec(name)
        nb, L = codec.nblocks(x.shape[0]), codec.LEVELS
        enc = np.zeros(codec.encoded_nbytes(x.shape[0]), np.uint8)
        args = (nb, codec.block, L)
        assert native.absmax_encode(x, enc, *args, 128 - (2 * L).bit_length(), kind)
        out = np.zeros_like(x)
        assert native.absmax_decode(enc, out, *args, L.bit_length() + 1, kind)
        y = x.copy()
        y[100] = np.nan  # the Python path's flagged blocks
        assert not native.absmax_encode(y, enc, *args, 128 - (2 * L).bit_length(), kind)
        assert not native.absmax_encode(x.astype(np.float64), enc, *args, 120, kind)
        assert not native.absmax_encode(x[::2], enc, *args, 120, kind)  # not contiguous
        shifted = np.zeros(enc.shape[0] + 1, np.uint8)[1:]  # words not 4-byte aligned
        assert not native.absmax_encode(x, shifted, *args, 120, kind)
    codec = make_codec("fp16")
    enc = np.zeros(codec.encoded_nbytes(x.shape[0]), np.uint8)
    assert native.fp16_encode(x, enc, codec.nblocks(x.shape[0]), codec.block)
    assert native.fp16_decode(enc, np.zeros_like(x), codec.nblocks(x.shape[0]), codec.block)
    kernels(False)
    assert native.active() is None
    assert not native.fp16_encode(x, enc, codec.nblocks(x.shape[0]), codec.block)


def test_float64_and_misaligned_arrays_take_the_python_path_with_the_same_result(kernels):
    codec = make_codec("int8")
    x = np.random.default_rng(2).standard_normal(3000)
    kernels(True)
    a = round_trip(codec, x.astype(np.float32))
    raw = np.zeros(x.shape[0] * 4 + 1, np.uint8)
    shifted = raw[1:].view(np.float32)  # a float32 view at an odd address
    shifted[...] = x.astype(np.float32)
    b = round_trip(codec, shifted)
    assert all(np.array_equal(p, q) for p, q in zip(a[:2], b[:2]))
    kernels(False)
    assert all(np.array_equal(p, q) for p, q in zip(a[:2], round_trip(codec, shifted)[:2]))


def test_a_library_from_another_source_version_is_refused(lib, monkeypatch):
    path = lib._name
    monkeypatch.setattr(native, "VERSION", native.VERSION + 1)
    found, why = native.load(path)
    assert found is None and "another version of codec_kernels.c" in why
    assert "build_codecs" in why
    found, why = native.load(os.path.join(os.path.dirname(path), "missing.so"))
    assert found is None and "not built" in why


def test_the_build_command_and_its_failure(tmp_path):
    out = build_codecs.build(quiet=True, out=tmp_path / "k.so")
    found, why = native.load(out)
    assert found is not None, why
    proc = subprocess.run([sys.executable, "-m", "mcrdl_core.tools.build_codecs"],
                          capture_output=True, text=True,
                          env={**os.environ, "CC": str(tmp_path / "no-such-cc")})
    assert proc.returncode != 0
    assert "no C compiler found (CC=" in proc.stderr and "set CC" in proc.stderr, proc.stderr
