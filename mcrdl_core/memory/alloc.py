"""Fresh contiguous Buffers for the temporaries a call needs: NumPy memory on the host,
CuPy memory on a GPU (CuPy imported only then).

A module of its own, not a Buffer method: a GPU temporary is allocated on the stream of
the user's buffer it stands in for, which is ``cuda.py``'s business, and ``cuda.py``
builds on ``buffer.py``; here both meet without an import cycle.
"""
from __future__ import annotations

import numpy as np

from . import cuda
from ..base import dtypes as _dt
from .buffer import CPU, Buffer, Device


def empty(shape, dtype, device: Device = CPU, like: Buffer | None = None) -> Buffer:
    """Fresh contiguous memory of ``shape`` and ``dtype`` on ``device``.

    ``like``: the user's buffer this temporary stands in for. On a GPU the memory is
    then allocated on ``like``'s producer stream (CuPy's pool hands it out again only to
    work ordered after that stream), the Buffer is stamped with that stream (its writes
    are ordered there: whoever reads it waits on it) and records ``like`` as its
    ``origin``."""
    dt = _dt.lookup(dtype)
    if device.kind == "cpu":
        return Buffer.from_numpy(np.empty(shape, dtype=dt.np_dtype))
    cupy = cuda.cupy()
    np_dt = np.uint16 if dt is _dt.bfloat16 else dt.np_dtype
    with cupy.cuda.Device(device.index):
        if like is None or like.device != device:
            arr, stream = cupy.empty(shape, dtype=np_dt), None
        else:
            stream = cuda.producer_stream(like)
            with cuda.stream(stream, device.index):
                arr = cupy.empty(shape, dtype=np_dt)
    buf = Buffer(arr.data.ptr, arr.shape, dt, device, None, False, arr)
    if stream is not None:
        buf.stream = stream
        buf.origin = like.origin if like.origin is not None else like
    return buf
