"""Element types, keyed by their DLPack (type code, bits) pair.

NumPy has no bfloat16; ``ml_dtypes`` (the package JAX uses for it) provides a real
NumPy dtype, so host arithmetic on bfloat16 buffers (reference checks, AVG division,
upcasting for MPI reductions) works with ordinary NumPy calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from .errors import DtypeError

# DLPack DLDataTypeCode values (dlpack.h)
DL_INT, DL_UINT, DL_FLOAT, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 4, 5, 6


@dataclass(frozen=True, eq=False)
class DType:
    """One element type. ``kind`` is 'float', 'int', 'uint', 'bool' or 'complex'.

    Each DType is a singleton, compared and hashed by identity (cheap dict keys)."""

    name: str
    code: int
    bits: int
    kind: str
    np_dtype: np.dtype
    itemsize: int = field(init=False)  # bytes; a plain attribute: read on every call

    def __post_init__(self):
        object.__setattr__(self, "itemsize", self.bits // 8)

    @property
    def is_floating(self) -> bool:
        return self.kind == "float"

    @property
    def is_integral(self) -> bool:
        return self.kind in ("int", "uint", "bool")

    @property
    def is_half(self) -> bool:
        """16-bit floats, which MPI cannot reduce natively."""
        return self.kind == "float" and self.bits == 16

    def __repr__(self) -> str:
        return f"mcrdl.{self.name}"


def _d(name, code, bits, kind, np_dtype):
    return DType(name, code, bits, kind, np.dtype(np_dtype))


float16 = _d("float16", DL_FLOAT, 16, "float", np.float16)
bfloat16 = _d("bfloat16", DL_BFLOAT, 16, "float", ml_dtypes.bfloat16)
float32 = _d("float32", DL_FLOAT, 32, "float", np.float32)
float64 = _d("float64", DL_FLOAT, 64, "float", np.float64)
int8 = _d("int8", DL_INT, 8, "int", np.int8)
int16 = _d("int16", DL_INT, 16, "int", np.int16)
int32 = _d("int32", DL_INT, 32, "int", np.int32)
int64 = _d("int64", DL_INT, 64, "int", np.int64)
uint8 = _d("uint8", DL_UINT, 8, "uint", np.uint8)
bool_ = _d("bool", DL_BOOL, 8, "bool", np.bool_)
complex64 = _d("complex64", DL_COMPLEX, 64, "complex", np.complex64)
complex128 = _d("complex128", DL_COMPLEX, 128, "complex", np.complex128)

ALL = (float16, bfloat16, float32, float64, int8, int16, int32, int64, uint8, bool_,
       complex64, complex128)

#: The dtypes every backend of MCR-DL supports for every op (tested for each).
SUPPORTED = (float16, bfloat16, float32, float64, int8, uint8, int32, int64)

_BY_DL = {(d.code, d.bits): d for d in ALL}
_BY_NAME = {d.name: d for d in ALL}
BY_NP = {d.np_dtype: d for d in ALL}


def from_dlpack_code(code: int, bits: int, lanes: int = 1) -> DType:
    if lanes != 1:
        raise DtypeError(f"vector dtypes (DLPack lanes={lanes}) are not supported; "
                         "pass a tensor of scalars")
    try:
        return _BY_DL[(code, bits)]
    except KeyError:
        raise DtypeError(f"DLPack dtype (code={code}, bits={bits}) is not supported; "
                         f"use one of {[d.name for d in SUPPORTED]}") from None


def lookup(obj) -> DType:
    """DType from a DType, a name ('float32'), or anything ``np.dtype`` accepts."""
    if isinstance(obj, DType):
        return obj
    if isinstance(obj, str) and obj in _BY_NAME:
        return _BY_NAME[obj]
    try:
        return BY_NP[np.dtype(obj)]
    except (TypeError, KeyError):
        raise DtypeError(f"unknown dtype {obj!r}; use one of "
                         f"{[d.name for d in SUPPORTED]}") from None


def dtype_class(dt: DType) -> str:
    """Coarse class used as a tuning-table key: 'float' or 'int'."""
    return "float" if dt.kind in ("float", "complex") else "int"
