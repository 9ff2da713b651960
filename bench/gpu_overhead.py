"""What MCR-DL adds per call on NCCL, against ``cupy.cuda.nccl`` called directly.

Run on a GPU machine (world size 1; NCCL refuses two ranks on one GPU):
    python bench/gpu_overhead.py [--calls N] [--rounds R] [--bytes B ...]

Paths, each a float32 SUM all-reduce of B bytes (default 8) issued ``--calls`` times
back to back:

- ``raw``: ``NcclCommunicator.allReduce`` on one stream, what the NCCL backend issues;
- ``core``: ``mcrdl_core.all_reduce(cupy_array, backend="nccl")``;
- ``torch``: ``mcrdl_torch.all_reduce(cuda_tensor, backend="nccl")`` (skipped when torch
  is a CPU build).

A blocking NCCL call returns once the op is enqueued (torch's NCCL semantics), so two
figures per path: ``host``, the time to issue the calls (what the Python side costs),
and ``wall``, the same calls followed by a synchronize of the device (what a program
that waits for the result sees). The paths are interleaved round by round (rotated
order) and the medians over rounds are reported with their ratio to ``raw``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MCRDL_TUNING_TABLE", "none")


def _paths(nbytes: int):
    import cupy as cp
    from cupy.cuda import nccl

    import mcrdl_core

    n = max(1, nbytes // 4)
    stream = cp.cuda.Stream(non_blocking=True)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x = cp.ones(n, dtype=cp.float32)

    def raw():
        comm.allReduce(x.data.ptr, x.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       stream.ptr)

    y = cp.ones(n, dtype=cp.float32)

    def core():
        mcrdl_core.all_reduce(y, "sum", backend="nccl")

    paths = {"raw": (raw, stream.synchronize), "core": (core, cp.cuda.Device().synchronize)}
    try:
        import torch

        if torch.cuda.is_available():
            import mcrdl_torch

            t = torch.ones(n, dtype=torch.float32, device="cuda")

            def via_torch():
                mcrdl_torch.all_reduce(t, backend="nccl")

            paths["torch"] = (via_torch, torch.cuda.synchronize)
    except ImportError:
        pass
    return paths, comm


def measure(paths, calls: int, rounds: int) -> dict:
    """{path: (median host µs/call, median wall µs/call)} over rotated rounds."""
    names = list(paths)
    host = {p: [] for p in names}
    wall = {p: [] for p in names}
    for fn, sync in paths.values():  # warm up: communicators, memo, caches
        for _ in range(50):
            fn()
        sync()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for p in order:
            fn, sync = paths[p]
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host[p].append((t1 - t0) / calls * 1e6)
            wall[p].append((t2 - t0) / calls * 1e6)
    return {p: (statistics.median(host[p]), statistics.median(wall[p])) for p in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bytes", type=int, nargs="+", default=[8])
    args = ap.parse_args(argv)

    from mcrdl_core.memory import cuda

    reason = cuda.device_reason()
    if reason is not None:
        print(f"gpu_overhead: no GPU ({reason}); nothing to measure")
        return 0
    import mcrdl_core

    mcrdl_core.init()
    try:
        import torch

        if torch.cuda.is_available():
            import mcrdl_torch

            mcrdl_torch.init_process_group()
    except ImportError:
        pass
    print(f"{'bytes':>8s} {'path':6s} {'host µs':>9s} {'x raw':>6s} {'wall µs':>9s} {'x raw':>6s}")
    for nbytes in args.bytes:
        paths, comm = _paths(nbytes)
        res = measure(paths, args.calls, args.rounds)
        h0, w0 = res["raw"]
        for p, (h, w) in res.items():
            print(f"{nbytes:8d} {p:6s} {h:9.2f} {h / h0:6.2f} {w:9.2f} {w / w0:6.2f}")
        comm.destroy()
    mcrdl_core.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
