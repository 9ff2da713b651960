"""Codecs: a 1-D block of floats <-> a byte string whose size depends only on the
element count (no size exchange is ever needed between ranks).

Every codec works on NumPy arrays and on CuPy arrays with the same code (the array
module is taken from the input: ``xp = cupy`` for CUDA buffers), except ``zfp`` (zfpy
is CPU-only). Nothing loops over elements in Python: per-block scales are reductions
over a (blocks, block size) view, quantization is one vectorised expression per array.

Interface (:class:`Codec`):

- ``encoded_nbytes(n)``: bytes of the encoding of ``n`` elements, a multiple of 8
  (so encodings packed one after another keep float32 scales aligned on the GPU);
- ``encode(x, out)``: ``x`` a contiguous 1-D float32/float64 array of ``n`` elements,
  ``out`` a uint8 array of ``encoded_nbytes(n)`` bytes;
- ``decode(enc, out) -> bool``: writes ``n`` values into the float array ``out``;
  returns False only when the block could not be carried (zfp and non-finite input);
- ``error_bound``: a guaranteed bound on the relative L2 error of one round trip
  (``||decode(encode(x)) - x|| / ||x||`` over finite data), or None where the format
  gives none (zfp). ``typical_error`` is what the tests measure on Gaussian data.

NaN and Inf. ``bf16`` and ``fp16`` carry them as themselves (the scale is computed
from the finite values). ``int8``/``int4`` reserve three codes (NaN, -Inf, +Inf) so
non-finite values survive exactly; a block holding one is flagged by a negative
scale, and only flagged blocks take the slower path. ``zfp`` is undefined on non-finite
input: such a block is not encoded but flagged, decodes as NaN and the collective
raises :class:`~mcrdl_core.errors.NonFiniteError` on every rank whose result depends on
it, after the collective has finished (no rank is left waiting).
"""
from __future__ import annotations

import math
import sys

import numpy as np

from ..errors import InvalidArgumentError, McrdlError, UnsupportedError


class NonFiniteError(McrdlError, ValueError):
    """A codec that cannot carry NaN/Inf (zfp) met them; the message names the codec and
    says which codecs carry them."""


def _xp(arr):
    """numpy or cupy, whichever owns ``arr``."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # lazy: only CUDA buffers get here

    return cupy


def _round8(n: int) -> int:
    return (n + 7) & ~7


def _blocks(x, block: int):
    """(rows of full blocks as a 2-D view, the tail as a 1-row 2-D view or None)."""
    n = x.shape[0]
    full = n // block
    body = x[:full * block].reshape(full, block)
    tail = x[full * block:].reshape(1, n - full * block) if n % block else None
    return body, tail


def _absmax_rows(x2, xp):
    """Per-row max |x| over finite values, and the mask of rows that hold NaN/Inf."""
    if x2.shape[1] == 0:
        return xp.zeros(x2.shape[0], x2.dtype), xp.zeros(x2.shape[0], bool)
    amax = xp.maximum(x2.max(axis=1), -x2.min(axis=1))  # two passes, no |x| temporary
    bad = ~xp.isfinite(amax)
    if bool(bad.any()):  # rare: recompute those rows over their finite values only
        rows = x2[bad]
        amax[bad] = xp.where(xp.isfinite(rows), xp.abs(rows), 0).max(axis=1)
    return amax, bad


class Codec:
    """Base class; see the module docstring for the contract."""

    name = "codec"
    lossy = True
    error_bound: float | None = None
    typical_error: float | None = None
    gpu_reason: str | None = None  # None: works on CuPy arrays too

    def encoded_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, x, out) -> None:
        raise NotImplementedError

    def decode(self, enc, out) -> bool:
        raise NotImplementedError

    def ratio(self, n: int, itemsize: int = 4) -> float:
        """Compression ratio for ``n`` elements of ``itemsize`` bytes."""
        return n * itemsize / self.encoded_nbytes(n) if n else 1.0

    def check_device(self, kind: str) -> None:
        if kind == "cuda" and self.gpu_reason:
            raise UnsupportedError(f"codec {self.name!r} cannot run on CUDA buffers: "
                                   f"{self.gpu_reason}; use int8, int4, fp16 or bf16 there")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class Identity(Codec):
    """No compression: the values as ``storage`` dtype bytes (the uncompressed ring)."""

    lossy = False
    error_bound = 0.0
    typical_error = 0.0

    def __init__(self, storage):
        self.storage = np.dtype(storage)
        self.bf16 = self.storage.name == "bfloat16"  # carried as uint16 bits (CuPy has no bf16)
        self.name = "none"

    def encoded_nbytes(self, n: int) -> int:
        return _round8(n * self.storage.itemsize)

    def encode(self, x, out) -> None:
        n = x.shape[0]
        if self.bf16:
            out[:2 * n].view(np.uint16)[...] = _bf16_bits(x, _xp(x))
        else:
            out[:n * self.storage.itemsize].view(self.storage)[...] = x

    def decode(self, enc, out) -> bool:
        n = out.shape[0]
        if self.bf16:
            out[...] = _bf16_values(enc[:2 * n].view(np.uint16), _xp(out), out.dtype)
        else:
            out[...] = enc[:n * self.storage.itemsize].view(self.storage)
        return True


def _bf16_bits(x, xp):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (u >> 16) | 0x40, rounded).astype(xp.uint16)


def _bf16_values(bits, xp, dtype):
    v = (bits.astype(xp.uint32) << 16).view(xp.float32)
    return v if dtype == xp.float32 else v.astype(dtype)


class BF16(Codec):
    """bfloat16 cast (round to nearest even): 8 significant bits, float32's range."""

    name = "bf16"
    error_bound = 2.0 ** -8  # unit roundoff of an 8-bit significand
    typical_error = 1.7e-3

    def encoded_nbytes(self, n: int) -> int:
        return _round8(2 * n)

    def encode(self, x, out) -> None:
        out[:2 * x.shape[0]].view(np.uint16)[...] = _bf16_bits(x, _xp(x))

    def decode(self, enc, out) -> bool:
        xp = _xp(out)
        out[...] = _bf16_values(enc[:2 * out.shape[0]].view(np.uint16), xp, out.dtype)
        return True


class _Blocked(Codec):
    """Common layout: ``nblocks`` float32 scales, then the payload, padded to 8 bytes."""

    def __init__(self, block: int):
        if block < 2 or block % 2:
            raise InvalidArgumentError(f"codec {self.kind}: block size {block} must be an even "
                                       "number >= 2 (e.g. 256)")
        self.block = int(block)
        self.name = f"{self.kind}:{self.block}"

    def nblocks(self, n: int) -> int:
        return -(-n // self.block)

    def payload_nbytes(self, n: int) -> int:
        raise NotImplementedError

    def encoded_nbytes(self, n: int) -> int:
        return _round8(4 * self.nblocks(n) + self.payload_nbytes(n))

    def _parts(self, enc, n: int):
        nb = self.nblocks(n)
        return enc[:4 * nb].view(np.float32), enc[4 * nb:4 * nb + self.payload_nbytes(n)]

    def encode(self, x, out) -> None:
        n = x.shape[0]
        scales, payload = self._parts(out, n)
        body, tail = _blocks(x, self.block)
        nfull = body.shape[0]
        self._encode_rows(body, scales[:nfull], payload[:self.payload_nbytes(nfull * self.block)])
        if tail is not None:
            self._encode_rows(tail, scales[nfull:], payload[self.payload_nbytes(nfull * self.block):])

    def decode(self, enc, out) -> bool:
        n = out.shape[0]
        scales, payload = self._parts(enc, n)
        body, tail = _blocks(out, self.block)
        nfull = body.shape[0]
        self._decode_rows(scales[:nfull], payload[:self.payload_nbytes(nfull * self.block)], body)
        if tail is not None:
            self._decode_rows(scales[nfull:], payload[self.payload_nbytes(nfull * self.block):],
                              tail)
        return True


class FP16(_Blocked):
    """float16 after dividing each block by a power of two, so that the block's largest
    finite magnitude lands in [2^14, 2^15): no overflow whatever the range, and the
    power-of-two scale adds no rounding of its own. Host casts go through ``_half``."""

    kind = "fp16"
    error_bound = 2.0 ** -11  # float16's unit roundoff (values within 2^-24 of the block max
    typical_error = 2.2e-4    # underflow to subnormals; they are below that bound's share)

    def __init__(self, block: int = 1024):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return 2 * n

    def _encode_rows(self, x2, scales, payload) -> None:
        xp = _xp(x2)
        amax, _ = _absmax_rows(x2, xp)
        _, e = xp.frexp(amax.astype(xp.float32))  # amax < 2^e
        e = xp.clip(e, -110, 128)  # keeps 1/scale finite in float32 for tiny blocks
        scale = xp.ldexp(xp.ones_like(amax, dtype=xp.float32), e - 15)
        scale[amax == 0] = 1.0
        scales[...] = scale
        h = payload.view(np.float16).reshape(x2.shape)
        inv = (1.0 / scale).astype(x2.dtype)[:, None]
        if not _half(h, x2 * inv):
            xp.multiply(x2, inv, out=h, casting="unsafe")

    def _decode_rows(self, scales, payload, out2) -> None:
        h = payload.view(np.float16).reshape(out2.shape)
        xp = _xp(out2)
        if _half(out2, h):
            out2 *= scales.astype(out2.dtype)[:, None]
        else:
            xp.multiply(h, scales.astype(out2.dtype)[:, None], out=out2)


def _half(dst, src) -> bool:
    """dst[...] = src between float32 and float16 host arrays through torch's vectorised
    conversion, when torch is already loaded in this process (the core never imports it):
    NumPy's float16 casts run ~10x slower here (16 MiB: 15 ms vs 1.3 ms of CPU). Both
    round to nearest even, so the bits are the same either way. False: not done."""
    torch = sys.modules.get("torch")
    if (torch is None or not isinstance(dst, np.ndarray) or not src.flags.writeable
            or not (dst.flags.c_contiguous and src.flags.c_contiguous)
            or {dst.dtype, src.dtype} != {np.dtype(np.float16), np.dtype(np.float32)}):
        return False
    torch.from_numpy(dst).copy_(torch.from_numpy(src))
    return True


class _IntQ(_Blocked):
    """Symmetric integer quantization with one float32 scale per block (ZeRO++ style).
    Finite values map to [-L, L]; the codes NAN, NINF, PINF are reserved so NaN/Inf
    survive. A block holding any of them stores its scale negated (the flag)."""

    LEVELS = 0
    NAN = NINF = PINF = 0

    def __init__(self, block: int):
        super().__init__(block)
        # worst case: every value half a step from its block's maximum
        self.error_bound = math.sqrt(self.block) / (2 * self.LEVELS)

    def _quantize(self, x2, scales):
        xp = _xp(x2)
        amax, bad = _absmax_rows(x2, xp)
        scale = (amax / self.LEVELS).astype(xp.float32)
        inv = xp.where(amax > 0, self.LEVELS / xp.where(amax > 0, amax, 1), 0).astype(x2.dtype)
        q = xp.rint(x2 * inv[:, None])
        if bool(bad.any()):
            rows = x2[bad]
            qb = xp.nan_to_num(q[bad], nan=0.0, posinf=0.0, neginf=0.0)
            qb = xp.where(xp.isnan(rows), self.NAN, qb)
            qb = xp.where(rows == xp.inf, self.PINF, qb)
            q[bad] = xp.where(rows == -xp.inf, self.NINF, qb)
            scale[bad] = -xp.maximum(scale[bad], xp.finfo(xp.float32).tiny)
        scales[...] = scale
        return q.astype(xp.int8)

    def _dequantize(self, q, scales, out2) -> None:
        xp = _xp(out2)
        xp.multiply(q, xp.abs(scales).astype(out2.dtype)[:, None], out=out2)
        bad = scales < 0
        if bool(bad.any()):
            qb, ob = q[bad], out2[bad]
            ob = xp.where(qb == self.NAN, xp.nan, ob)
            ob = xp.where(qb == self.PINF, xp.inf, ob)
            out2[bad] = xp.where(qb == self.NINF, -xp.inf, ob)


class Int8(_IntQ):
    """int8 codes, one float32 scale per block (default 256 values): ratio ~3.94 on
    float32. Worst-case relative L2 error sqrt(block)/(2*126) (every value at half a
    step from its block's maximum); ~7e-3 on Gaussian data."""

    kind = "int8"
    LEVELS = 126
    NAN, NINF, PINF = -128, -127, 127
    typical_error = 8e-3

    def __init__(self, block: int = 256):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return n

    def _encode_rows(self, x2, scales, payload) -> None:
        payload.view(np.int8).reshape(x2.shape)[...] = self._quantize(x2, scales)

    def _decode_rows(self, scales, payload, out2) -> None:
        self._dequantize(payload.view(np.int8).reshape(out2.shape), scales, out2)


class Int4(_IntQ):
    """4-bit codes packed two per byte, one float32 scale per block (default 128):
    ratio ~7.1 on float32. Finite values use 13 levels (-6..6), three codes carry
    NaN/-Inf/+Inf. Relative L2 error ~1e-1 on Gaussian data: for tolerant uses only."""

    kind = "int4"
    LEVELS = 6
    NAN, NINF, PINF = -8, -7, 7
    typical_error = 1.2e-1

    def __init__(self, block: int = 128):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return (n + 1) // 2

    def _encode_rows(self, x2, scales, payload) -> None:
        xp = _xp(x2)
        q = self._quantize(x2, scales).reshape(-1)
        if q.shape[0] % 2:
            q = xp.concatenate([q, xp.zeros(1, xp.int8)])
        packed = (q[0::2] & 0x0F) | (q[1::2] << 4)
        payload[...] = packed.view(xp.uint8)

    def _decode_rows(self, scales, payload, out2) -> None:
        xp = _xp(out2)
        p = payload.view(xp.int8)
        q = xp.empty(2 * p.shape[0], xp.int8)
        q[0::2] = (p << 4) >> 4  # sign-extend the low nibble
        q[1::2] = p >> 4
        n = out2.shape[0] * out2.shape[1]
        self._dequantize(q[:n].reshape(out2.shape), scales, out2)


class ZFP(Codec):
    """zfp fixed-rate mode through zfpy (the seed paper's codec): RATE bits per value,
    so the stream size is bounded from n alone: a header of at most 148 bits (96 when
    the mode fits zfp's short form) plus ceil(n/4) blocks of 4*RATE bits, in 64-bit
    words; the slot reserves the bound. Layout: a uint32 flag (1: the input was not
    finite and was not encoded), the uint32 stream length, then the zfp stream. CPU
    only."""

    typical = {8: 5.4e-2, 16: 2.1e-4, 24: 8.2e-7}
    gpu_reason = ("zfpy runs on the CPU only and no Python binding of zfp's CUDA backend is "
                  "installed")

    def __init__(self, rate: int):
        try:
            import zfpy  # noqa: F401
        except ImportError as exc:
            raise UnsupportedError(f"codec 'zfp:{rate}' needs zfpy, which cannot be imported "
                                   f"({exc}); pip install 'mcr-dl[zfp]' or pick int8/fp16/bf16"
                                   ) from None
        if not (isinstance(rate, int) and 3 <= rate <= 32):
            raise InvalidArgumentError(f"zfp rate {rate!r} must be an integer number of bits per "
                                       "value in 3..32 (e.g. 'zfp:16'; zfpy 1.0.1 corrupts its "
                                       "heap on 1-D arrays at rates 1 and 2)")
        self.rate = rate
        self.name = f"zfp:{rate}"
        self.typical_error = self.typical.get(rate)

    def stream_nbytes(self, n: int) -> int:
        """Upper bound (exact but for the header's form) of zfpy's stream, bytes."""
        bits = 148 + -(-n // 4) * 4 * self.rate
        return -(-bits // 64) * 8

    def encoded_nbytes(self, n: int) -> int:
        return 8 + self.stream_nbytes(n)

    def encode(self, x, out) -> None:
        import zfpy

        head = out[:8].view(np.uint32)
        if not np.isfinite(x).all():
            head[:] = (1, 0)
            return
        stream = zfpy.compress_numpy(np.ascontiguousarray(x, dtype=np.float32), rate=self.rate)
        size = self.stream_nbytes(x.shape[0])
        if len(stream) > size:
            raise RuntimeError(f"zfp produced {len(stream)} bytes for {x.shape[0]} values at rate "
                               f"{self.rate}, at most {size} expected: this zfpy build does not "
                               "follow the fixed-rate layout; use another codec")
        head[:] = (0, len(stream))
        out[8:8 + len(stream)] = np.frombuffer(stream, np.uint8)

    def decode(self, enc, out) -> bool:
        import zfpy

        flag, size = (int(v) for v in enc[:8].view(np.uint32))
        if flag:
            out[...] = np.nan
            return False
        out[...] = zfpy.decompress_numpy(enc[8:8 + size].tobytes())
        return True
