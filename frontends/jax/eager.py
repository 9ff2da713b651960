"""The eager path of mcrdl_jax: concrete JAX arrays in, new JAX arrays out.

The input enters the core through DLPack with no copy; results are written into fresh
64-byte-aligned host buffers (``host.py``) that JAX adopts through DLPack, again with no
copy (through JAX's own host-to-array call where it shares memory; bfloat16 results are
copied once on the public fallback, as DLPack from NumPy has no bfloat16), and ops that work in place in the core (all_reduce, reduce, broadcast) first
copy the input into the result buffer, since JAX arrays are immutable. Signatures match
``lowering.py`` so that ``autodiff.py`` can call either.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mcrdl_core import dtypes as _dt
from mcrdl_core.base.errors import InvalidArgumentError, UnsupportedError

from . import host

_JITTED = []  # non-empty once a call took the traced path (jitted communication may exist)


def saw_traced_call() -> None:
    if not _JITTED:
        _JITTED.append(True)


def placement(x, what: str) -> str | None:
    """The platform of a concrete JAX array ("cpu" or "gpu"; None for anything else,
    e.g. a NumPy array). Each process passes its own single-device array; GPU arrays
    take ``gpu.py``'s path. Other platforms are refused with what to do."""
    if not isinstance(x, jax.Array):
        return None
    dev = getattr(x.sharding, "_device", None)
    if dev is None:
        devs = x.devices()
        if len(devs) != 1:
            raise InvalidArgumentError(
                f"mcrdl_jax: {what} is sharded over {len(devs)} devices; each process passes "
                "its own single-device array (x.addressable_shards[0].data)")
        dev = next(iter(devs))
    if dev.platform not in ("cpu", "gpu"):
        raise UnsupportedError(
            f"mcrdl_jax: {what} is on {dev.platform}; mcrdl_jax handles CPU and CUDA GPU "
            "arrays. Move it with jax.device_put(x, jax.devices('cpu')[0])")
    return dev.platform


def ready(*xs) -> bool:
    """Before any eager call, from the public API or from a derivative rule run eagerly
    under ``jax.grad``: the arrays' placement is checked, and communication that jitted
    programs left in flight is waited for (``jax.effects_barrier``), so that eager and
    jitted calls on one communicator never overlap. True when the arrays are on a GPU
    (then ``gpu.py`` runs the call); arrays on a CPU and a GPU in one call are refused."""
    if len(xs) == 1:
        on_gpu = placement(xs[0], "x") == "gpu"
    else:
        where = {placement(x, "like" if i else "x") for i, x in enumerate(xs)} - {None}
        if len(where) > 1:
            raise InvalidArgumentError(
                "mcrdl_jax: the arrays of one call are on a CPU and a GPU; put them on one")
        on_gpu = "gpu" in where
    if _JITTED:
        jax.effects_barrier()
    return on_gpu

_TOKEN = []


def token():
    """The value ``send`` returns: a float32 zero, made once (JAX arrays are immutable)."""
    if not _TOKEN:
        _TOKEN.append(jnp.zeros((), jnp.float32))
    return _TOKEN[0]


_AVALS = {}  # (shape, dtype) -> ShapedArray: building one costs about 8 µs
_FAST = []  # (xla_client, cpu device, its sharding) once the fast path has been checked


def _fast_path():
    """JAX's own zero-copy host-to-array call: about 4 µs where ``from_dlpack`` takes
    about 50 (measured with JAX 0.10.2). It is internal, so it is checked once and the
    public call is used if it is missing or does not share memory."""
    if not _FAST:
        try:
            from jax._src.lib import xla_client as xc
            dev = jax.local_devices(backend="cpu")[0]  # this process's own
            sh = jax.sharding.SingleDeviceSharding(dev)
            probe = host.empty((2,), np.float32)
            y = xc.batched_device_put(jax.core.ShapedArray(probe.shape, probe.dtype), sh,
                                      [probe], [dev], False)
            ok = isinstance(y, jax.Array) and y.unsafe_buffer_pointer() == probe.ctypes.data
            _FAST.append((xc, dev, sh) if ok else None)
        except Exception:  # noqa: BLE001  (any failure: use the public call)
            _FAST.append(None)
    return _FAST[0]


def to_jax(arr: np.ndarray):
    """A JAX array over ``arr``'s memory (64-byte aligned, made by ``host.empty``)."""
    fast = _FAST[0] if _FAST else _fast_path()
    if fast is not None:
        xc, dev, sh = fast
        aval = _AVALS.get((arr.shape, arr.dtype))
        if aval is None:
            aval = _AVALS[(arr.shape, arr.dtype)] = jax.core.ShapedArray(arr.shape, arr.dtype)
        return xc.batched_device_put(aval, sh, [arr], [dev], False)
    if arr.dtype == _dt.bfloat16.np_dtype:
        return jnp.asarray(arr)  # one copy: DLPack from NumPy has no bfloat16
    return jax.dlpack.from_dlpack(arr)


def _or_input(y, x):
    return x if y is None else to_jax(y)


def all_reduce(x, op, group, backend, compression=None):
    return to_jax(host.all_reduce(x, op, group, backend, compression))


def reduce(x, dst, op, group, backend):
    return _or_input(host.reduce(x, dst, op, group, backend), x)


def broadcast(x, src, group, backend):
    return to_jax(host.broadcast(x, src, group, backend))


def all_gather(x, group, backend, compression=None):
    return to_jax(host.all_gather(x, group, backend, compression))


def reduce_scatter(x, op, group, backend, compression=None):
    return to_jax(host.reduce_scatter(x, op, group, backend, compression))


def all_to_all(x, group, backend, input_split_sizes=None, output_split_sizes=None,
               compression=None):
    return to_jax(host.all_to_all(x, group, backend, input_split_sizes, output_split_sizes,
                                  compression))


def gather(x, dst, group, backend):
    return _or_input(host.gather(x, dst, group, backend), x)


def scatter(x, src, group, backend):
    return to_jax(host.scatter(x, src, group, backend))


def send(x, dst, group, tag, backend):
    host.send(x, dst, group, tag, backend)
    return token()


def recv(like, src, group, tag, backend):
    return to_jax(host.recv(like.shape, host.np_dtype(like), src, group, tag, backend))


def sendrecv(sendbuf, like, source, dest, group, tag, backend):
    return to_jax(host.sendrecv(sendbuf, like.shape, host.np_dtype(like), source, dest, group,
                                tag, backend))
