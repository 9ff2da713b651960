"""Consume DLPack capsules with ctypes: no framework import, zero-copy.

A producer's ``__dlpack__`` returns a PyCapsule holding a ``DLManagedTensor`` (legacy,
name "dltensor") or a ``DLManagedTensorVersioned`` (DLPack >= 1.0, name
"dltensor_versioned", which adds a read-only flag). As the DLPack protocol asks of a
consumer, we rename the capsule to "used_..." and call the tensor's ``deleter`` when the
last reference to our view goes away (:class:`_ManagedTensor.__del__`).

Stream rule (DLPack 2023.x): the consumer passes the stream it will use; ``None`` or
omitted means the legacy default stream for CUDA, ``-1`` means "do not synchronize".
CPU producers are called without a stream argument.
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

from ..base import dtypes as _dt
from ..base.errors import DtypeError, InvalidArgumentError

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED = 1, 2, 3, 13
FLAG_READ_ONLY = 1 << 0


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


# The deleter is called with the GIL held (PYFUNCTYPE): some producers' deleters
# (NumPy's) touch Python objects; those that take the GIL themselves re-enter safely.
_DELETER = ctypes.PYFUNCTYPE(None, c_void_p)

_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, c_char_p]

_LEGACY, _USED = b"dltensor", b"used_dltensor"
_VERSIONED, _USED_VERSIONED = b"dltensor_versioned", b"used_dltensor_versioned"


class _ManagedTensor:
    """Owns one consumed DLManagedTensor(Versioned) and frees it exactly once."""

    __slots__ = ("_addr", "_deleter", "producer")

    def __init__(self, addr: int, deleter: int | None, producer: object):
        self._addr = addr
        self._deleter = deleter
        self.producer = producer  # kept alive as a courtesy; the capsule owns the memory

    def __del__(self):
        if self._deleter:
            _DELETER(self._deleter)(self._addr)
            self._deleter = None


def parse_capsule(capsule, producer=None):
    """Consume a DLPack capsule. Returns (ptr, shape, strides, dtype, device, readonly, owner).

    ``strides`` is a tuple in elements or None for compact row-major.
    """
    if _api.PyCapsule_IsValid(capsule, _VERSIONED):
        addr = _api.PyCapsule_GetPointer(capsule, _VERSIONED)
        mt = DLManagedTensorVersioned.from_address(addr)
        if mt.version.major > 1:
            raise InvalidArgumentError(
                f"DLPack major version {mt.version.major} is newer than MCR-DL understands (1)")
        tensor, readonly, deleter = mt.dl_tensor, bool(mt.flags & FLAG_READ_ONLY), mt.deleter
        _api.PyCapsule_SetName(capsule, _USED_VERSIONED)
    elif _api.PyCapsule_IsValid(capsule, _LEGACY):
        addr = _api.PyCapsule_GetPointer(capsule, _LEGACY)
        mt = DLManagedTensor.from_address(addr)
        tensor, readonly, deleter = mt.dl_tensor, False, mt.deleter
        _api.PyCapsule_SetName(capsule, _USED)
    else:
        raise InvalidArgumentError("object's __dlpack__ did not return an unused DLPack capsule "
                                   "(was it already consumed?)")
    owner = _ManagedTensor(addr, deleter, producer)
    ndim = tensor.ndim
    shape = tuple(tensor.shape[i] for i in range(ndim))
    strides = tuple(tensor.strides[i] for i in range(ndim)) if tensor.strides else None
    dtype = _dt.from_dlpack_code(tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    dev_type, dev_id = tensor.device.device_type, tensor.device.device_id
    if dev_type in (KDL_CPU, KDL_CUDA_HOST):
        device = ("cpu", 0)
    elif dev_type in (KDL_CUDA, KDL_CUDA_MANAGED):
        device = ("cuda", dev_id)
    else:
        raise DtypeError(f"DLPack device type {dev_type} is not supported; MCR-DL handles CPU "
                         "and CUDA memory")
    ptr = (tensor.data or 0) + tensor.byte_offset
    return ptr, shape, strides, dtype, device, readonly, owner


def consumer_stream(obj):
    """The stream to hand a CUDA producer's ``__dlpack__``: CuPy's current stream on the
    producer's device (1 = DLPack's legacy default stream when that is CuPy's null
    stream), or None for host producers and when CuPy is not installed. Only CUDA
    producers ever import CuPy here."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None:
        return None
    try:
        kind, index = dev()
    except Exception:  # a producer that cannot say: let __dlpack__ decide
        return None
    if kind not in (KDL_CUDA, KDL_CUDA_MANAGED):
        return None
    try:
        import cupy

        ptr = cupy.cuda.get_current_stream(index).ptr
    except Exception:  # noqa: BLE001 - no CuPy, or no usable device: legacy semantics
        return None
    return ptr or 1


def export(obj, stream=None):
    """Call ``obj.__dlpack__`` the modern way when the producer allows it."""
    kwargs = {} if stream is None else {"stream": stream}
    try:
        return obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:  # producer predates DLPack 1.0 keywords
        return obj.__dlpack__(**kwargs)
