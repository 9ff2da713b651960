"""Every codec gives the same bytes and decoded bits whatever the calling thread's
floating-point mode (issue 48, defect 16; DESIGN.md, "Exact unless asked").

``torch.set_flush_denormal(True)`` sets flush-to-zero and denormals-are-zero on this
thread (x86's MXCSR FTZ and DAZ), the mode of the XLA threads that run a jitted host
callback. Each codec (none in every storage dtype, fp16, bf16, int8, int4, fp8 at their
default and a small block size, zfp) encodes and decodes float32 and float64 data with
subnormals, tiny and huge blocks, blocks whose small values land in the formats'
subnormal codes, zeros and non-finite values, in the normal mode and under FTZ/DAZ, on
the compiled kernels and on the NumPy/torch path (fp16: both of its kernels): bit for
bit the same. So do the 256 fp8 codes and arbitrary bytes decoded, a thread of its
own in FTZ/DAZ, and the thread's mode is its own again after each call. The jitted
collective against the eager one is in tests/mpi/test_seams_numerics.py."""
import logging
import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from mcrdl_core.compress import make_codec, native
from test_codec_kernels import lib  # noqa: F401  (fixture: the library, built if need be)

CODECS = ["fp16", "fp16:16", "bf16", "int8", "int8:16", "int4", "int4:16", "fp8", "fp8:16",
          "zfp:8", "zfp:16"]
STORAGE = ["float32", "float64", "float16", "bfloat16"]  # of the 'none' codec
_SUB = np.array([2.0 ** -140], np.float32)


def _flushes() -> bool:
    return not (_SUB * np.float32(1.0))[0]


class _Flush:
    """FTZ/DAZ on this thread inside the block (torch.set_flush_denormal)."""

    def __enter__(self):
        assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
        assert _flushes()

    def __exit__(self, *exc):
        torch.set_flush_denormal(False)
        assert not _flushes()


@pytest.fixture
def paths(lib, monkeypatch):
    """The codec paths to compare: (name, setter) for the kernels (fp16: F16C and bit
    arithmetic) and the NumPy/torch path."""
    monkeypatch.setattr(native, "_LIB", lib)

    def use(kernels: bool, simd: int = 1):
        monkeypatch.setenv("MCRDL_CODEC_KERNELS", "1" if kernels else "0")
        lib.mcrdl_fp16_simd(simd)
    yield [("kernels", lambda: use(True)), ("kernels-bits", lambda: use(True, 0)),
           ("python", lambda: use(False))]
    lib.mcrdl_fp16_simd(1)


def _data(dtype):
    """Blocks of many kinds, each 256 values (a multiple of every block size here)."""
    rng = np.random.default_rng(7)
    g = rng.standard_normal
    with np.errstate(over="ignore", under="ignore"):
        parts = [g(256), g(256) * 2.0 ** -130, g(256) * 2.0 ** -146,  # subnormal float32
                 g(256) * 1e-38, g(256) * 3e38 / 4, g(256) * 2.0 ** -60,
                 g(256) * 2.0 ** rng.integers(-40, 1, 256),  # small ones: subnormal codes
                 np.where(np.arange(256) % 128 == 0, 1000.0, g(256) * 1e-3),
                 np.zeros(256), -np.zeros(256)]
        special = g(256)
        special[[3, 100, 200]] = [np.nan, np.inf, -np.inf]
        parts.append(special)
        if dtype == np.float64:  # float64 data beyond float32's range, both ways
            parts += [g(256) * 1e-300, g(256) * 2.0 ** -1060, g(256) * 1e300]
        x = np.concatenate(parts).astype(dtype)
    return np.concatenate([x, x[:77]])  # and a partial last block


def _round_trip(codec, x):
    enc = np.full(codec.encoded_nbytes(x.shape[0]), 0xAB, np.uint8)
    with np.errstate(all="ignore"):
        codec.encode(x, enc)
        out = np.full(x.shape[0], 7, x.dtype)
        ok = codec.decode(enc, out)
    return enc, out.view(np.uint8).copy(), ok


def _same_in_both_modes(fn, what):
    want = fn()
    with _Flush():
        got = fn()
    for i, (a, b) in enumerate(zip(want, got)):
        if isinstance(a, np.ndarray):
            diff = int((a != b).sum())
            assert diff == 0, f"{what}: part {i}: {diff} bytes differ under FTZ/DAZ"
        else:
            assert a == b, what
    return want


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CODECS)
def test_a_codec_gives_the_same_bytes_under_ftz_daz(paths, name, dtype):
    codec = make_codec(name)
    x = _data(dtype)
    results = []
    for path, use in paths:
        if path == "kernels-bits" and not name.startswith("fp16"):
            continue
        use()
        results.append(_same_in_both_modes(lambda: _round_trip(codec, x),
                                           f"{name} {np.dtype(dtype).name} on {path}"))
    for r in results[1:]:  # and the paths agree with each other, as ever
        assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])


@pytest.mark.parametrize("storage", STORAGE)
def test_the_exact_codec_gives_the_same_bytes_under_ftz_daz(storage):
    codec = make_codec("none", storage)
    for dtype in (np.float32, np.float64):
        x = _data(dtype)
        _same_in_both_modes(lambda: _round_trip(codec, x), f"none:{storage} on {dtype}")


def test_every_fp8_code_decodes_the_same_under_ftz_daz(paths):
    """All 256 codes (NaN codes in a block of their own, which the kernel hands to the
    Python path) under a scale that keeps every value normal, and under one that
    makes the decoded values subnormal."""
    codec = make_codec("fp8")
    codes = np.arange(256, dtype=np.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    for amax in (416.0, 1.0, 2.0 ** -120):
        x = np.full(3 * 128, amax, np.float32)
        enc = np.zeros(codec.encoded_nbytes(x.shape[0]), np.uint8)
        codec.encode(x, enc)  # three unflagged scale words of amax
        payload = enc[12:12 + 384]
        payload[:128], payload[128:256] = codes[:128], codes[128:]
        payload[256:] = finite[:128]
        for path, use in paths:
            use()

            def decode():
                out = np.zeros(384, np.float32)
                codec.decode(enc, out)
                return (out.view(np.uint32).copy(),)
            got = _same_in_both_modes(decode, f"fp8 codes at amax {amax} on {path}")[0]
            if amax == 416.0:  # then each finite code decodes as its own e4m3 value
                want = finite[:128].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                assert np.array_equal(got[256:], want.view(np.uint32)), path


@pytest.mark.parametrize("name", ["fp16", "int8", "fp8", "bf16", "int4"])
def test_decoding_any_bytes_is_the_same_under_ftz_daz(paths, name):
    codec = make_codec(name)
    rng = np.random.default_rng(3)
    n = 1000
    for _ in range(3):
        enc = rng.integers(0, 256, codec.encoded_nbytes(n), dtype=np.uint8)
        words = enc[:4 * codec.nblocks(n)].view(np.uint32)
        words &= np.uint32(0x7FFFFFFF)  # unflagged: the kernels take most of them
        if name in ("fp16", "bf16"):
            words[...] = (words.view(np.int32) % 300 - 150).view(np.uint32)
        for path, use in paths:
            use()

            def decode():
                out = np.zeros(n, np.float32)
                with np.errstate(all="ignore"):
                    ok = codec.decode(enc, out)
                return out.view(np.uint32).copy(), ok
            _same_in_both_modes(decode, f"{name}: decoding random bytes on {path}")


def test_a_thread_of_its_own_in_ftz_daz_and_the_mode_is_given_back(paths):
    """A thread that sets the mode for itself (as XLA's do) encodes as the main thread;
    after each call the thread is in its own mode again, on every path."""
    x = _data(np.float32)
    for path, use in paths:
        use()
        want = {n: _round_trip(make_codec(n), x) for n in ("fp8", "fp16", "int8", "bf16")}
        got, modes = {}, []

        def worker():
            torch.set_flush_denormal(True)
            for n in want:
                got[n] = _round_trip(make_codec(n), x)
                modes.append(_flushes())
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert modes == [True] * len(want), f"{path}: the thread's mode was not given back"
        for n in want:
            assert np.array_equal(got[n][0], want[n][0]), f"{n} on {path}: bytes differ"
            assert np.array_equal(got[n][1], want[n][1]), f"{n} on {path}: values differ"
        assert not _flushes()


def test_without_the_library_a_flushing_thread_gets_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_WARNED", [])
    x = _data(np.float32)
    with caplog.at_level(logging.WARNING, logger="mcrdl.compress"):
        _round_trip(make_codec("fp8"), x)
        assert not caplog.records  # the normal mode: nothing to say
        with _Flush():
            _round_trip(make_codec("fp8"), x)
            _round_trip(make_codec("fp8"), x)
    assert len(caplog.records) == 1 and "build_codecs" in caplog.records[0].getMessage()
