"""Single-process tests of the GPU path: what runs without a GPU (the NCCL module imports
and says why it cannot run; capability answers; CUDA-aware MPI detection; CUDA-event
and chained Work through the progress engine; selection falls through to mpi/gloo for
CUDA buffers), and, marked ``gpu``, every op on a real GPU at world size 1."""
import subprocess
import sys

import numpy as np
import pytest

from mcrdl_core.memory import cuda as mc_cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.memory.buffer import Buffer, Device
from mcrdl_core.base.errors import BackendUnavailableError, CommTimeoutError, UnsupportedError
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.engine.progress import ProgressEngine
from mcrdl_core.engine.work import ChainWork, CompletedWork, EventWork

GPU_REASON = mc_cuda.device_reason()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_nccl_module_imports_lazily_and_reports_why():
    out = _run("import sys\nimport mcrdl_backends.nccl as n\n"
               "assert 'cupy' not in sys.modules, 'import pulled in cupy'\n"
               "from mcrdl_core.world.bootstrap import Bootstrap\n"
               "print('REASON', n.NCCLBackend.unavailable_reason(Bootstrap()))")
    assert out.returncode == 0, out.stderr
    reason = out.stdout.split("REASON ", 1)[1].strip()
    if GPU_REASON is not None:
        assert reason == GPU_REASON, reason  # no GPU here: that is the reason given
        assert "CUDA device" in reason or "cupy" in reason
    else:
        assert reason == "None" or "NCCL" in reason or "GPU per rank" in reason


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present")
def test_mcrdl_info_says_nccl_unavailable_and_mpi_cuda_awareness():
    out = subprocess.run([sys.executable, "-m", "mcrdl_core.tools.cli", "info"], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ,
                                                      "MCRDL_TUNING_TABLE": "none"})
    assert out.returncode == 0, out.stderr
    assert f"nccl  unavailable: {GPU_REASON}" in out.stdout, out.stdout
    assert "CUDA-aware: no (MPIX_Query_cuda_support() = 0)" in out.stdout, out.stdout


def _reason_with_module_blocked(module: str, expr: str) -> str:
    """``expr`` printed by a fresh interpreter in which ``module`` cannot be imported."""
    out = _run(f"import sys\nsys.modules[{module!r}] = None\n"
               "import mcrdl_backends.nccl as n\nfrom mcrdl_core.world.bootstrap import Bootstrap\n"
               f"print({expr})")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_reason_when_cupy_is_missing():
    why = _reason_with_module_blocked("cupy", "n.NCCLBackend.unavailable_reason(Bootstrap())")
    assert "cupy is not installed (pip install 'mcr-dl[gpu]')" in why


@pytest.mark.skipif(mc_cuda.cupy_reason() is not None, reason="cupy is not installed")
def test_reason_when_the_nccl_library_is_missing():
    why = _reason_with_module_blocked("cupy_backends.cuda.libs.nccl", "n.nccl_library()")
    assert "(None, " in why and "the NCCL library cannot be loaded by CuPy" in why
    # the wheel of CuPy's CUDA major version (cupy-cuda13x names nvidia-nccl-cu13)
    major = mc_cuda.cupy().cuda.runtime.runtimeGetVersion() // 1000
    assert f"nvidia-nccl-cu{major}" in why, why
    assert ("'mcr-dl[gpu]'" if major == 12 else f"'mcr-dl[gpu-cuda{major}]'") in why, why


def test_nccl_capabilities_without_a_gpu():
    from mcrdl_backends.nccl import NCCLBackend

    be = NCCLBackend(None)
    cuda = Device("cuda", 0)
    assert "CUDA buffers only" in be.unsupported_reason(Op.ALL_REDUCE, Device("cpu"), dt.float32,
                                                        ReduceOp.SUM)
    for dtype in (dt.int8, dt.uint8, dt.int32, dt.int64, dt.float16, dt.bfloat16, dt.float32,
                  dt.float64):
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
            assert be.unsupported_reason(Op.ALL_REDUCE, cuda, dtype, op) is None
    assert be.unsupported_reason(Op.REDUCE_SCATTER, cuda, dt.bfloat16, ReduceOp.AVG) is None
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        assert "no bitwise" in be.unsupported_reason(Op.ALL_REDUCE, cuda, dt.int32, op)
    assert "cannot reduce int16" in be.unsupported_reason(Op.REDUCE, cuda, dt.int16, ReduceOp.SUM)
    assert be.unsupported_reason(Op.ALL_GATHER, cuda, dt.int16) is None  # moved as bytes


def test_unique_id_bytes_from_either_cupy_api():
    from mcrdl_backends.nccl import id_bytes

    raw = bytes(range(256))[:128]
    assert id_bytes(raw) == raw
    signed = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy < 14: signed chars
    assert id_bytes(signed) == raw


def test_single_rank_handshake_returns_the_made_id():
    from mcrdl_backends.nccl import share_unique_id
    from mcrdl_core.world.bootstrap import Bootstrap

    made = b"\x01" * 128
    assert share_unique_id(Bootstrap(), [0], lambda: made) is made


def test_mpi_cuda_awareness_detection(monkeypatch):
    from mcrdl_backends import mpi

    monkeypatch.setattr(mpi, "_CUDA_SUPPORT", [])
    monkeypatch.delenv("MCRDL_MPI_CUDA_AWARE", raising=False)
    aware, how = mpi.cuda_support()
    assert "MPIX_Query_cuda_support" in how
    assert aware is (how.endswith("= 1"))
    monkeypatch.setattr(mpi, "_CUDA_SUPPORT", [])
    monkeypatch.setenv("MCRDL_MPI_CUDA_AWARE", "1")
    assert mpi.cuda_support() == (True, "set by MCRDL_MPI_CUDA_AWARE")
    monkeypatch.setattr(mpi, "_CUDA_SUPPORT", [])


class FakeEvent:
    """A CUDA event stand-in: done after ``polls`` queries."""

    def __init__(self, polls):
        self.left = polls

    @property
    def done(self):
        self.left -= 1
        return self.left < 0


def test_event_work_is_queried_by_the_progress_loop():
    eng = ProgressEngine()
    ev = FakeEvent(50)
    w = EventWork("nccl", Op.ALL_REDUCE, ev, keep=("buffer",))
    eng.wait([w], timeout=10)
    assert w.is_completed() and ev.left < 0 and w.keep == ()


def test_event_work_surfaces_async_errors_naming_the_op():
    def check():
        raise RuntimeError("nccl: all_reduce on group 'world' failed asynchronously: boom")

    w = EventWork("nccl", Op.ALL_REDUCE, FakeEvent(10 ** 9), check=check)
    with pytest.raises(RuntimeError, match="all_reduce .*failed asynchronously"):
        w.wait(5)


def test_event_work_times_out_with_a_diagnostic():
    w = EventWork("nccl", Op.BROADCAST, FakeEvent(10 ** 9))
    with pytest.raises(CommTimeoutError, match="broadcast .*via backend 'nccl'"):
        ProgressEngine().wait([w], timeout=0.05)


def test_chain_work_runs_stages_in_order_and_keeps_the_first_result():
    log = []
    first = EventWork("mpi", Op.RECV, FakeEvent(3))
    first.value = 1
    first.add_finalizer(lambda: log.append("recv done"))

    def then():
        log.append("copy back issued")
        return EventWork("mpi", Op.RECV, FakeEvent(3), desc="copy back")

    chain = ChainWork(first, then)
    chain.add_finalizer(lambda: log.append("chain done"))
    ProgressEngine().wait([chain], timeout=10)
    assert log == ["recv done", "copy back issued", "chain done"]
    assert chain.result() == 1
    assert ChainWork(CompletedWork("mpi", Op.SEND), lambda: None).test()


def test_cuda_buffers_fall_through_to_host_backends_when_nccl_is_unavailable():
    import mcrdl_core as core

    rt = core.init()
    fake = Buffer(0, (8,), dt.float32, Device("cuda", 0))  # metadata only: never touched
    if rt.unavailable_reason("nccl") is None:
        pytest.skip("nccl can run here")
    if mc_cuda.cupy_reason() is None:
        assert rt.select(Op.ALL_REDUCE, rt.world, fake, None, ReduceOp.SUM).name == "mpi"
        assert rt.select(Op.ALL_REDUCE, rt.world, fake, None, ReduceOp.BAND).name == "mpi"
    else:
        with pytest.raises(UnsupportedError, match="CuPy"):
            rt.select(Op.ALL_REDUCE, rt.world, fake, None, ReduceOp.SUM)
    with pytest.raises(BackendUnavailableError, match="backend 'nccl' is not available"):
        rt.select(Op.ALL_REDUCE, rt.world, fake, "nccl", ReduceOp.SUM)


def test_dlpack_consumer_stream_only_for_cuda_producers():
    from mcrdl_core.memory.dlpack import consumer_stream

    assert consumer_stream(np.ones(3)) is None
    b = Buffer.from_dlpack(np.ones(3))
    assert b.stream is None and b.flat(1).stream is None


# --- on a GPU (skipped here) ----------------------------------------------------------------
def _ops(xp, core, backend, n=1000):
    """Every op at world size 1 on CuPy arrays: {name: (got, expected)}."""
    x = xp.arange(n, dtype=xp.float32)
    res = {}
    y = x.copy()
    core.all_reduce(y, "sum", backend=backend)
    res["all_reduce"] = (y, x)
    y = x.copy()
    core.all_reduce(y, "avg", backend=backend)
    res["all_reduce avg"] = (y, x)
    y = x.copy()
    core.broadcast(y, 0, backend=backend)
    res["broadcast"] = (y, x)
    y = x.copy()
    core.reduce(y, 0, "max", backend=backend)
    res["reduce"] = (y, x)
    out = xp.empty_like(x)
    core.all_gather_into_tensor(out, x, backend=backend)
    res["all_gather"] = (out, x)
    out = xp.empty_like(x)
    core.reduce_scatter_tensor(out, x, backend=backend)
    res["reduce_scatter"] = (out, x)
    out = xp.empty_like(x)
    core.all_to_all_single(out, x, backend=backend)
    res["all_to_all"] = (out, x)
    outs = [xp.empty_like(x)]
    core.gather(x, outs, 0, backend=backend)
    res["gather"] = (outs[0], x)
    out = xp.empty_like(x)
    core.scatter(out, [x], 0, backend=backend)
    res["scatter"] = (out, x)
    core.barrier(backend=backend)
    return res


@pytest.mark.parametrize("backend", ["nccl", "mpi", "gloo"])
@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
def test_every_op_on_cupy_arrays_world_size_one(backend):
    import cupy as cp

    import mcrdl_core as core

    reason = core.get_runtime().unavailable_reason(backend)
    if reason is not None:
        pytest.skip(reason)
    dev = Device("cuda", 0)
    why = core.get_runtime().backend(backend).unsupported_reason(Op.ALL_REDUCE, dev, dt.float32)
    if why:
        pytest.skip(why)
    for name, (got, want) in _ops(cp, core, backend).items():
        cp.testing.assert_allclose(got, want, err_msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
def test_stream_order_with_a_slow_producer_kernel():
    """The collective is issued while the kernel writing its input still runs."""
    import cupy as cp

    import mcrdl_core as core

    if core.get_runtime().unavailable_reason("nccl") is not None:
        pytest.skip(core.get_runtime().unavailable_reason("nccl"))
    slow_fill = cp.RawKernel(r'''
    extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) {}
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] = v;
    }''', "slow_fill")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.zeros(1 << 16, dtype=cp.float32)
        out = cp.zeros_like(x)
        slow_fill(((x.size + 255) // 256,), (256,), (x, np.int32(x.size), np.float32(7),
                                                    np.int64(200_000_000)))
        assert not s.done  # the producer is still running when the call is issued
        core.all_gather_into_tensor(out, x, backend="nccl")
        doubled = out * 2  # the caller's later work on its stream sees the result
        # read on s too: a non-blocking stream does not order against the null stream
        got = doubled.get(stream=s)
    assert float(got.min()) == 14.0
