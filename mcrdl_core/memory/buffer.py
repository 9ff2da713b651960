"""Buffer: a zero-copy view of any DLPack producer (numpy, torch, jax, cupy).

A Buffer records what a communication library needs (address, element type, shape,
device, read-only flag) and keeps the producer's memory alive through ``owner``. It
offers a host view as a NumPy array and a CUDA view as a CuPy array, both zero-copy.

``stream`` (CUDA buffers only): the raw ``cudaStream_t`` on which the producer's writes
are known to be ordered, when the Buffer was made through DLPack with a consumer stream
(the producer then made that stream wait for its data). None means "ask the owner":
see ``mcrdl_core.memory.cuda.producer_stream`` (torch's current stream for torch tensors,
CuPy's current stream for CuPy arrays, the legacy default stream otherwise).

``origin``: for a temporary a call made (``alloc.empty(..., like=...)``: the
concatenated list of a list-form collective, a staging copy of a non-contiguous input),
the user's buffer it stands in for. Its framework tells whose *current* stream a
blocking call orders the caller on (torch's for torch tensors).
"""
from __future__ import annotations

import math
import sys
from ctypes import addressof as _addressof
from ctypes import c_char as _c_char
from typing import NamedTuple

import numpy as np

from . import dlpack as _dl
from ..base import dtypes as _dt
from ..base.errors import InvalidArgumentError


class Device(NamedTuple):
    kind: str  # "cpu" or "cuda"
    index: int = 0

    def __str__(self) -> str:
        return self.kind if self.kind == "cpu" else f"{self.kind}:{self.index}"


CPU = Device("cpu", 0)


class _HostView:
    """Carrier of ``__array_interface__``; as the base of the NumPy view it keeps the
    memory's owner (the producer's tensor or array) alive as long as the view lives.

    It holds the owner, not the Buffer: the Buffer caches the view (``_host``), and a
    NumPy array is invisible to the garbage collector, so a view holding its Buffer
    would make a cycle that is never freed -- every tensor whose host view a call took
    (the compressed collectives take one of each input and output) would leak."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, buf: "Buffer", np_dtype: np.dtype):
        self.owner = buf.owner
        isz = buf.dtype.itemsize
        self.__array_interface__ = {
            "version": 3,
            "shape": buf.shape,
            "typestr": np_dtype.str,
            "data": (buf.ptr if buf.numel else 0, buf.readonly),
            "strides": None if buf.strides is None else tuple(s * isz for s in buf.strides),
        }


class Buffer:
    """View of a tensor's memory. ``strides`` is in elements, None meaning row-major."""

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "readonly", "owner",
                 "numel", "_host", "stream", "origin")

    def __init__(self, ptr: int, shape: tuple, dtype: _dt.DType, device: Device = CPU,
                 strides: tuple | None = None, readonly: bool = False, owner: object = None):
        self.ptr = ptr
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self.readonly = readonly
        self.owner = owner
        self.numel = math.prod(self.shape)
        if strides is not None and _is_compact(self.shape, strides):
            strides = None
        self.strides = None if strides is None else tuple(strides)
        self._host = None
        self.stream = None  # CUDA: stream the producer's data is ready on (None: ask owner)
        self.origin = None  # temporaries: the user's buffer this one stands in for

    # --- construction -----------------------------------------------------------------
    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> "Buffer":
        """Zero-copy view of a NumPy array (bfloat16 via ml_dtypes included)."""
        dt = _dt.BY_NP.get(arr.dtype) or _dt.lookup(arr.dtype)
        flags = arr.flags
        if flags.c_contiguous and flags.writeable:  # the common case, in fewest steps
            try:  # the address through the buffer protocol: 0.4 µs against 1.5
                ptr = _addressof(_c_char.from_buffer(arr))
            except (TypeError, ValueError):  # empty, or a dtype the protocol cannot export
                ptr = arr.__array_interface__["data"][0]
            buf = cls(ptr, arr.shape, dt, CPU, None, False, arr)
            buf._host = arr
            return buf
        strides = _element_strides(arr, "np")
        buf = cls(arr.__array_interface__["data"][0], arr.shape, dt, CPU, strides,
                  not arr.flags.writeable, arr)
        if not buf.readonly and strides is None:
            buf._host = arr.reshape(arr.shape)  # a view: no copy, no new memory
        return buf

    @classmethod
    def from_cupy(cls, arr) -> "Buffer":
        """Zero-copy view of a CuPy array, read from its attributes: what ``from_dlpack``
        gives (the same pointer, shape, strides and device, and CuPy's current stream on
        the array's device as the producer stream) without making and parsing a DLPack
        capsule on every call."""
        dt = _dt.BY_NP.get(arr.dtype) or _dt.lookup(arr.dtype)
        strides = _element_strides(arr, "cupy")
        index = arr.device.id
        buf = cls(arr.data.ptr, arr.shape, dt, Device("cuda", index), strides, False, arr)
        buf.stream = sys.modules["cupy"].cuda.get_current_stream(index).ptr
        return buf

    @classmethod
    def from_dlpack(cls, obj, stream=None) -> "Buffer":
        """Zero-copy view of any DLPack producer. For a CUDA producer and ``stream=None``
        the consumer stream handed to ``__dlpack__`` is CuPy's current stream (when CuPy
        is installed), so the producer orders its pending writes before it (JAX, torch and
        CuPy all do) and the Buffer records that stream."""
        if stream is None:
            stream = _dl.consumer_stream(obj)
        capsule = _dl.export(obj, stream)
        ptr, shape, strides, dtype, device, readonly, owner = _dl.parse_capsule(capsule, obj)
        buf = cls(ptr, shape, dtype, Device(*device), strides, readonly, owner)
        if buf.device.kind == "cuda" and stream is not None and stream != -1:
            buf.stream = 0 if stream == 1 else stream  # 1 is DLPack's name of the legacy stream
        return buf

    # --- properties ---------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.strides is None

    @property
    def is_cuda(self) -> bool:
        return self.device.kind == "cuda"

    def span(self) -> tuple[int, int]:
        """[lo, hi) byte addresses this buffer can touch (for overlap ordering)."""
        if self.numel == 0:
            return (self.ptr, self.ptr)
        if self.strides is None:
            return (self.ptr, self.ptr + self.nbytes)
        isz = self.dtype.itemsize
        lo = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0) * isz
        hi = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0) * isz + isz
        return (self.ptr + lo, self.ptr + hi)

    # --- views --------------------------------------------------------------------------
    def host(self) -> np.ndarray:
        """Zero-copy NumPy view (CPU buffers only). bfloat16 comes out as ml_dtypes.bfloat16."""
        if self._host is None:
            if self.device.kind != "cpu":
                raise InvalidArgumentError(f"host() of a {self.device} buffer; use cuda()")
            if self.dtype is _dt.bfloat16:  # its typestr is opaque ('V2'): view the bits
                self._host = np.asarray(_HostView(self, np.dtype(np.uint16))).view(self.dtype.np_dtype)
            else:
                self._host = np.asarray(_HostView(self, self.dtype.np_dtype))
        return self._host

    def cuda(self):
        """Zero-copy CuPy view (CUDA buffers only); bfloat16 is viewed as uint16."""
        if self.device.kind != "cuda":
            raise InvalidArgumentError(f"cuda() of a {self.device} buffer; use host()")
        import cupy  # lazy: only for CUDA buffers

        np_dt = np.dtype(np.uint16) if self.dtype is _dt.bfloat16 else self.dtype.np_dtype
        mem = cupy.cuda.UnownedMemory(self.ptr, max(self.nbytes, 1), self, self.device.index)
        strides = None if self.strides is None else tuple(s * self.dtype.itemsize for s in self.strides)
        return cupy.ndarray(self.shape, np_dt, cupy.cuda.MemoryPointer(mem, 0), strides)

    def array(self):
        """host() or cuda(), whichever matches the device."""
        return self.host() if self.device.kind == "cpu" else self.cuda()

    def flat(self, offset: int = 0, count: int | None = None) -> "Buffer":
        """1-D view of ``count`` elements starting at element ``offset`` (contiguous only)."""
        if self.strides is not None:
            raise InvalidArgumentError("flat() needs a contiguous buffer")
        if count is None:
            count = self.numel - offset
        if offset < 0 or count < 0 or offset + count > self.numel:
            raise InvalidArgumentError(f"view [{offset}, {offset + count}) is outside a buffer of "
                                       f"{self.numel} elements")
        view = Buffer(self.ptr + offset * self.dtype.itemsize, (count,), self.dtype, self.device,
                      None, self.readonly, self)
        view.stream = self.stream
        view.origin = self.origin
        return view

    def describe(self) -> str:
        return f"{self.dtype.name}{list(self.shape)} on {self.device}"

    def __repr__(self) -> str:
        return f"Buffer({self.describe()}, ptr=0x{self.ptr:x}{', readonly' if self.readonly else ''})"


def _element_strides(arr, module: str) -> tuple | None:
    """An array's strides in elements (None when C-contiguous), from a NumPy or CuPy
    array's byte strides; strides that are not whole elements are refused."""
    if arr.flags.c_contiguous:
        return None
    isz = arr.itemsize
    strides = tuple(s // isz for s in arr.strides)
    if any(s * isz != b for s, b in zip(strides, arr.strides)):
        raise InvalidArgumentError("array strides are not a multiple of its item size; "
                                   f"pass {module}.ascontiguousarray(arr)")
    return strides


def _is_compact(shape: tuple, strides) -> bool:
    """Whether ``strides`` (in elements) lay ``shape`` out in compact row-major order, as
    NumPy judges C-contiguity: any layout of no elements is, and the stride of a
    dimension of size 1 is never used (torch gives ``torch.from_numpy(np.zeros(0))``
    stride (0,), and a size-1 dimension any stride)."""
    if 0 in shape:
        return True
    return all(n == 1 or s == c for n, s, c in zip(shape, strides, _compact_strides(shape)))


def _compact_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def as_buffer(obj, stream=None) -> Buffer:
    """A Buffer for ``obj``: a Buffer, a NumPy array, or any DLPack producer."""
    if isinstance(obj, Buffer):
        return obj
    if isinstance(obj, np.ndarray):
        return Buffer.from_numpy(obj)
    cp = sys.modules.get("cupy")  # a CuPy array means CuPy is loaded: no import here
    if cp is not None and type(obj) is cp.ndarray and stream is None:
        return Buffer.from_cupy(obj)
    if hasattr(obj, "__dlpack__"):
        return Buffer.from_dlpack(obj, stream)
    raise InvalidArgumentError(
        f"expected a tensor or array (NumPy, PyTorch, JAX, CuPy or any DLPack producer), "
        f"got {type(obj).__name__}")
