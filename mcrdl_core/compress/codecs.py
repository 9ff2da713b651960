"""Codecs: a 1-D block of floats <-> a byte string whose size depends only on the
element count (no size exchange is ever needed between ranks).

Every codec works on NumPy arrays and on CuPy arrays with the same code (the array
module is taken from the input: ``xp = cupy`` for CUDA buffers), except ``zfp`` (zfpy
is CPU-only). Nothing loops over elements in Python: per-block scales are reductions
over a (blocks, block size) view, quantization is one vectorised expression per array.

Interface (:class:`Codec`):

- ``encoded_nbytes(n)``: bytes of the encoding of ``n`` elements, a multiple of 8
  (so encodings packed one after another keep 4-byte scales aligned on the GPU);
- ``encode(x, out)``: ``x`` a contiguous 1-D float32/float64 array of ``n`` elements,
  ``out`` a uint8 array of ``encoded_nbytes(n)`` bytes;
- ``decode(enc, out) -> bool``: writes ``n`` values into the float array ``out``;
  returns False only when the block could not be carried (zfp and non-finite input);
- ``error_bound``: a guaranteed bound on the relative L2 error of one round trip
  (``||decode(encode(x)) - x|| / ||x||`` over finite data), or None where the format
  gives none (zfp). ``typical_error`` is what the tests measure on Gaussian data.

Floating-point mode. Every codec writes the same bytes and decodes the same values on
every thread, whatever the thread's mode: each encode and decode runs in IEEE's default
mode (no flush-to-zero, no denormals-are-zero, rounding to nearest) and gives the
thread its own mode back after (``_in_default_fp_mode``; the compiled library sets the
mode, see ``native``). Under ``jax.jit`` a host callback runs on an XLA thread with
FTZ/DAZ set, where fp8's decode used to pass through subnormal float32 values and lose
them.

Zero elements are a no-op for every codec: the encoding is 0 bytes, nothing is written
and no library is called (zfpy dies of SIGBUS on an empty array).

Range. Data of any finite magnitude keeps the bound, float32 or float64 alike: block
scales are stored with float64's exponent range (a power of two for ``fp16`` and for
``bf16`` on float64 data, a mantissa and an exponent for ``int8``/``int4``), and blocks
whose scale or its inverse is not a normal number of the data's dtype (tiny blocks,
float64 data beyond float32's range) are scaled with ``ldexp`` instead of one
multiplication. Such blocks, like non-finite ones, take a slower path of their own;
the others are untouched by it. ``zfp`` compresses float64 as float64 and scales tiny
data into its working range. ``bf16`` on float32 data is a plain cast (bit-identical
to ml_dtypes and torch), with bfloat16's range: see :class:`BF16`.

NaN and Inf. ``bf16`` and ``fp16`` carry them as themselves (the scale is computed
from the finite values). ``int8``/``int4`` reserve three codes (NaN, -Inf, +Inf) so
non-finite values survive exactly; a block holding one is flagged in its scale word,
and only flagged blocks take the slower path. ``zfp`` is undefined on non-finite
input: such a block is not encoded but flagged, decodes as NaN and the collective
raises :class:`~mcrdl_core.base.errors.NonFiniteError` on every rank whose result depends on
it, after the collective has finished (no rank is left waiting).
"""
from __future__ import annotations

import math
import sys
import threading

import numpy as np

from ..base.errors import InvalidArgumentError, McrdlError, UnsupportedError
from . import native as _native


class NonFiniteError(McrdlError, ValueError):
    """A codec that cannot carry NaN/Inf (zfp) met them; the message names the codec and
    says which codecs carry them."""


#: per thread: whether the codec call running on it found the thread in another
#: floating-point mode than IEEE's default (see ``_in_default_fp_mode``)
_FP = threading.local()


def _in_default_fp_mode(step, a, b):
    """``step(a, b)`` in IEEE's default floating-point mode, and the thread's own mode
    back after: the same bytes on every thread. A thread with flush-to-zero or
    denormals-are-zero set (XLA's, where a jitted host callback runs; torch's after
    ``torch.set_flush_denormal(True)``) would turn subnormal data, and subnormal
    products on the way, into zeros (``native.exact_fp_enter``). Where the mode had to
    be changed, the call keeps off torch's kernels (``_host_torch``): torch may run them
    on pool threads that were started in the caller's mode, which this thread's change
    does not reach; NumPy runs on this thread, with the same bytes."""
    saved = _native.exact_fp_enter()
    if saved < 0:  # the usual case: the thread was in the default mode
        return step(a, b)
    outer = getattr(_FP, "foreign", False)
    _FP.foreign = True
    try:
        return step(a, b)
    finally:
        _FP.foreign = outer
        _native.exact_fp_leave(saved)


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
    torch = _host_torch(x2, x2)
    if torch is not None:  # the same two reductions, about 2x faster (NaN propagates)
        t = torch.from_numpy(x2)
        amax = torch.maximum(t.amax(1), t.amin(1).neg_()).numpy()
    else:
        amax = xp.maximum(x2.max(axis=1), -x2.min(axis=1))  # two passes, no |x| temporary
    bad = ~xp.isfinite(amax)
    if bool(bad.any()):  # rare: recompute those rows over their finite values only
        rows = x2[bad]
        amax[bad] = xp.where(xp.isfinite(rows), xp.abs(rows), 0).max(axis=1)
    return amax, bad


def _row_factor(mant, k, dtype, xp, lo: int, hi: int):
    """Per row ``mant * 2^k`` (``mant`` float64) as a number of ``dtype``, with ``k``
    clipped into [minexp + lo, maxexp - hi] of ``dtype``; callers pick ``lo``/``hi`` so
    that inside that range the factor is a normal number and its products with the
    row's values stay finite, so one multiplication scales the row. Also returns the
    rows whose ``k`` was clipped: they need an ``ldexp`` of their own."""
    fi = np.finfo(dtype)
    kc = xp.clip(k, fi.minexp + lo, fi.maxexp - hi)
    return xp.ldexp(mant, kc).astype(dtype), kc != k


class Codec:
    """Base class; see the module docstring for the contract. Subclasses implement
    ``_nbytes``, ``_encode`` and ``_decode`` for one element or more; zero elements
    never reach them."""

    name = "codec"
    lossy = True
    error_bound: float | None = None
    typical_error: float | None = None
    gpu_reason: str | None = None  # None: works on CuPy arrays too

    def encoded_nbytes(self, n: int) -> int:
        return self._nbytes(n) if n else 0

    def encode(self, x, out) -> None:
        if x.shape[0]:
            _in_default_fp_mode(self._encode, x, out)

    def decode(self, enc, out) -> bool:
        return _in_default_fp_mode(self._decode, enc, out) if out.shape[0] else True

    def _nbytes(self, n: int) -> int:
        raise NotImplementedError

    def _encode(self, x, out) -> None:
        raise NotImplementedError

    def _decode(self, enc, out) -> bool:
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

    def _nbytes(self, n: int) -> int:
        return _round8(n * self.storage.itemsize)

    def _encode(self, x, out) -> None:
        n = x.shape[0]
        if self.bf16:
            out[:2 * n].view(np.uint16)[...] = bf16_bits(x, _xp(x))
        else:
            out[:n * self.storage.itemsize].view(self.storage)[...] = x

    def _decode(self, enc, out) -> bool:
        n = out.shape[0]
        if self.bf16:
            out[...] = bf16_values(enc[:2 * n].view(np.uint16), _xp(out), out.dtype)
        else:
            out[...] = enc[:n * self.storage.itemsize].view(self.storage)
        return True


def bf16_bits(x, xp):
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (u >> 16) | 0x40, rounded).astype(xp.uint16)


def bf16_values(bits, xp, dtype):
    v = (bits.astype(xp.uint32) << 16).view(xp.float32)
    return v if dtype == xp.float32 else v.astype(dtype)


class _Blocked(Codec):
    """Common layout: ``nblocks`` 4-byte scale words, then the payload, padded to 8
    bytes. What a word holds is the subclass's."""

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

    def _nbytes(self, n: int) -> int:
        return _round8(4 * self.nblocks(n) + self.payload_nbytes(n))

    def _parts(self, enc, n: int):
        nb = self.nblocks(n)
        return enc[:4 * nb].view(np.uint32), enc[4 * nb:4 * nb + self.payload_nbytes(n)]

    def _encode(self, x, out) -> None:
        n = x.shape[0]
        words, payload = self._parts(out, n)
        body, tail = _blocks(x, self.block)
        nfull = body.shape[0]
        self._encode_rows(body, words[:nfull], payload[:self.payload_nbytes(nfull * self.block)])
        if tail is not None:
            self._encode_rows(tail, words[nfull:],
                              payload[self.payload_nbytes(nfull * self.block):])

    def _decode(self, enc, out) -> bool:
        n = out.shape[0]
        words, payload = self._parts(enc, n)
        body, tail = _blocks(out, self.block)
        nfull = body.shape[0]
        self._decode_rows(words[:nfull], payload[:self.payload_nbytes(nfull * self.block)], body)
        if tail is not None:
            self._decode_rows(words[nfull:], payload[self.payload_nbytes(nfull * self.block):],
                              tail)
        return True


# --- power-of-two block scales (fp16, and bf16 on float64 data) ---------------------------
def _pow2_exponents(x2, top: int, xp):
    """Per row the k (int32) for which the row's largest finite magnitude divided by 2^k
    lies in [2^(top-1), 2^top); 0 for rows without a nonzero finite value."""
    amax, _ = _absmax_rows(x2, xp)
    _, e = xp.frexp(amax)  # amax < 2^e, frexp(0) = (0, 0)
    return xp.where(amax > 0, e - top, 0).astype(xp.int32)


def _pow2_down(x2, k, xp):
    """x2 / 2^k per row, in x2's dtype: one multiplication where 2^-k is a normal
    number of that dtype, ldexp for the other rows (exact either way, but for values
    that become subnormal, which the 16-bit formats round to zero or near it anyway)."""
    inv, slow = _row_factor(xp.ones(k.shape), -k, x2.dtype, xp, 0, 1)
    y = x2 * inv[:, None]
    if bool(slow.any()):
        y[slow] = xp.ldexp(x2[slow], -k[slow][:, None])
    return y


def _pow2_up_slow(v, k, top: int, out2, slow, xp) -> None:
    """out2[slow] = v[slow] * 2^k[slow] for the rows a multiplication cannot scale (2^k
    not a normal number of out2's dtype, or products that may overflow), by ldexp:
    exact but for one rounding where the result is subnormal. A finite v = +-2^top is a
    block maximum that rounded up to 2^e in the 16-bit format; where 2^e exceeds the
    dtype's range it saturates at the largest finite value, nearer to the original
    value than 2^e (a real infinity is carried as itself and stays one)."""
    fi = np.finfo(out2.dtype)
    vs = v[slow].astype(out2.dtype)
    ks = k[slow][:, None]
    over = (xp.abs(vs) == 2.0 ** top) & (ks + top >= fi.maxexp)
    out2[slow] = xp.where(over, xp.copysign(fi.max, vs), xp.ldexp(xp.where(over, 0, vs), ks))


class BF16(_Blocked):
    """bfloat16 (round to nearest even): 8 significant bits.

    On float32 data it is exactly the cast (bit-identical to ml_dtypes and torch), so it
    has bfloat16's range: values at or above 3.3961e38 (within 2^-9 of float32's
    largest value) round to +-inf, and values below 2^-126 keep only bfloat16's
    subnormal spacing (2^-133); the bound holds for data between. On float64 data each
    block of 1024 values is first divided by a power of two that brings its largest
    magnitude to [2^63, 2^64), so float64 data of any magnitude keeps bfloat16's
    relative precision. The power (an int32 per block, 0 for float32) is in the
    encoding either way: 4 bytes per 1024 values."""

    kind = "bf16"
    TOP = 64
    error_bound = 2.0 ** -8  # unit roundoff of an 8-bit significand
    typical_error = 1.7e-3

    def __init__(self):
        super().__init__(1024)
        self.name = "bf16"

    def payload_nbytes(self, n: int) -> int:
        return 2 * n

    def _encode_rows(self, x2, words, payload) -> None:
        xp = _xp(x2)
        bits = payload.view(np.uint16).reshape(x2.shape)
        if x2.dtype.itemsize <= 4:  # float32: the plain cast, no scale
            words[...] = 0
            if not _bf16_cast(bits, x2):
                bits[...] = bf16_bits(x2, xp)
            return
        k = _pow2_exponents(x2, self.TOP, xp)
        words.view(np.int32)[...] = k
        bits[...] = bf16_bits(_pow2_down(x2, k, xp), xp)

    def _decode_rows(self, words, payload, out2) -> None:
        xp = _xp(out2)
        k = words.view(np.int32)
        bits = payload.view(np.uint16).reshape(out2.shape)
        if not bool(k.any()):
            if not _bf16_cast(out2, bits):
                out2[...] = bf16_values(bits, xp, out2.dtype)
            return
        v = bf16_values(bits, xp, out2.dtype)
        scale, slow = _row_factor(xp.ones(k.shape), k, out2.dtype, xp, 0, 1 + self.TOP)
        xp.multiply(v, scale[:, None], out=out2)
        if bool(slow.any()):
            _pow2_up_slow(v, k, self.TOP, out2, slow, xp)


class FP16(_Blocked):
    """float16 after dividing each block by a power of two 2^k (an int32 per block), so
    that the block's largest finite magnitude lands in [2^14, 2^15): no overflow and no
    loss to float16's subnormals whatever the range (float32's or float64's), and the
    power of two adds no rounding of its own. A block maximum that float16 rounds up to
    2^e beyond the dtype's range (within 2^-12 of float32's largest value) decodes as
    that largest value, not inf. Host casts go through ``_half_scaled``."""

    kind = "fp16"
    TOP = 15
    error_bound = 2.0 ** -11  # float16's unit roundoff (values within 2^-24 of the block max
    typical_error = 2.2e-4    # underflow to subnormals; they are below that bound's share)

    def __init__(self, block: int = 1024):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return 2 * n

    def _encode_rows(self, x2, words, payload) -> None:
        xp = _xp(x2)
        k = _pow2_exponents(x2, self.TOP, xp)
        words.view(np.int32)[...] = k
        h = payload.view(np.float16).reshape(x2.shape)
        inv, slow = _row_factor(xp.ones(k.shape), -k, x2.dtype, xp, 0, 1)
        if not _half_scaled(h, x2, inv):
            xp.multiply(x2, inv[:, None], out=h, casting="unsafe")
        if bool(slow.any()):
            h[slow] = xp.ldexp(x2[slow], -k[slow][:, None])
        if xp is not np:
            _host_nans(h, x2, xp)

    def _encode(self, x, out) -> None:
        if not _native.fp16_encode(x, out, self.nblocks(x.shape[0]), self.block):
            super()._encode(x, out)

    def _decode(self, enc, out) -> bool:
        if not _native.fp16_decode(enc, out, self.nblocks(out.shape[0]), self.block):
            return super()._decode(enc, out)
        return True

    def _decode_rows(self, words, payload, out2) -> None:
        xp = _xp(out2)
        k = words.view(np.int32)
        h = payload.view(np.float16).reshape(out2.shape)
        scale, slow = _row_factor(xp.ones(k.shape), k, out2.dtype, xp, 0, 1 + self.TOP)
        if not _half_scaled(out2, h, scale):
            xp.multiply(h, scale[:, None], out=out2)
        if bool(slow.any()):
            _pow2_up_slow(h, k, self.TOP, out2, slow, xp)


def _host_torch(dst, src):
    """torch, when it is already loaded in this process (the core never imports it) and
    ``dst``/``src`` are contiguous host arrays torch can view without a copy or a
    warning (``src`` writable); else None: the caller takes its NumPy path."""
    torch = None if getattr(_FP, "foreign", False) else sys.modules.get("torch")
    if (torch is None or not isinstance(dst, np.ndarray) or not isinstance(src, np.ndarray)
            or not (dst.flags.c_contiguous and src.flags.c_contiguous and src.flags.writeable)):
        return None
    return torch


def _mul_rows(x2, f):
    """``x2 * f[:, None]`` (a new array of x2's dtype; ``f`` of that dtype), through
    torch's kernel when torch is loaded and both are host arrays it can view: the same
    IEEE products, in about half NumPy's time here."""
    torch = _host_torch(f, x2)
    if torch is None or f.dtype != x2.dtype:
        return x2 * f[:, None]
    return torch.mul(torch.from_numpy(x2), torch.from_numpy(f)[:, None]).numpy()


def _mul_rows_into(out2, v, f) -> bool:
    """``out2[...] = v * f[:, None]`` for a float ``out2`` of ``f``'s dtype and ``v`` of
    int8 codes or of that dtype, through torch (a cast, exact, then a same-dtype
    product: NumPy's result) when it can; False: not done."""
    torch = _host_torch(out2, v)
    if (torch is None or f.dtype != out2.dtype or not f.flags.c_contiguous
            or v.dtype not in (np.int8, out2.dtype)):
        return False
    o, tf = torch.from_numpy(out2), torch.from_numpy(f)[:, None]
    if v is out2:
        o.mul_(tf)
    elif v.dtype == out2.dtype:
        torch.mul(torch.from_numpy(v), tf, out=o)
    else:
        o.copy_(torch.from_numpy(v)).mul_(tf)
    return True


def _bf16_cast(dst, src) -> bool:
    """Between float32 values and bfloat16 bit patterns (uint16) of host arrays, either
    way, through torch's vectorised conversion when torch is already loaded (as
    ``_half_scaled``): 16 MiB of float32 encode in ~0.7 ms instead of ~27 ms of NumPy bit
    arithmetic. Both round to nearest even, so finite values get the same bits; torch
    writes every NaN as one pattern, so the NaNs of an encode (if any) are redone with
    ``bf16_bits``, which keeps their sign as ml_dtypes does. False: not done."""
    torch = _host_torch(dst, src)
    if torch is None:
        return False
    if dst.dtype == np.uint16 and src.dtype == np.float32:
        torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16).copy_(torch.from_numpy(src))
        nan = np.isnan(src)
        if nan.any():
            dst[nan] = bf16_bits(src[nan], np)
        return True
    if dst.dtype == np.float32 and src.dtype == np.uint16:
        torch.from_numpy(dst).copy_(torch.from_numpy(src.view(np.int16)).view(torch.bfloat16))
        return True
    return False


def _host_nans(h, x, xp) -> None:
    """NaN as the host writes it in float16 (torch's cast, and NumPy's of the usual NaN):
    the sign and 0x7E00. CUDA's cast writes 0x7FFF for every NaN, which decodes the
    same but would make a GPU-encoded message differ from a host-encoded one."""
    nan = xp.isnan(x)
    if bool(nan.any()):
        h.view(xp.uint16)[nan] = xp.where(xp.signbit(x[nan]), 0xFE00, 0x7E00).astype(xp.uint16)


def _half_scaled(dst, src, factor) -> bool:
    """dst[...] = src * factor[:, None] between float32 and float16 host arrays, rows
    scaled by a power of two (exact: the cast is the one rounding), through torch's
    vectorised kernels when torch is already loaded in this process (the core never
    imports it): NumPy's float16 casts run ~10x slower here. Encoding multiplies in
    float32 and casts; decoding casts (exact) and multiplies in place: each a same-dtype
    kernel, which torch runs 2-3x faster than one mixed-dtype multiply. A 4 MiB block
    encodes in ~0.5 ms instead of ~1.4, and decodes in ~0.2 ms instead of ~0.6. Both
    round to nearest even, so the bits are NumPy's. False: not done."""
    torch = _host_torch(dst, src)
    if torch is None or factor.dtype != np.float32:
        return False
    f = torch.from_numpy(factor)[:, None]
    if dst.dtype == np.float16 and src.dtype == np.float32:
        torch.from_numpy(dst).copy_(torch.mul(torch.from_numpy(src), f))
        return True
    if dst.dtype == np.float32 and src.dtype == np.float16:
        torch.from_numpy(dst).copy_(torch.from_numpy(src)).mul_(f)
        return True
    return False


# --- int8 / int4 scale words -------------------------------------------------------------
#: frexp exponents of finite float64 values lie in -1073..1024; biased they fit 12 bits
_EXP_BIAS = 1100
#: significant bits kept of a block's largest magnitude (its leading one and 19 more)
_MANT_BITS = 20
_FLAG = 0x80000000


def _pack_amax(amax, bad, xp):
    """Each block's largest finite magnitude ``amax = m * 2^e`` (m in [0.5, 1)) as a
    32-bit word: bit 31 flags a block holding NaN/Inf, bits 30..19 hold e + _EXP_BIAS,
    bits 18..0 the 19 bits of m after its leading one, truncated (so m' <= m, within
    2^-19 of it); a word of 0 is a block of zeros. float64's whole range fits, which a
    float32 scale (amax / LEVELS) cannot hold: it overflows for float64 data and
    loses all precision in float32's subnormals. Returns the words, m' and e."""
    m, e = xp.frexp(amax.astype(xp.float64))
    zero = amax == 0
    frac = xp.floor((xp.maximum(m, 0.5) - 0.5) * 2.0 ** _MANT_BITS)
    word = ((e + _EXP_BIAS).astype(xp.uint32) << 19) | frac.astype(xp.uint32)
    word = xp.where(zero, 0, word).astype(xp.uint32) | xp.where(bad, _FLAG, 0).astype(xp.uint32)
    m = xp.where(zero, 0.0, 0.5 + frac * 2.0 ** -_MANT_BITS)
    return word, m, xp.where(zero, 0, e).astype(xp.int32)


def _unpack_amax(words, xp):
    """(m', e, flagged) of each block's word from ``_pack_amax``."""
    ef = (words >> 19) & 0xFFF
    m = xp.where(ef == 0, 0.0, 0.5 + (words & 0x7FFFF).astype(xp.float64) * 2.0 ** -_MANT_BITS)
    e = xp.where(ef == 0, 0, ef.astype(xp.int32) - _EXP_BIAS).astype(xp.int32)
    return m, e, (words & _FLAG) != 0


class _AbsmaxScaled(_Blocked):
    """One scale word per block holding the block's largest finite magnitude amax'
    (``_pack_amax``: 20 significant bits, float64's exponent range); finite values are
    scaled by LEVELS / amax' into [-LEVELS, LEVELS] (times at most 1 + 2^-19, as amax'
    is truncated) and decode as (scaled value) * amax' / LEVELS. Shared by the integer
    codecs (which round the scaled values to integers) and ``fp8`` (which rounds them
    to float8 e4m3). Scaling is one multiplication per value where the factor is a
    normal number of the data's dtype; tiny blocks (LEVELS/amax beyond float32's range
    below ~3.7e-37, steps amax/LEVELS in float32's subnormals) and float64 blocks at its
    extremes are scaled by ldexp on their own. A block holding NaN/Inf is flagged in its
    word (its scale comes from its finite values); subclasses reserve codes for them."""

    LEVELS = 0
    #: the compiled kernel's kind for this codec (``native.absmax_encode``); None: none
    NATIVE: int | None = None

    def _encode(self, x, out) -> None:
        L = self.LEVELS
        if self.NATIVE is None or not _native.absmax_encode(
                x, out, self.nblocks(x.shape[0]), self.block, L, 128 - (2 * L).bit_length(),
                self.NATIVE):
            super()._encode(x, out)

    def _decode(self, enc, out) -> bool:
        L = self.LEVELS
        if self.NATIVE is None or not _native.absmax_decode(
                enc, out, self.nblocks(out.shape[0]), self.block, L, L.bit_length() + 1,
                self.NATIVE):
            return super()._decode(enc, out)
        return True

    def _factors(self, x2, words):
        """The per-row scaling of ``x2``: ``(inv, r, e, slow, bad)``, where finite values
        scale to [-LEVELS, LEVELS] as ``x * inv`` (rows of ``slow``: as ``ldexp(x, -e) *
        r`` instead) and ``bad`` flags rows holding NaN/Inf. Writes the scale words."""
        xp = _xp(x2)
        L = self.LEVELS
        amax, bad = _absmax_rows(x2, xp)
        words[...], m, e = _pack_amax(amax, bad, xp)
        r = xp.where(m > 0, L / xp.where(m > 0, m, 1.0), 0.0)  # L / m' in (L, 2L]
        inv, slow = _row_factor(r, -e, x2.dtype, xp, 0, (2 * L).bit_length())
        return inv, r, e, slow, bad

    def _scale(self, x2, words, rnd):
        """``(rnd(y), bad)``: ``rnd`` (the subclass's rounding to its code values) of the
        rows of ``x2`` scaled to [-LEVELS, LEVELS], and the mask of flagged rows; the
        non-finite values of flagged rows come out as garbage, the caller overwrites
        them. Writes the scale words. ``y`` is x2's dtype, except in the rows scaled by
        ldexp, whose product reaches ``rnd`` in float64."""
        xp = _xp(x2)
        inv, r, e, slow, bad = self._factors(x2, words)
        with np.errstate(invalid="ignore"):  # inf * 0 in a flagged row of infinities
            q = rnd(_mul_rows(x2, inv))
        if bool(slow.any()):
            q[slow] = rnd(xp.ldexp(x2[slow], -e[slow][:, None]) * r[slow][:, None])
        return q, bad

    def _unscale(self, v, words, out2):
        """``out2 = v * amax' / LEVELS`` per row (``v``: the decoded scaled values, any
        float or integer dtype); returns the mask of flagged rows."""
        xp = _xp(out2)
        m, e, bad = _unpack_amax(words, xp)
        s = m / self.LEVELS  # in [2^-(b+1), 2^-(b-1)) for b = LEVELS.bit_length()
        step, slow = _row_factor(s, e, out2.dtype, xp, self.LEVELS.bit_length() + 1, 0)
        rows = bool(slow.any())
        if rows:
            vs = v[slow]  # a copy, taken before out2 (which may be v itself) is written
        if not _mul_rows_into(out2, v, step):
            xp.multiply(v, step[:, None], out=out2)
        if rows:
            out2[slow] = xp.ldexp(vs * s[slow].astype(out2.dtype)[:, None], e[slow][:, None])
        return bad


class _IntQ(_AbsmaxScaled):
    """Symmetric integer quantization with one scale word per block (ZeRO++ style):
    finite values map to rint(x * LEVELS / amax') in [-L, L] and decode as
    code * amax' / LEVELS. The codes NAN, NINF, PINF are reserved so NaN/Inf survive;
    a block holding any of them is flagged in its word."""

    NAN = NINF = PINF = 0

    def __init__(self, block: int):
        super().__init__(block)
        # worst case: every value half a step from its block's maximum
        self.error_bound = math.sqrt(self.block) / (2 * self.LEVELS)

    def _quantize(self, x2, words):
        xp = _xp(x2)
        q, bad = self._scale(x2, words, xp.rint)
        if bool(bad.any()):
            rows = x2[bad]
            qb = xp.nan_to_num(q[bad], nan=0.0, posinf=0.0, neginf=0.0)
            qb = xp.where(xp.isnan(rows), self.NAN, qb)
            qb = xp.where(rows == xp.inf, self.PINF, qb)
            q[bad] = xp.where(rows == -xp.inf, self.NINF, qb)
        return q.astype(xp.int8)

    def _dequantize(self, q, words, out2) -> None:
        xp = _xp(out2)
        bad = self._unscale(q, words, out2)
        if bool(bad.any()):
            qb, ob = q[bad], out2[bad]
            ob = xp.where(qb == self.NAN, xp.nan, ob)
            ob = xp.where(qb == self.PINF, xp.inf, ob)
            out2[bad] = xp.where(qb == self.NINF, -xp.inf, ob)


class Int8(_IntQ):
    """int8 codes, one scale word per block (default 256 values): ratio ~3.94 on
    float32. Worst-case relative L2 error sqrt(block)/(2*126) (every value at half a
    step from its block's maximum); ~7e-3 on Gaussian data."""

    kind = "int8"
    LEVELS = 126
    NATIVE = 0
    NAN, NINF, PINF = -128, -127, 127
    typical_error = 8e-3

    def __init__(self, block: int = 256):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return n

    def _encode_rows(self, x2, words, payload) -> None:
        q8 = payload.view(np.int8).reshape(x2.shape)
        torch = _host_torch(q8, x2)
        if torch is not None:
            inv, _, _, slow, bad = self._factors(x2, words)
            if not (bool(slow.any()) or bool(bad.any())):
                # the usual block: scale, round half to even, store, in 3 torch kernels
                # (the same float products and rounding as np.rint: the same codes)
                torch.from_numpy(q8).copy_(
                    torch.mul(torch.from_numpy(x2), torch.from_numpy(inv)[:, None]).round_())
                return
        q8[...] = self._quantize(x2, words)

    def _decode_rows(self, words, payload, out2) -> None:
        self._dequantize(payload.view(np.int8).reshape(out2.shape), words, out2)


class Int4(_IntQ):
    """4-bit codes packed two per byte, one scale word per block (default 128): ratio
    ~7.1 on float32. Finite values use 13 levels (-6..6), three codes carry
    NaN/-Inf/+Inf. Relative L2 error ~1e-1 on Gaussian data: for tolerant uses only."""

    kind = "int4"
    LEVELS = 6
    NAN, NINF, PINF = -8, -7, 7
    typical_error = 1.2e-1

    def __init__(self, block: int = 128):
        super().__init__(block)

    def payload_nbytes(self, n: int) -> int:
        return (n + 1) // 2

    def _encode_rows(self, x2, words, payload) -> None:
        xp = _xp(x2)
        q = self._quantize(x2, words).reshape(-1)
        if q.shape[0] % 2:
            q = xp.concatenate([q, xp.zeros(1, xp.int8)])
        packed = (q[0::2] & 0x0F) | (q[1::2] << 4)
        payload[...] = packed.view(xp.uint8)

    def _decode_rows(self, words, payload, out2) -> None:
        xp = _xp(out2)
        p = payload.view(xp.int8)
        q = xp.empty(2 * p.shape[0], xp.int8)
        q[0::2] = (p << 4) >> 4  # sign-extend the low nibble
        q[1::2] = p >> 4
        n = out2.shape[0] * out2.shape[1]
        self._dequantize(q[:n].reshape(out2.shape), words, out2)


# --- float8 e4m3 with block scales -------------------------------------------------------
#: float32 bit pattern of 2^-6, e4m3's smallest normal number
_E4M3_MIN_NORMAL_BITS = 0x3C800000


def _e4m3_codes(y, xp):
    """float8 e4m3fn bit patterns (uint8) of ``y`` (|y| < 464: no overflow), rounded to
    nearest, ties to even: bit-identical to ``y.astype(ml_dtypes.float8_e4m3fn)`` on
    float32 input (tested exhaustively). Bit arithmetic instead of the cast so that the
    same code runs on CuPy (which has no float8 type); as fast as ml_dtypes' cast on the
    host. float64 input is rounded to float32 first. Normal results (|y| >= 2^-6):
    float32's sign-less bits rounded to their top 11 (8 exponent, 3 fraction) bits,
    exponent rebiased from 127 to 7; subnormal ones: rint(|y| * 2^9) is the code itself
    (8, the carry into the smallest normal number, is that number's code too)."""
    y = xp.ascontiguousarray(y, dtype=xp.float32)
    fast = _e4m3_torch(y)
    if fast is not None:
        return fast
    u32 = np.uint32  # constants as uint32: no promotion, on NumPy or CuPy
    u = y.view(xp.uint32)
    a = u & u32(0x7FFFFFFF)
    code = a >> u32(20)  # in place from here: each temporary of 4 bytes per value
    code &= u32(1)       # costs about as much as the arithmetic
    code += a
    # round half to even at bit 20, and rebias float32's exponent 127 to e4m3's 7
    # (120 << 23 = 960 << 20), as one addition modulo 2^32; wraps below 2^-7, which
    # the subnormal branch overwrites
    code += u32((0x7FFFF - (960 << 20)) & 0xFFFFFFFF)
    code >>= u32(20)
    sub = a < u32(_E4M3_MIN_NORMAL_BITS)
    if bool(sub.any()):
        code[sub] = xp.rint(xp.abs(y[sub]) * 512.0).astype(xp.uint32)
    a = u >> u32(24)
    a &= u32(0x80)
    code |= a
    return code.astype(xp.uint8)


def _e4m3_torch(y):
    """``_e4m3_codes`` of a host float32 array through torch's conversion, when torch is
    already loaded in this process (the core never imports it): 4x faster here, and
    the same bits (round to nearest even; tested against ml_dtypes). None: not done."""
    torch = None if getattr(_FP, "foreign", False) else sys.modules.get("torch")
    if (torch is None or not hasattr(torch, "float8_e4m3fn") or not isinstance(y, np.ndarray)
            or not y.flags.writeable or not y.flags.c_contiguous):
        return None
    return torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


_E4M3_VALUES: dict = {}
_E4M3_PAIRS: dict = {}


def _e4m3_values(xp, dtype):
    """The 256 values of float8 e4m3fn (codes 0x7F and 0xFF: NaN) as ``dtype``."""
    key = np.dtype(dtype)
    table = _E4M3_VALUES.get(key)
    if table is None:
        c = np.arange(256)
        e, m = (c >> 3) & 15, c & 7
        mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.ldexp(1.0, e - 10))
        table = np.where(c & 0x80, -mag, mag)
        table[(c & 0x7F) == 0x7F] = np.nan
        table = _E4M3_VALUES[key] = table.astype(key)
    return table if xp is np else xp.asarray(table)


def _e4m3_decode_host(q, out) -> None:
    """``out[...] = value of each code in q`` (1-D host arrays), two codes per lookup: a
    table of the 65536 code pairs, indexed by the codes read as uint16, each entry the
    two values as one complex number, so one ``take`` moves both. 3-4x faster than a
    lookup per code (NumPy turns every index into an intp either way), and 5x faster
    than torch's float8 to float32 conversion on this CPU."""
    key = out.dtype
    pairs = _E4M3_PAIRS.get(key)
    if pairs is None:
        both = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)  # byte order
        pairs = _e4m3_values(np, key)[both].view(np.complex64 if key.itemsize == 4
                                                  else np.complex128).reshape(-1)
        pairs = _E4M3_PAIRS[key] = pairs
    m = q.shape[0] & ~1
    np.take(pairs, q[:m].view(np.uint16), out=out[:m].view(pairs.dtype), mode="clip")
    if m < q.shape[0]:
        out[m] = _e4m3_values(np, key)[q[m]]


class FP8(_AbsmaxScaled):
    """float8 e4m3 (the ``ml_dtypes.float8_e4m3fn`` format: 4 exponent bits, 3 fraction
    bits, no infinities, one NaN pattern per sign; largest finite value 448) with one
    scale word per block (default 128 values, the granularity DeepEP dispatches MoE
    tokens in FP8 with): ratio ~3.88 on float32, 7.76 on float64.

    Each block is scaled so that its largest finite magnitude maps to 416 (times at most
    1 + 2^-19), the largest e4m3 value below 448, and rounded to nearest e4m3 (ties to
    even). The scale word is the integer codecs' (``_pack_amax``): amax with 20
    significant bits and float64's exponent range. A plain float32 scale amax/448 was
    the obvious choice; it would overflow for float64 blocks above ~1.5e41 and lose
    precision for blocks below ~5e-36, where this word keeps the bound.

    NaN and Inf: as int8 reserves codes, finite values never reach 448, which frees the
    codes +-448 for +-Inf; NaN is e4m3's own NaN (0x7F). A block holding any of them is
    flagged in its scale word, and only flagged blocks take the slower path on either
    side, so NaN, +Inf and -Inf arrive exactly as themselves.

    Error. Scaled values of at least 2^-6 (e4m3's normal range: about the top 15 binades
    of a block) round with relative error at most 2^-4 (4 significant bits), the two
    products with the scale add 2^-24 each; the smaller ones (below the block maximum
    times 2^-6/416) round to e4m3's subnormal steps of 2^-9, an absolute error of at
    most 2^-10 * amax / 416. Over any data: relative L2 error at most
    sqrt((2^-4 (1 + 2^-19))^2 + BLOCK * 2^-20 / 416^2) = 0.0625001 at BLOCK=128;
    ~0.026 on Gaussian data."""

    kind = "fp8"
    LEVELS = 416
    NATIVE = 1
    PINF, NINF, NAN = 0x7E, 0xFE, 0x7F  # +448, -448, NaN
    typical_error = 2.6e-2

    def __init__(self, block: int = 128):
        super().__init__(block)
        u = 2.0 ** -4 * (1 + 2.0 ** -19)
        self.error_bound = math.sqrt(u * u + self.block * 2.0 ** -20 / self.LEVELS ** 2)

    def payload_nbytes(self, n: int) -> int:
        return n

    def _encode_rows(self, x2, words, payload) -> None:
        xp = _xp(x2)
        q, bad = self._scale(x2, words, lambda y: _e4m3_codes(y, xp))
        if bool(bad.any()):
            rows, qb = x2[bad], q[bad]
            qb = xp.where(xp.isnan(rows), self.NAN, qb)
            qb = xp.where(rows == xp.inf, self.PINF, qb)
            q[bad] = xp.where(rows == -xp.inf, self.NINF, qb)
        payload.reshape(x2.shape)[...] = q

    def _decode_rows(self, words, payload, out2) -> None:
        xp = _xp(out2)
        q = payload.reshape(out2.shape)
        if xp is np:
            _e4m3_decode_host(payload, out2.reshape(-1))
        else:
            out2[...] = _e4m3_values(xp, out2.dtype)[q]
        bad = self._unscale(out2, words, out2)
        if bool(bad.any()):
            qb, ob = q[bad], out2[bad]
            ob = xp.where(qb == self.PINF, xp.inf, ob)
            out2[bad] = xp.where(qb == self.NINF, -xp.inf, ob)


class ZFP(Codec):
    """zfp fixed-rate mode through zfpy (the seed paper's codec): RATE bits per value,
    so the stream size is bounded from n alone: a header of at most 148 bits (96 when
    the mode fits zfp's short form) plus ceil(n/4) blocks of 4*RATE bits, in 64-bit
    words; the slot reserves the bound. Layout: an int16 flag (1: the input was not
    finite and was not encoded), an int16 power of two s, the uint32 stream length,
    then the zfp stream of x / 2^s. float64 data is compressed as float64 (zfp's double
    mode, same stream size), so its range is float64's. zfp returns garbage for blocks
    whose largest magnitude is below about 2^-94 (float32) or 2^-958 (float64) and is
    exact under power-of-two scaling above: an encoding whose largest magnitude is
    below 2^(minexp / 2) of its dtype (2^-63, 2^-511) is divided by the power of two s
    that brings it to [0.5, 1) (s = 0 otherwise). CPU only."""

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

    def _nbytes(self, n: int) -> int:
        return 8 + self.stream_nbytes(n)

    def _encode(self, x, out) -> None:
        import zfpy

        head, length = out[:4].view(np.int16), out[4:8].view(np.uint32)
        amax = float(max(x.max(), -x.min()))
        if not math.isfinite(amax):
            head[:], length[:] = (1, 0), 0
            return
        x = np.ascontiguousarray(x, dtype=np.float64 if x.dtype == np.float64 else np.float32)
        shift = 0
        if 0 < amax < 2.0 ** (np.finfo(x.dtype).minexp // 2):
            shift = math.frexp(amax)[1]
            x = np.ldexp(x, -shift)
        stream = zfpy.compress_numpy(x, rate=self.rate)
        size = self.stream_nbytes(x.shape[0])
        if len(stream) > size:
            raise RuntimeError(f"zfp produced {len(stream)} bytes for {x.shape[0]} values at rate "
                               f"{self.rate}, at most {size} expected: this zfpy build does not "
                               "follow the fixed-rate layout; use another codec")
        head[:], length[:] = (0, shift), len(stream)
        out[8:8 + len(stream)] = np.frombuffer(stream, np.uint8)

    def _decode(self, enc, out) -> bool:
        import zfpy

        flag, shift = (int(v) for v in enc[:4].view(np.int16))
        if flag:
            out[...] = np.nan
            return False
        values = zfpy.decompress_numpy(enc[8:8 + int(enc[4:8].view(np.uint32)[0])].tobytes())
        out[...] = np.ldexp(values, shift) if shift else values
        return True
