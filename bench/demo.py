"""MCR-DL demo: every op's latency on MPI and on Gloo at a few sizes, and the backend
the runtime picks. Run by `make demo` as: mpiexec -n 2 .venv/bin/python bench/demo.py

Latency: median over calls of the slowest rank's time per call (µs). send/recv is
one-way latency, half a ping-pong round trip. "picks" is the runtime's choice for a
call with no backend argument (no tuning table yet: the documented policy).
"""
from __future__ import annotations

import argparse

import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.ops import Op
from timing import iters_for, median_us

SIZES = [8, 1024, 64 << 10, 1 << 20]
BACKENDS = ["mpi", "gloo"]


def make_call(op: str, nbytes: int, backend: str, n: int, rank: int):
    """A zero-argument function doing one `op` of `nbytes` per rank, and its core Op."""
    count = max(nbytes // 4, 1)
    x = torch.ones(count)
    big = torch.ones(count * n)
    kw = {"backend": backend}
    if op == "all_reduce":
        return Op.ALL_REDUCE, lambda: dist.all_reduce(x, **kw)
    if op == "broadcast":
        return Op.BROADCAST, lambda: dist.broadcast(x, 0, **kw)
    if op == "reduce":
        return Op.REDUCE, lambda: dist.reduce(x, 0, **kw)
    if op == "all_gather":
        return Op.ALL_GATHER, lambda: dist.all_gather_into_tensor(big, x, **kw)
    if op == "reduce_scatter":
        return Op.REDUCE_SCATTER, lambda: dist.reduce_scatter_tensor(x, big, **kw)
    if op == "all_to_all":
        out = torch.empty_like(big)
        return Op.ALL_TO_ALL, lambda: dist.all_to_all_single(out, big, **kw)
    if op == "gather":
        outs = [torch.empty(count) for _ in range(n)] if rank == 0 else None
        return Op.GATHER, lambda: dist.gather(x, outs, 0, **kw)
    if op == "scatter":
        ins = [torch.ones(count) for _ in range(n)] if rank == 0 else None
        return Op.SCATTER, lambda: dist.scatter(x, ins, 0, **kw)
    if op == "send/recv":
        peer = 1 - rank if rank < 2 else None

        def pingpong():
            if rank == 0:
                dist.send(x, peer, **kw)
                dist.recv(x, peer, **kw)
            elif rank == 1:
                dist.recv(x, peer, **kw)
                dist.send(x, peer, **kw)
        return Op.SEND, pingpong
    if op == "barrier":
        return Op.BARRIER, lambda: dist.barrier(**kw)
    raise ValueError(op)


def main():
    ap = argparse.ArgumentParser(description="MCR-DL demo: latency per op and backend")
    ap.add_argument("--sizes", type=int, nargs="*", default=SIZES, help="bytes per rank")
    args = ap.parse_args()
    dist.init_process_group()
    rt = mcrdl_core.get_runtime()
    rank, n = dist.get_rank(), dist.get_world_size()
    ops = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
           "gather", "scatter", "send/recv", "barrier"]
    rows = []
    for op in ops:
        for nbytes in ([0] if op == "barrier" else args.sizes):
            lat = {}
            for be in BACKENDS:
                core_op, fn = make_call(op, nbytes, be, n, rank)
                us = median_us(fn, iters_for(nbytes))
                lat[be] = us / 2 if op == "send/recv" else us
            probe = dist.tensors.to_buffer(torch.ones(max(nbytes // 4, 1)))
            picked = rt.select(core_op, rt.world, probe, None,
                               mcrdl_core.ReduceOp.SUM if core_op in (Op.ALL_REDUCE, Op.REDUCE,
                                                                      Op.REDUCE_SCATTER) else None).name
            rows.append((op, nbytes, lat, min(lat, key=lat.get), picked))
    if rank == 0:
        print_table(rows, n)
    dist.destroy_process_group()


def _size(b: int) -> str:
    return "-" if b == 0 else (f"{b >> 20} MiB" if b >= 1 << 20 else
                               f"{b >> 10} KiB" if b >= 1024 else f"{b} B")


def print_table(rows, n):
    title = f"MCR-DL demo: median latency per call (µs), {n} ranks, float32, CPU"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(title=title)
        for col in ("op", "size/rank", "mpi µs", "gloo µs", "fastest", "runtime picks"):
            table.add_column(col, justify="right" if "µs" in col else "left")
        for op, b, lat, best, picked in rows:
            mark = "" if picked == best else " (policy)"
            table.add_row(op, _size(b), f"{lat['mpi']:.1f}", f"{lat['gloo']:.1f}", best,
                          picked + mark)
        Console(width=110).print(table)
    else:
        print(title)
        for op, b, lat, best, picked in rows:
            print(f"{op:15s} {_size(b):>8s} mpi {lat['mpi']:9.1f} gloo {lat['gloo']:9.1f} "
                  f"fastest {best:5s} picks {picked}")
    agree = sum(best == picked for *_, best, picked in rows)
    print(f"The policy's pick was the fastest backend in {agree} of {len(rows)} cases. "
          "A tuning table (mcrdl tune, next) makes the pick per size from measurements.")


if __name__ == "__main__":
    main()
