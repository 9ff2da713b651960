"""Streams of the CUDA path: stream wrappers (CPU, real CuPy), and, marked ``gpu``,
ordering of the list-form temporaries and of non-contiguous input copies against a
producer still running on another stream, the pending list, barrier on NCCL.

The GPU tests make the producer's stream differ from CuPy's current stream, which is
where temporaries used to land: a Buffer made through DLPack with a consumer stream
(as JAX arrays are) or a torch tensor under ``torch.cuda.stream(s)``."""
import warnings

import numpy as np
import pytest

from mcrdl_core.memory import cuda as mc_cuda
from test_cuda_gpu_check import _gpu_check  # bench/gpu_check.py: its slow producer kernel

GPU_REASON = mc_cuda.device_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
needs_cupy = pytest.mark.skipif(mc_cuda.cupy_reason() is not None, reason="cupy is not installed")


# --- item 18: one wrapper per (handle, device), no deprecated constructor -----------------------
@needs_cupy
def test_stream_wrappers_are_cached_and_not_deprecated(monkeypatch):
    import cupy as cp

    monkeypatch.setattr(mc_cuda, "_WRAPPERS", {}, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CuPy 14 warns on every ExternalStream(...)
        a = mc_cuda.stream(0x1234, 0)
        assert a.ptr == 0x1234
        for _ in range(3):
            assert mc_cuda.stream(0x1234, 0) is a
        assert mc_cuda.stream(0x1234, 1) is not a
        assert mc_cuda.stream(0, 0) is cp.cuda.Stream.null


@needs_cupy
def test_stream_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(mc_cuda, "_WRAPPERS", {}, raising=False)
    monkeypatch.setattr(mc_cuda, "_WRAPPERS_MAX", 4, raising=False)
    for h in range(1, 10):
        mc_cuda.stream(h, 0)
    assert len(mc_cuda._WRAPPERS) <= 4


# --- on a GPU ---------------------------------------------------------------------------------------
N = 1 << 16


def _slow_fill(cp, x, value, stream):
    """Fill ``x`` with ``value`` on ``stream`` after a ~0.1-0.2 s spin."""
    kernel = cp.RawKernel(_gpu_check().SLOW_FILL, "slow_fill")
    with stream:
        kernel(((x.size + 255) // 256,), (256,),
               (x, np.int32(x.size), np.float32(value), np.int64(200_000_000)))
    assert not stream.done, "the producer finished before the call: raise the cycle count"


def _nccl(core):
    reason = core.get_runtime().unavailable_reason("nccl")
    if reason is not None:
        pytest.skip(reason)


def _side(x, s):
    """``x`` as a Buffer whose producer writes on ``s`` (not CuPy's current stream)."""
    from mcrdl_core.memory.buffer import Buffer

    b = Buffer.from_dlpack(x, stream=s.ptr)
    assert b.stream == s.ptr
    return b


def _slow_producer_case(backend, value, shape, call):
    """A producer kernel on a side stream fills an array of ``shape`` with ``value``
    and is still running when ``call(core, x, out, s)`` issues the collective; the
    result, read on the side stream, is returned (host copy)."""
    import cupy as cp

    import mcrdl_core as core

    if backend == "nccl":
        _nccl(core)
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(shape, dtype=cp.float32)
    out = cp.zeros(N, dtype=cp.float32)
    _slow_fill(cp, x, value, s)
    call(core, x, out, s)
    with s:
        return cp.asnumpy(out * 1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_list_reduce_scatter_reads_its_input_after_the_producer(backend):
    got = _slow_producer_case(backend, 7.0, N, lambda core, x, out, s: core.reduce_scatter(
        out, [_side(x, s)], backend=backend))
    assert got.min() == 7.0 == got.max()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_list_all_to_all_reads_after_the_producer_and_writes_before_the_reader(backend):
    got = _slow_producer_case(backend, 5.0, N, lambda core, x, out, s: core.all_to_all(
        [_side(out, s)], [_side(x, s)], backend=backend))
    assert got.min() == 5.0 == got.max()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
def test_non_contiguous_input_is_copied_after_the_producer(backend):
    def call(core, x, out, s):
        strided = _side(x[:, 0], s)
        assert not strided.is_contiguous
        core.all_gather_into_tensor(out, strided, backend=backend)

    got = _slow_producer_case(backend, 3.0, (N, 2), call)
    assert got.min() == 3.0 == got.max()


@pytest.mark.gpu
@needs_gpu
def test_torch_list_collectives_under_torch_cuda_stream():
    import mcrdl_core as core

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch is a CPU build here")
    _nccl(core)
    import mcrdl_torch as mt

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(N, device="cuda")
        torch.cuda._sleep(200_000_000)
        x.fill_(4)
        out = torch.zeros(N, device="cuda")
        mt.reduce_scatter(out, [x], backend="nccl")
        outs = [torch.zeros(N, device="cuda")]
        mt.all_to_all(outs, [x], backend="nccl")
        strided = torch.zeros(N, 2, device="cuda")
        torch.cuda._sleep(200_000_000)
        strided.fill_(6)
        gathered = torch.zeros(N, device="cuda")
        mt.all_gather_into_tensor(gathered, strided[:, 1], backend="nccl")
        got = [(out * 2).cpu(), (outs[0] * 2).cpu(), gathered.cpu()]
    assert all(bool((g == v).all()) for g, v in zip(got, (8, 8, 6)))


@pytest.mark.gpu
@needs_gpu
def test_waited_nccl_work_stays_pending_until_the_gpu_is_done():
    import cupy as cp

    import mcrdl_core as core
    from mcrdl_core.engine.progress import engine

    _nccl(core)
    s = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    _slow_fill(cp, x, 1.0, s)
    core.all_reduce(_side(x, s), backend="nccl")
    assert [w.op.value for w in engine().pending] == ["all_reduce"]
    cp.cuda.runtime.deviceSynchronize()
    engine().reap()
    assert engine().pending == []


@pytest.mark.gpu
@needs_gpu
def test_barrier_on_nccl_and_no_deprecation_warnings():
    import cupy as cp

    import mcrdl_core as core

    _nccl(core)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        core.barrier(backend="nccl")
        x = cp.ones(8, dtype=cp.float32)
        core.all_reduce(x, backend="nccl")
    assert float(x.sum()) == 8.0
