"""The host codecs' compiled inner loops (``codec_kernels.c``), loaded with ctypes.

``python -m mcrdl_core.tools.build_codecs`` (run by ``make install``) compiles the C
file with the system's C compiler into ``codec_kernels.so`` next to it. Where it is
built, from this version of the source, and ``MCRDL_CODEC_KERNELS`` is on (the
default), ``codecs.Int8``, ``codecs.FP8`` and ``codecs.FP16`` encode and decode
contiguous float32 host arrays through it: one pass per block in L1 instead of a
NumPy/torch pass per step over the whole array (1.2-4.5x faster here, by codec and
direction: docs/compression.md, "Compiled kernels"), with the same bytes and values
(``tests/test_codec_kernels.py`` compares the two paths). Without it every codec runs
its NumPy code, as on CuPy arrays. ``mcrdl info`` says which is in use.

Each function returns True when the kernel did the whole call; False sends the codec to
its Python path, which then writes every byte (the kernel declines inputs it does not
handle: other dtypes, non-contiguous arrays, and blocks that need the Python code's
slower branches: NaN/Inf, scales outside float32's normal range).

The floating-point mode: :func:`exact_fp_enter` / :func:`exact_fp_leave` put the calling
thread in IEEE's default mode (no flush-to-zero, no denormals-are-zero, rounding to
nearest) for one codec call and give its own mode back after; ``codecs.Codec`` wraps
every encode and decode in them, so a codec writes the same bytes on every thread (an
XLA thread running a jitted host callback has FTZ/DAZ set, as has a torch thread after
``torch.set_flush_denormal(True)``). They need the library (Python cannot set the
mode), whether or not ``MCRDL_CODEC_KERNELS`` lets the codecs use its kernels. Without
it, a codec call on a thread that flushes subnormals logs a warning once per process:
the results may then differ from other threads' where the data or its scaled values
are subnormal.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np

from ..base import config as _config

log = logging.getLogger("mcrdl.compress")

#: the source's KERNELS_VERSION this loader speaks to
VERSION = 3
SOURCE = Path(__file__).with_name("codec_kernels.c")
TARGET = SOURCE.with_name("codec_kernels.so")

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def load(path: Path = TARGET):
    """(the library at ``path`` or None, why not): refused where built from another
    version of the source."""
    if not Path(path).exists():
        return None, "not built: run python -m mcrdl_core.tools.build_codecs"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot be loaded ({exc}): rerun python -m mcrdl_core.tools.build_codecs"
    try:
        version = lib.mcrdl_codec_kernels_version()
    except AttributeError:
        version = None
    if version != VERSION:
        return None, (f"built from another version of codec_kernels.c ({version}, this is "
                      f"{VERSION}): rerun python -m mcrdl_core.tools.build_codecs")
    lib.mcrdl_absmax_encode.argtypes = [_ptr, _i64, _i64, _int, _int, _int, _ptr, _ptr]
    lib.mcrdl_absmax_decode.argtypes = [_ptr, _ptr, _i64, _i64, _int, _int, _int, _ptr]
    lib.mcrdl_fp16_encode.argtypes = [_ptr, _i64, _i64, _ptr, _ptr]
    lib.mcrdl_fp16_decode.argtypes = [_ptr, _ptr, _i64, _i64, _ptr]
    lib.mcrdl_fp16_simd.argtypes = [_int]
    lib.mcrdl_fp_exact_enter.argtypes = []
    lib.mcrdl_fp_exact_enter.restype = _i64
    lib.mcrdl_fp_exact_leave.argtypes = [_i64]
    lib.mcrdl_fp_exact_leave.restype = None
    return lib, "built"


_LIB, _WHY = load()


def library():
    """(the loaded library or None, why not), ``MCRDL_CODEC_KERNELS`` aside."""
    return _LIB, _WHY


def active():
    """The library where the codecs use it now: built and ``MCRDL_CODEC_KERNELS`` on."""
    return _LIB if _LIB is not None and _config.get("MCRDL_CODEC_KERNELS") else None


_SUBNORMAL = np.array([2.0 ** -140], np.float32)  # 2^-140: a float32 subnormal
_ONE = np.array([1.0], np.float32)
_WARNED: list = []


def exact_fp_enter() -> int:
    """Put this thread in IEEE's default floating-point mode for one codec call; returns
    what :func:`exact_fp_leave` needs to give the thread its own mode back (-1: it was
    in that mode already). Without the library nothing can be changed: a thread whose
    arithmetic flushes subnormals gets the warning once per process."""
    lib = _LIB
    if lib is not None:
        return lib.mcrdl_fp_exact_enter()
    if not _WARNED and not (_SUBNORMAL * _ONE)[0]:
        _WARNED.append(True)
        log.warning("mcrdl: a codec runs on a thread that flushes subnormal floats to zero "
                    "(FTZ/DAZ: a jax.jit host callback, torch.set_flush_denormal(True)) and "
                    "the codec kernels are %s, which set IEEE's default mode for each codec "
                    "call: results may differ from other threads' where values are "
                    "subnormal; run python -m mcrdl_core.tools.build_codecs", _WHY)
    return -1


def exact_fp_leave(saved: int) -> None:
    """Give the thread back the mode :func:`exact_fp_enter` found (``saved``)."""
    if saved >= 0:
        _LIB.mcrdl_fp_exact_leave(saved)


def _addr(a) -> int:
    return a.__array_interface__["data"][0]


def _f32(x) -> bool:
    return (type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 1
            and x.flags.c_contiguous and _addr(x) % 4 == 0)


def _bytes(a) -> bool:
    """A contiguous byte array whose start holds 4-byte words (as encodings' do)."""
    return (type(a) is np.ndarray and a.dtype == np.uint8 and a.flags.c_contiguous
            and _addr(a) % 4 == 0)


def _ready(vals, enc, nblocks: int, width: int):
    """(the library, the address of ``enc``) where the kernels can take these arrays:
    float32 values, and an encoding of ``nblocks`` 4-byte words then ``width`` bytes per
    value; None where the codec must take its Python path."""
    lib = active()
    if lib is None or not (_f32(vals) and _bytes(enc)
                           and enc.shape[0] >= 4 * nblocks + width * vals.shape[0]):
        return None
    return lib, _addr(enc)


def absmax_encode(x, out, nblocks: int, block: int, levels: int, kmax: int, kind: int) -> bool:
    """int8 (``kind`` 0) or fp8 (1) encoding of float32 ``x`` into ``out`` (words, then
    one byte per value)."""
    ready = _ready(x, out, nblocks, 1)
    if ready is None:
        return False
    lib, base = ready
    return lib.mcrdl_absmax_encode(_addr(x), x.shape[0], block, levels, kmax, kind, base,
                                   base + 4 * nblocks) == 0


def absmax_decode(enc, out, nblocks: int, block: int, levels: int, lo: int, kind: int) -> bool:
    """The inverse of ``absmax_encode`` into float32 ``out``."""
    ready = _ready(out, enc, nblocks, 1)
    if ready is None:
        return False
    lib, base = ready
    return lib.mcrdl_absmax_decode(base, base + 4 * nblocks, out.shape[0], block, levels, lo,
                                   kind, _addr(out)) == 0


def fp16_encode(x, out, nblocks: int, block: int) -> bool:
    """fp16 encoding of float32 ``x`` into ``out`` (int32 exponents, then float16)."""
    ready = _ready(x, out, nblocks, 2)
    if ready is None:
        return False
    lib, base = ready
    return lib.mcrdl_fp16_encode(_addr(x), x.shape[0], block, base, base + 4 * nblocks) == 0


def fp16_decode(enc, out, nblocks: int, block: int) -> bool:
    """The inverse of ``fp16_encode`` into float32 ``out``."""
    ready = _ready(out, enc, nblocks, 2)
    if ready is None:
        return False
    lib, base = ready
    return lib.mcrdl_fp16_decode(base, base + 4 * nblocks, out.shape[0], block, _addr(out)) == 0
