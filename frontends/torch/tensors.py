"""torch.Tensor -> mcrdl_core.Buffer, zero-copy.

The general path is DLPack (``Buffer.from_dlpack``). For torch tensors the frontend
reads the same facts DLPack would carry (address, shape, strides, dtype, device)
straight from the tensor, which skips allocating and parsing a capsule on every call
(about 12 µs on this machine); the tensor itself is kept as the owner.
"""
from __future__ import annotations

import math

import torch

from mcrdl_core import dtypes as dt
from mcrdl_core.memory.buffer import CPU, Buffer, Device
from mcrdl_core.base.errors import DtypeError, InvalidArgumentError
from mcrdl_core.dispatch.fastpath import MISS

DTYPES = {torch.float16: dt.float16, torch.bfloat16: dt.bfloat16, torch.float32: dt.float32,
           torch.float64: dt.float64, torch.int8: dt.int8, torch.uint8: dt.uint8,
           torch.int16: dt.int16, torch.int32: dt.int32, torch.int64: dt.int64,
           torch.bool: dt.bool_, torch.complex64: dt.complex64, torch.complex128: dt.complex128}


#: torch dtypes the core communicates as they are, on every op
CORE_DTYPES = frozenset(t for t, d in DTYPES.items() if d in dt.SUPPORTED)


def to_buffer(t) -> Buffer:
    if not isinstance(t, torch.Tensor):
        if t is None:
            raise InvalidArgumentError("expected a torch.Tensor, got None")
        return Buffer.from_dlpack(t) if hasattr(t, "__dlpack__") else _bad(t)
    if t.is_nested:  # (strided nested tensors too: torch cannot give their one shape)
        raise InvalidArgumentError(
            "nested tensors are not supported: their components have no one shape to "
            "communicate; send each component (t.unbind()) or a padded tensor "
            "(torch.nested.to_padded_tensor(t, 0.0)) instead")
    if t.layout is not torch.strided:
        raise InvalidArgumentError(
            f"tensors of layout {t.layout} have no single memory block to send; only the "
            "'mcrdl' process group's all_reduce (SUM) takes sparse COO tensors; densify "
            "with .to_dense() for anything else")
    try:
        dtype = DTYPES[t.dtype]
    except KeyError:
        raise DtypeError(f"torch dtype {t.dtype} is not supported; use one of "
                         f"{[d.name for d in dt.SUPPORTED]}") from None
    if t.is_cpu:
        device = CPU
    elif t.is_cuda:
        device = Device("cuda", t.get_device())
    else:
        raise InvalidArgumentError(f"tensors on {t.device} are not supported; use CPU or CUDA "
                                   "tensors")
    strides = None if t.is_contiguous() else tuple(t.stride())
    return Buffer(t.data_ptr(), tuple(t.shape), dtype, device, strides, False, t)


#: the tensor types whose facts the fast path reads (not subclasses such as DTensor);
#: mcrdl_torch reads them (address, elements, ``DTYPES[t.dtype]``) where the tensor is
#: one of these, on the CPU and contiguous, without making a Buffer (about 0.4 µs)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of contiguous ``t`` that keeps dim 0 (so split sizes in rows still
    hold): for calls that only move data, any dtype travels as its bytes."""
    rows = t.shape[0] if t.dim() else 1
    per_row = t.numel() // rows if rows else math.prod(t.shape[1:])
    return t.reshape(rows, per_row).view(torch.uint8)


def write_back(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where ``dst`` may repeat memory (an expanded tensor: stride 0
    along some dims, where torch's copy_ refuses to write). Those dims are written once,
    from index 0 of ``src``: an in-place collective on an expanded tensor is only
    meaningful when the result is the same along them, as it is when every rank's input
    is expanded alike."""
    for d, (stride, size) in enumerate(zip(dst.stride(), dst.shape)):
        if stride == 0 and size > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)


def _bad(obj):
    raise InvalidArgumentError(f"expected a torch.Tensor, got {type(obj).__name__}")


def to_buffers(ts, what: str) -> list:
    if ts is None:
        return None
    if isinstance(ts, torch.Tensor) or not hasattr(ts, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a list of tensors, got {type(ts).__name__}")
    return [to_buffer(t) for t in ts]
