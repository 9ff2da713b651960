"""Every GPU path a single-GPU machine can run, with a pass/fail table.

    .venv/bin/python bench/gpu_check.py        # part 1 here, part 2 under mpiexec -n 2

Part 1 (this process, world size 1): every op on NCCL, MPI and Gloo with CUDA buffers
(CuPy arrays; torch CUDA tensors when torch is a CUDA build), ``mcrdl_jax``'s calls on
GPU JAX arrays (every op eagerly, all_reduce and all_gather under jit), and the stream-ordering
test: a producer kernel is still running on a side stream when the collective is
issued, and the result read after it on that stream must be the kernel's output.
Part 2 (``mpiexec -n 2``, both ranks on the one GPU): MPI and Gloo with CUDA buffers
from CuPy, torch and JAX (inputs from every framework; JAX arrays are immutable, so
they are inputs only), ``mcrdl_jax`` on GPU arrays, the stream-ordering test across ranks, and NCCL's verdict (two
ranks on one GPU: the first NCCL call is refused on both ranks, naming them, before
anything is sent). Part 2 runs with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX would
otherwise take 75% of the GPU in each of the two processes), and every skip is
decided by both ranks together, so that one rank never runs a collective alone.

Without a GPU it prints why and exits 0. Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np

N = 4096  # elements per rank


class Skip(Exception):
    pass


# --- frameworks -------------------------------------------------------------------------
def _cupy():
    import cupy as cp

    return cp


class CuPy:
    name = "cupy"
    mutable = True

    def __init__(self):
        self.cp = _cupy()

    def make(self, a):
        return self.cp.asarray(a)

    def empty(self, n):
        return self.cp.zeros(n, dtype=self.cp.float32)

    def host(self, x):
        return self.cp.asnumpy(x)


class Torch:
    name = "torch"
    mutable = True

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise Skip("torch is a CPU build here (install a CUDA build of torch)")
        self.torch = torch

    def make(self, a):
        return self.torch.from_numpy(a).cuda()

    def empty(self, n):
        return self.torch.zeros(n, dtype=self.torch.float32, device="cuda")

    def host(self, x):
        return x.cpu().numpy()


class Jax:
    name = "jax"
    mutable = False  # immutable arrays: inputs only; outputs are CuPy arrays

    def __init__(self):
        import jax

        try:
            self.dev = jax.devices("gpu")[0]
        except RuntimeError as exc:
            raise Skip(f"JAX has no GPU backend here ({exc}); install jax[cuda12]") from None
        self.jax = jax
        self.out = CuPy()

    def make(self, a):
        return self.jax.device_put(a, self.dev)

    def empty(self, n):
        return self.out.empty(n)

    def host(self, x):
        return np.asarray(x) if hasattr(x, "addressable_data") else self.out.host(x)


FRAMEWORKS = {"cupy": CuPy, "torch": Torch, "jax": Jax}


# --- checks -----------------------------------------------------------------------------
def rank_input(r):
    return (np.arange(N, dtype=np.float32) % 97) + r + 1


def op_checks(core, fw, backend, rank, size):
    """{name: zero-argument check} for every op, on ``fw`` buffers via ``backend``."""
    every = [rank_input(r) for r in range(size)]
    mine = every[rank]
    total = np.sum(every, axis=0)
    out_fw = fw if fw.mutable else fw.out
    kw = {"backend": backend}

    def eq(x, want):
        np.testing.assert_allclose(out_fw.host(x), want, rtol=1e-5)

    def all_reduce():
        x = fw.make(mine)
        core.all_reduce(x, "sum", **kw)
        eq(x, total)

    def all_reduce_avg():
        x = fw.make(mine)
        core.all_reduce(x, "avg", **kw)
        eq(x, total / size)

    def broadcast():
        x = fw.make(mine)
        core.broadcast(x, 0, **kw)
        eq(x, every[0])

    def reduce():
        x = fw.make(mine)
        core.reduce(x, 0, "max", **kw)
        if rank == 0:
            eq(x, np.max(every, axis=0))

    def all_gather():
        out = out_fw.empty(N * size)
        core.all_gather_into_tensor(out, fw.make(mine), **kw)
        eq(out, np.concatenate(every))

    def reduce_scatter():
        out = out_fw.empty(N // size)
        core.reduce_scatter_tensor(out, fw.make(mine[:N // size * size]), "sum", **kw)
        blk = N // size
        eq(out, total[rank * blk:(rank + 1) * blk])

    def all_to_all():
        blk = N // size
        out = out_fw.empty(blk * size)
        core.all_to_all_single(out, fw.make(mine[:blk * size]), **kw)
        eq(out, np.concatenate([every[p][rank * blk:(rank + 1) * blk] for p in range(size)]))

    def gather():
        outs = [out_fw.empty(N) for _ in range(size)] if rank == 0 else None
        core.gather(fw.make(mine), outs, 0, **kw)
        if rank == 0:
            for p in range(size):
                eq(outs[p], every[p])

    def scatter():
        out = out_fw.empty(N)
        ins = [fw.make(every[p] * 2) for p in range(size)] if rank == 0 else None
        core.scatter(out, ins, 0, **kw)
        eq(out, every[rank] * 2)

    def send_recv():
        if size == 1:
            raise Skip("needs 2 ranks")
        got = out_fw.empty(N)
        w = core.send(fw.make(mine), (rank + 1) % size, async_op=True, **kw)
        core.recv(got, (rank - 1) % size, **kw)
        w.wait()
        eq(got, every[(rank - 1) % size])

    def barrier():
        core.barrier(**kw)

    checks = {"all_gather": all_gather, "reduce_scatter": reduce_scatter,
              "all_to_all": all_to_all, "gather": gather, "send_recv": send_recv}
    if fw.mutable:
        checks.update(all_reduce=all_reduce, all_reduce_avg=all_reduce_avg,
                      broadcast=broadcast, reduce=reduce, scatter=scatter, barrier=barrier)
    return checks


SLOW_FILL = r'''
extern "C" __global__ void slow_fill(float* x, int n, float v, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}'''


def stream_order_check(core, backend, rank, size):
    """A kernel on a side stream is still filling the input when the collective is
    issued; the output, read on that stream afterwards, must hold the kernel's values."""
    def run():
        cp = _cupy()
        kernel = cp.RawKernel(SLOW_FILL, "slow_fill")
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            x = cp.zeros(N, dtype=cp.float32)
            out = cp.zeros(N * size, dtype=cp.float32)
            kernel(((N + 255) // 256,), (256,),
                   (x, np.int32(N), np.float32(rank + 7), np.int64(300_000_000)))
            still_running = not s.done
            core.all_gather_into_tensor(out, x, backend=backend)
            doubled = out * 2
            got = cp.asnumpy(doubled)
        want = np.repeat(np.arange(size, dtype=np.float32) + 7, N) * 2
        np.testing.assert_array_equal(got, want)
        if not still_running:
            raise AssertionError("the producer kernel had already finished at issue time; "
                                 "the check did not test ordering (raise the cycle count)")
    return run


def torch_stream_order_check(rank, size, backend):
    def run():
        import torch

        import mcrdl_torch as mt

        if not torch.cuda.is_available():
            raise Skip("torch is a CPU build here")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.zeros(N, device="cuda")
            torch.cuda._sleep(300_000_000)  # the producer is still busy at issue time
            x.fill_(rank + 7)
            out = torch.zeros(N * size, device="cuda")
            mt.all_gather_into_tensor(out, x, backend=backend)
            got = (out * 2).cpu().numpy()
        np.testing.assert_array_equal(got, np.repeat(np.arange(size, dtype=np.float32) + 7, N) * 2)
    return run


def jax_reason() -> str | None:
    """Why mcrdl_jax cannot be checked on a GPU here, or None."""
    try:
        import jax

        jax.devices("gpu")
        import mcrdl_jax  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the reason goes in the table
        return f"mcrdl_jax on a GPU: {type(exc).__name__}: {exc}"[:300]
    return None


def jax_frontend_checks(backend, rank, size):
    """{name: check} for ``mcrdl_jax``'s own calls on GPU JAX arrays: every op eagerly
    (results stay on the GPU), bfloat16, and all_reduce and all_gather under jax.jit."""
    import jax
    import jax.numpy as jnp

    import mcrdl_jax as mj

    dev = jax.devices("gpu")[0]
    every = [rank_input(r) for r in range(size)]
    mine = every[rank]
    total = np.sum(every, axis=0)
    blk = N // size

    def put(a):
        return jax.device_put(a, dev)

    def eq(y, want):
        where = {d.platform for d in y.devices()}
        assert where == {"gpu"}, f"the result is on {where}, not the GPU"
        np.testing.assert_allclose(np.asarray(y).astype(np.float64), want, rtol=1e-5)

    def all_reduce():
        eq(mj.all_reduce(put(mine), backend=backend), total)

    def all_reduce_bf16():
        x = put(mine[:64].astype(jnp.bfloat16))
        y = mj.all_reduce(x, backend=backend)
        assert y.dtype == jnp.bfloat16, y.dtype
        want = np.sum([e[:64].astype(jnp.bfloat16).astype(np.float64) for e in every], axis=0)
        np.testing.assert_allclose(np.asarray(y).astype(np.float64), want, rtol=2e-2)

    def broadcast():
        eq(mj.broadcast(put(mine), 0, backend=backend), every[0])

    def all_gather():
        eq(mj.all_gather(put(mine), backend=backend), np.stack(every))

    def reduce_scatter():
        eq(mj.reduce_scatter(put(mine[:blk * size]), backend=backend),
           total[rank * blk:(rank + 1) * blk])

    def all_to_all():
        eq(mj.all_to_all(put(mine[:blk * size]), backend=backend),
           np.concatenate([every[p][rank * blk:(rank + 1) * blk] for p in range(size)]))

    def gather():
        y = mj.gather(put(mine), 0, backend=backend)
        eq(y, np.stack(every) if rank == 0 else mine)

    def scatter():
        eq(mj.scatter(put(np.stack([e * 2 for e in every])), 0, backend=backend),
           every[rank] * 2)

    def sendrecv():
        if size == 1:
            raise Skip("needs 2 ranks")
        y = mj.sendrecv(put(mine), put(np.zeros(N, np.float32)), (rank - 1) % size,
                        (rank + 1) % size, backend=backend)
        eq(y, every[(rank - 1) % size])

    def jitted(fn, want):
        def run():
            if backend == "nccl":
                raise Skip("under jit, calls run as mpi4jax primitives (mpi) or host "
                           "callbacks with host arrays, which NCCL cannot take")
            eq(jax.jit(fn)(put(mine)), want)
        return run

    checks = {"eager all_reduce": all_reduce, "eager all_reduce bfloat16": all_reduce_bf16,
              "eager broadcast": broadcast, "eager all_gather": all_gather,
              "eager reduce_scatter": reduce_scatter, "eager all_to_all": all_to_all,
              "eager gather": gather, "eager scatter": scatter, "eager sendrecv": sendrecv,
              "jit all_reduce": jitted(lambda a: mj.all_reduce(a, backend=backend), total),
              "jit all_gather": jitted(lambda a: mj.all_gather(a, backend=backend),
                                       np.stack(every))}
    return checks


def jax_stream_order_check(core, backend, rank, size):
    """The input is the output of a jitted JAX program still running on the GPU when the
    collective is issued (JAX dispatches asynchronously); the gathered result must hold
    the program's values: DLPack makes the issuing stream wait for JAX's."""
    def run():
        why = agree(core.get_runtime().bootstrap, jax_reason())
        if why is not None:
            raise Skip(why)
        import jax
        import jax.numpy as jnp

        cp = _cupy()
        dev = jax.devices("gpu")[0]

        @jax.jit
        def slow(a, v):
            m = jax.lax.fori_loop(0, 60, lambda i, m: jnp.tanh(m @ m), a)
            return m[0, :N] * 1e-30 + v  # exactly v in float32, after all the work

        a = jax.device_put(jnp.full((4096, 4096), 1e-4, jnp.float32), dev)
        slow(a, jnp.float32(0)).block_until_ready()  # compiled and warm
        x = slow(a, jnp.float32(rank + 7))
        still_running = not x.is_ready() if hasattr(x, "is_ready") else None
        out = cp.zeros(N * size, dtype=cp.float32)
        core.all_gather_into_tensor(out, x, backend=backend)
        got = cp.asnumpy(out * 2)
        np.testing.assert_array_equal(
            got, np.repeat(np.arange(size, dtype=np.float32) + 7, N) * 2)
        if still_running is False:
            raise AssertionError("the JAX program had already finished at issue time; the "
                                 "check did not test ordering (make the program longer)")
    return run


def run_check(results, part, backend, fw_name, name, fn):
    try:
        fn()
        status, detail = "PASS", ""
    except Skip as exc:
        status, detail = "SKIP", str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure goes in the table
        status = "FAIL"
        detail = f"{type(exc).__name__}: {exc}"[:300]
        if os.environ.get("MCRDL_GPU_CHECK_TRACE"):
            traceback.print_exc()
    results.append({"part": part, "backend": backend, "framework": fw_name, "check": name,
                    "status": status, "detail": detail})


def _skipped(reason):
    def run():
        raise Skip(reason)
    return run


def agree(bootstrap, reason: str | None) -> str | None:
    """A skip decided by every rank together (collective): None only if no rank has a
    reason, else the first rank's reason, naming it. Every rank gets the same answer."""
    every = bootstrap.allgather(reason)
    for r, why in enumerate(every):
        if why is not None:
            return why if len(every) == 1 else f"rank {r}: {why}"
    return None


def _framework(fw_name):
    """(framework object, None) or (None, why it is skipped on this rank)."""
    try:
        return FRAMEWORKS[fw_name](), None
    except Skip as exc:
        return None, str(exc)


def run_part(core, part, backends, frameworks, rank, size, stream_checks=True,
             jax_frontend=False):
    results = []
    rt = core.get_runtime()
    bs = rt.bootstrap
    for backend in backends:
        reason = agree(bs, rt.unavailable_reason(backend))
        for fw_name in frameworks:
            if reason is not None:
                run_check(results, part, backend, fw_name, "every op", _skipped(reason))
                continue
            fw, why = _framework(fw_name)
            why = agree(bs, why)
            if why is not None:
                run_check(results, part, backend, fw_name, "every op", _skipped(why))
                continue
            for name, fn in op_checks(core, fw, backend, rank, size).items():
                run_check(results, part, backend, fw_name, name, fn)
        if reason is None and jax_frontend:
            why = agree(bs, jax_reason())
            if why is not None:
                run_check(results, part, backend, "mcrdl_jax", "every op", _skipped(why))
            else:
                for name, fn in jax_frontend_checks(backend, rank, size).items():
                    run_check(results, part, backend, "mcrdl_jax", name, fn)
        if reason is None and stream_checks:
            run_check(results, part, backend, "cupy", "stream order (slow producer)",
                      stream_order_check(core, backend, rank, size))
            run_check(results, part, backend, "torch", "stream order (torch.cuda._sleep)",
                      torch_stream_order_check(rank, size, backend))
            run_check(results, part, backend, "jax", "stream order (jitted JAX producer)",
                      jax_stream_order_check(core, backend, rank, size))
    return results


def nccl_verdict_check(core):
    """Two ranks on one GPU: NCCL stays available (how many GPUs a rank sees decides
    nothing), and the first NCCL call is refused on both ranks, naming them, from the
    PCI bus ids gathered at communicator creation, before anything is sent."""
    def run():
        rt = core.get_runtime()
        reason = agree(rt.bootstrap, rt.unavailable_reason("nccl"))
        if reason is not None:
            raise Skip(reason)
        cp = _cupy()
        x = cp.ones(8, dtype=cp.float32)
        try:
            core.all_reduce(x, "sum", backend="nccl")
        except core.UnsupportedError as exc:
            assert "both use GPU" in str(exc) and "ranks 0 and 1" in str(exc), exc
        else:
            raise Skip("the two ranks use different GPUs here: NCCL ran")
        assert float(cp.asnumpy(x).sum()) == 8.0, "the refused call changed its buffer"
    return run


def part_two_env(env) -> dict:
    """The environment of part 2: two processes share one GPU, so JAX must not
    preallocate (75% of the GPU per process by default)."""
    return {**env, "MCRDL_TUNING_TABLE": "none", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


# --- driver -----------------------------------------------------------------------------
def part_two(out_path):
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # also when launched by hand
    import mcrdl_core as core
    from mcrdl_core.memory import cuda

    rt = core.init()
    cuda.cupy().cuda.Device(rt.bootstrap.local_rank % cuda.device_count()).use()
    results = run_part(core, "2 ranks, 1 GPU", ["mpi", "gloo"], ["cupy", "torch", "jax"],
                       rt.rank, rt.world_size, jax_frontend=True)
    run_check(results, "2 ranks, 1 GPU", "nccl", "-", "shared GPU refused on both ranks",
              nccl_verdict_check(core))
    every = rt.bootstrap.allgather(results)
    if rt.rank == 0:
        merged = []
        for i, row in enumerate(every[0]):
            bad = [r for r in every if r[i]["status"] == "FAIL"]
            merged.append(bad[0][i] if bad else row)
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(merged, f)
    core.destroy()


def print_table(results):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in results:
            print(f"{r['part']:16s} {r['backend']:5s} {r['framework']:6s} {r['check']:34s} "
                  f"{r['status']} {r['detail']}")
        return
    table = Table(title="MCR-DL GPU check")
    for col in ("part", "backend", "framework", "check", "status", "detail"):
        table.add_column(col, overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for r in results:
        table.add_row(r["part"], r["backend"], r["framework"], r["check"],
                      f"[{colour[r['status']]}]{r['status']}[/]", r["detail"])
    Console(width=160).print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part-two", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--no-mpiexec", action="store_true", help="run part 1 only")
    args = ap.parse_args(argv)
    if args.part_two:
        part_two(args.part_two)
        return 0

    from mcrdl_core.memory import cuda

    reason = cuda.device_reason()
    if reason is not None:
        print(f"gpu_check: no GPU present ({reason}); nothing to check.")
        return 0
    os.environ.setdefault("MCRDL_TIMEOUT", "120")
    # JAX would take 75% of the GPU at its first array, leaving torch and CuPy little
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import mcrdl_core as core

    core.init()
    results = run_part(core, "1 rank", ["nccl", "mpi", "gloo"], ["cupy", "torch"], 0, 1,
                       jax_frontend=True)
    if not args.no_mpiexec:
        bindir = os.path.dirname(sys.executable)
        mpiexec = os.path.join(bindir, "mpiexec")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "part2.json")
            env = part_two_env(os.environ)
            try:
                proc = subprocess.run([mpiexec, "-n", "2", sys.executable, __file__,
                                       "--part-two", out], env=env, capture_output=True,
                                      text=True, timeout=900)
                if os.path.exists(out):
                    with open(out, encoding="utf-8") as f:
                        results += json.load(f)
                else:
                    results.append({"part": "2 ranks, 1 GPU", "backend": "-", "framework": "-",
                                    "check": "mpiexec -n 2", "status": "FAIL",
                                    "detail": f"exit {proc.returncode}: "
                                              f"{(proc.stdout + proc.stderr)[-600:]}"})
            except subprocess.TimeoutExpired:
                results.append({"part": "2 ranks, 1 GPU", "backend": "-", "framework": "-",
                                "check": "mpiexec -n 2", "status": "FAIL",
                                "detail": "hung for 900 s"})
    print_table(results)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    core.destroy()
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
