"""CUDA streams, events and host staging for CUDA buffers (CuPy imported lazily).

Nothing here imports CuPy (or torch) at module level: the functions run only for CUDA
buffers, where CuPy is required (``pip install 'mcr-dl[gpu]'``). Stream handles are raw
``cudaStream_t`` integers (0 = the legacy default stream), shared by torch, CuPy and
JAX because all of them use the device's primary context.

Stream rules (enforced by the backends through these helpers):

- *Producer stream* of a Buffer (``producer_stream``): the stream its pending writes
  are ordered on. ``Buffer.stream`` when DLPack gave one (the producer made that
  stream wait: JAX, CuPy and torch all do), else torch's current stream for a torch
  tensor, else CuPy's current stream.
- A *stream library* (NCCL) makes its communication stream wait on an event recorded
  on the producer stream: no host wait at all.
- A *host library* (MPI, Gloo) may only touch the memory once the GPU is past that
  event. The event is *queried* from the progress loop (``ready``), never synchronized,
  so other libraries' in-flight work keeps being driven meanwhile.
- Staging (``HostStage``): device-to-host copies into pinned memory are enqueued on the
  producer stream, the host library works on the pinned copies, and the results are
  copied back on the same stream; the Work completes when that copy's event is done.
"""
from __future__ import annotations

import contextlib
import functools
import sys

from ..base import config as _config
from .buffer import Buffer
from ..base.errors import BackendUnavailableError
from ..base.ops import Op
from ..engine.work import ChainWork, EventWork

# cudaMemcpyKind
H2D, D2H = 1, 2

_CUPY_REASON: list = []  # memo: [reason or None]


def cupy_reason() -> str | None:
    """None if CuPy can be imported, else why not (for messages)."""
    if not _CUPY_REASON:
        try:
            import cupy  # noqa: F401
            _CUPY_REASON.append(None)
        except ImportError as exc:
            if getattr(exc, "name", None) == "cupy":
                _CUPY_REASON.append("cupy is not installed (pip install 'mcr-dl[gpu]')")
            else:
                _CUPY_REASON.append(f"cupy cannot be imported ({exc})")
        except Exception as exc:  # noqa: BLE001 - a broken CUDA install can raise anything
            _CUPY_REASON.append(f"cupy cannot be imported ({type(exc).__name__}: {exc})")
    return _CUPY_REASON[0]


def cupy():
    """The cupy module; BackendUnavailableError saying why if it cannot be had."""
    reason = cupy_reason()
    if reason is not None:
        raise BackendUnavailableError(f"CUDA buffers need CuPy: {reason}")
    import cupy as cp

    return cp


def device_reason() -> str | None:
    """None if CUDA can run here (CuPy imports and sees a device), else why not."""
    reason = cupy_reason()
    if reason is not None:
        return reason
    cp = cupy()
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        return (f"no usable CUDA device ({exc}); is an NVIDIA GPU with its driver present? "
                "(nvidia-smi)")
    if n == 0:
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
    return None


def device_count() -> int:
    """Visible CUDA devices (0 if CUDA cannot run here)."""
    if device_reason() is not None:
        return 0
    return cupy().cuda.runtime.getDeviceCount()


# --- streams and events ---------------------------------------------------------------
def root_owner(buf: Buffer):
    """The framework object behind ``buf`` (a torch tensor, a CuPy or JAX array, ...)."""
    owner = buf.owner
    while isinstance(owner, Buffer):
        owner = owner.owner
    return getattr(owner, "producer", owner)  # DLPack: the object that made the capsule


def _framework(obj) -> str:
    return type(obj).__module__.split(".")[0]


def current_stream(buf: Buffer) -> int:
    """The caller's current stream on ``buf``'s device, in the framework that owns it:
    torch's for torch tensors, CuPy's for everything else. A temporary made for a call
    (``alloc.empty(..., like=user_buffer)``) answers for the user's buffer."""
    if buf.origin is not None:
        buf = buf.origin
    if _framework(root_owner(buf)) == "torch":
        return _torch_stream()(buf.device.index)
    return cupy().cuda.get_current_stream(buf.device.index).ptr


_TORCH_STREAM: list = []  # memo: device index -> torch's current raw stream handle


def _torch_stream():
    """torch's current stream handle on a device, as a function of the device index:
    ``torch._C._cuda_getCurrentRawStream`` where torch has it (one C call; the public
    ``torch.cuda.current_stream(i).cuda_stream`` builds a Stream object first, 1.4 µs a
    call measured on an H200's host)."""
    if not _TORCH_STREAM:
        torch = sys.modules["torch"]  # loaded already: the buffer is a torch tensor
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH_STREAM.append(raw if raw is not None
                             else (lambda i: torch.cuda.current_stream(i).cuda_stream))
    return _TORCH_STREAM[0]


def producer_stream(buf: Buffer) -> int:
    """The stream the producer's pending writes to ``buf`` are ordered on."""
    return buf.stream if buf.stream is not None else current_stream(buf)


class _Handle:
    """A raw stream handle offered through the CUDA stream protocol (what CuPy >= 14's
    ``Stream.from_external`` takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


_WRAPPERS: dict = {}  # (handle, device) -> CuPy stream object
_WRAPPERS_MAX = 4096  # a bound: a wrapper is only (handle, device), so a rebuild is harmless


def stream(handle: int, device: int):
    """The CuPy stream object for a raw handle (0: the legacy default stream), one
    cached wrapper per (handle, device). CuPy >= 14 wraps it with
    ``Stream.from_external`` (``ExternalStream`` is deprecated there and warned on every
    construction); older CuPy with ``ExternalStream``."""
    key = (handle, device)
    s = _WRAPPERS.get(key)
    if s is not None:
        return s
    cp = cupy()
    if handle == 0:
        s = cp.cuda.Stream.null
    elif hasattr(cp.cuda.Stream, "from_external"):
        s = cp.cuda.Stream.from_external(_Handle(handle))
        # the protocol carries no device; CuPy takes the current one (or -1), and
        # entering a stream checks it against the current device: record the real one
        s.device_id = device
    else:
        s = cp.cuda.ExternalStream(handle, device)
    if len(_WRAPPERS) >= _WRAPPERS_MAX:
        _WRAPPERS.clear()
    _WRAPPERS[key] = s
    return s


_LASTING: dict = {}  # (device, slot) -> stream made by MCR-DL, never destroyed


def lasting_stream(device: int, slot: int):
    """A non-blocking CuPy stream on ``device`` that lives as long as the process.

    Communication streams come from here: torch may record tensors on them
    (``Tensor.record_stream``) and query them long after the communicator that used
    them was destroyed, so they are never freed. ``slot`` (a group's index) gives each
    group its own stream; a later communicator of the same slot reuses it."""
    key = (device, slot)
    s = _LASTING.get(key)
    if s is None:
        cp = cupy()
        with cp.cuda.Device(device):
            s = _LASTING[key] = cp.cuda.Stream(non_blocking=True)
    return s


def on_device(index: int):
    """A context making CUDA device ``index`` current (CuPy's ``Device``)."""
    return cupy().cuda.Device(index)


def device_bytes(nbytes: int, device: int):
    """``nbytes`` zeroed bytes of device memory on ``device`` (a CuPy array)."""
    cp = cupy()
    with cp.cuda.Device(device):
        return cp.zeros(max(nbytes, 1), dtype=cp.uint8)


def current_device() -> int:
    """The calling thread's current CUDA device (torch and CuPy share it:
    ``torch.cuda.set_device`` and ``cupy.cuda.Device(i).use()`` both set it)."""
    return cupy().cuda.runtime.getDevice()


def pci_bus_id(device: int) -> str:
    """PCI bus id of CUDA device ``device`` ("0000:3b:00.0"): the GPU's identity on its
    host, whatever CUDA_VISIBLE_DEVICES renumbered it to."""
    return cupy().cuda.Device(device).pci_bus_id


def record(handle: int, device: int):
    """A new (timing-free) event recorded on stream ``handle`` of ``device``."""
    cp = cupy()
    with cp.cuda.Device(device):
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream(handle, device))
    return ev


def wait_on(waiter: int, streams, device: int) -> None:
    """Make stream ``waiter`` wait for the work enqueued so far on each of ``streams``
    (events recorded there; no host wait)."""
    w = stream(waiter, device)
    for h in set(streams):
        if h != waiter:
            w.wait_event(record(h, device))


def signal(source: int, waiters, device: int) -> None:
    """Make each stream in ``waiters`` wait for the work enqueued so far on stream
    ``source`` (one event; no host wait)."""
    others = set(waiters) - {source}
    if others:
        ev = record(source, device)
        for h in others:
            stream(h, device).wait_event(ev)


@contextlib.contextmanager
def copies_into(targets, sources=(), after_current: bool = False):
    """Context for CuPy copies that write ``targets`` (a list-form call's temporary, or
    its user outputs). They run on the producer stream of ``targets[0]``, after the
    work enqueued so far on the producer streams of ``sources`` (and on CuPy's current
    stream if ``after_current``: where a waited NCCL op's finalizers run, ordered after
    the op); at exit every other target's producer stream waits for the copies. Host
    buffers: no context."""
    first = targets[0]
    if first.device.kind != "cuda":
        yield
        return
    cp = cupy()
    dev = first.device.index
    with cp.cuda.Device(dev):
        s = producer_stream(first)
        before = [producer_stream(b) for b in sources]
        if after_current:
            before.append(cp.cuda.get_current_stream().ptr)
        wait_on(s, before, dev)
        with stream(s, dev):
            yield
        signal(s, [producer_stream(b) for b in targets[1:]], dev)


def cuda_buffers(args) -> list:
    return [a for a in args if isinstance(a, Buffer) and a.device.kind == "cuda"]


def ready(engine, bufs, backend: str, op, group) -> None:
    """Wait until the GPU has finished the producers' pending writes to ``bufs``, by
    querying events from the progress loop (never a blocking synchronize)."""
    dev = bufs[0].device.index
    works = [EventWork(backend, op, record(h, dev), group, desc="waiting for the producer stream")
             for h in {producer_stream(b) for b in bufs}]
    engine.wait(works)


# --- host staging ---------------------------------------------------------------------
class HostStage:
    """Pinned host mirrors of the CUDA buffers of one call, for a host library.

    All copies run on one stream: the producer stream of the first CUDA buffer, made to
    wait on the producer streams of the others, so the copies see every pending write
    and the caller's later work on that stream sees the results."""

    def __init__(self, bufs):
        self.device = bufs[0].device.index
        self.stream = producer_stream(bufs[0])
        wait_on(self.stream, [producer_stream(b) for b in bufs[1:]], self.device)
        self.back: list = []  # (device buffer, host mirror) to copy back
        self.mirrors: list = []

    def mirror(self, buf: Buffer, copy_in: bool, copy_out: bool) -> Buffer:
        cp = cupy()
        import cupyx

        # bfloat16 included: its NumPy dtype (ml_dtypes) is a plain 2-byte dtype
        arr = cupyx.empty_pinned((max(buf.numel, 1),), dtype=buf.dtype.np_dtype)[:buf.numel]
        host = Buffer.from_numpy(arr.reshape(buf.shape))
        if copy_in and buf.nbytes:
            with cp.cuda.Device(self.device):
                cp.cuda.runtime.memcpyAsync(host.ptr, buf.ptr, buf.nbytes, D2H, self.stream)
        if copy_out and buf.nbytes:
            self.back.append((buf, host))
        self.mirrors.append(host)
        return host

    def copy_back(self, backend: str, op, group):
        """Enqueue the host-to-device copies of the results; an EventWork for them."""
        if not self.back:
            return None
        cp = cupy()
        with cp.cuda.Device(self.device):
            for dev_buf, host in self.back:
                cp.cuda.runtime.memcpyAsync(dev_buf.ptr, host.ptr, dev_buf.nbytes, H2D,
                                            self.stream)
        ev = record(self.stream, self.device)
        return EventWork(backend, op, ev, group, keep=(self.mirrors,),
                         desc="copying the result back to the GPU")


#: Buffer arguments (positions after ``group``) each Backend op reads and writes
ROLES = {
    Op.SEND: ((0,), ()), Op.RECV: ((), (0,)), Op.BROADCAST: ((0,), (0,)),
    Op.REDUCE: ((0,), (0,)), Op.ALL_REDUCE: ((0,), (0,)), Op.ALL_GATHER: ((1,), (0,)),
    Op.REDUCE_SCATTER: ((1,), (0,)), Op.ALL_TO_ALL: ((1,), (0,)), Op.GATHER: ((1,), (0,)),
    Op.SCATTER: ((1,), (0,)), Op.BARRIER: ((), ()),
}


def staged_call(engine, backend: str, op, method, group, *args):
    """Run host-library ``method(group, *args)`` on pinned host mirrors of the CUDA
    buffers in ``args``: copy in on the producer stream, wait for the copies through
    the progress loop, issue the call, copy the results back when it completes."""
    bufs = cuda_buffers(args)
    if not bufs:
        return method(group, *args)
    reads, writes = ROLES[op]
    stage = HostStage(bufs)
    host_args = [stage.mirror(a, i in reads, i in writes)
                 if isinstance(a, Buffer) and a.device.kind == "cuda" else a
                 for i, a in enumerate(args)]
    ev = record(stage.stream, stage.device)
    engine.wait([EventWork(backend, op, ev, group, desc="copying to host for staging")])
    work = method(group, *host_args)
    return ChainWork(work, lambda: stage.copy_back(backend, op, group))


def cuda_dispatch(op):
    """Decorator for a host backend's op method ``fn(self, group, *args)``: calls on host
    buffers go straight to it (one type test per argument); calls with a CUDA buffer go
    to ``self.cuda_call(op, fn, group, args)``, which picks device pointers or staging."""
    def deco(fn):
        @functools.wraps(fn)
        def method(self, group, *args):
            for a in args:
                if a.__class__ is Buffer and a.device.kind != "cpu":
                    return self.cuda_call(op, fn, group, args)
            return fn(self, group, *args)
        return method
    return deco


def env_flag(name: str) -> bool | None:
    """A declared bool variable (``mcrdl_core.base.config``): True/False, None if unset."""
    return _config.flag(name)
