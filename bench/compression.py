"""Compression-assisted all-gather, reduce-scatter and all-to-all against the backend's own
collective.

Run: mpiexec -n 2 .venv/bin/python bench/compression.py [--backend mpi] [--ops all_gather,reduce_scatter]
         [--min-bytes 64K] [--max-bytes 64M] [--codecs fp16,bf16,int8,int4,zfp:16]
         [--zfp-max-bytes 4M] [--rounds 5] [--label 1host] [--out bench/out]

Sizes are bytes of float32 data per rank (N(0,1) values, seeded by rank; all_to_all:
what each rank sends in all, in equal blocks per destination). Columns, per op and size
(all_to_all: the backend's own and a2a:CODEC only):

  BACKEND         the backend's own collective (compression=None): the baseline
  ring            the uncompressed ring of mcrdl_core.compress (same code, codec "none")
  p2p:CODEC       the seed paper's baseline: encode/decode at every hop
  ring:CODEC      collective-level compression (encode once / re-encode partial sums)
  a2a:CODEC       one backend all-gather (qwZ) or all-to-all (qgZ) of the encoded bytes
  auto:CODECS     compression allowed, the variant chosen by mcrdl_core.compress.auto
  BACKEND A/A     (--aa) the baseline again: its distance from 1.00 is the noise

Timing: bench/timing.py's interleaved_batches: each round runs one batch of every
column in a Williams order, an MPI barrier before each batch; a batch's figure is its
time per call on the slowest rank; a column's figure is the median over the rounds.
Error: relative L2 distance of the column's result from the backend's own (exact) one,
the worst rank's. torch is imported first when installed, as in a PyTorch program (the
codecs' host casts and scaling use torch's kernels when torch is loaded), with
cores / ranks-on-the-host intra-op threads unless OMP_NUM_THREADS says otherwise, as
torchrun sets for several processes per node. Rank 0 prints the table (time, speedup
over BACKEND, error) and writes
CSV, JSON and a PNG plot into --out, named compression_<label>_<ranks>r.

--fsdp STEPS instead trains a small MLP (3 Linear layers, each fully_shard-ed) with
FSDP2 through torch.distributed.init_process_group("mcrdl") for STEPS steps, once
uncompressed and once per codec of --fsdp-codecs with MCRDL_COMPRESSION set to it (so
FSDP2's all-gathers and reduce-scatters are compressed by the registered backend), from
the same initial weights and batches; it prints the final losses (mean of the last 10
steps), their relative difference and the times, into compression_fsdp_<label>_<ranks>r.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_framework import parse_bytes  # noqa: E402
from timing import interleaved_batches  # noqa: E402

try:  # loaded as in any PyTorch program: the fp16 codec's host casts then use it
    import torch  # noqa: F401,E402
except ImportError:
    torch = None
if torch is not None and "OMP_NUM_THREADS" not in os.environ:
    # as torchrun does for several processes per node: one intra-op thread each, not a
    # thread per core in every rank (8 busy threads on 2 cores for 4 ranks)
    _local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    if _local > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // _local))
import mcrdl_core as mc  # noqa: E402
from mcrdl_core.compress import Compression  # noqa: E402

COMM = MPI.COMM_WORLD

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="mpi", help="backend under every column (mpi, gloo)")
    ap.add_argument("--ops", default="all_gather,reduce_scatter")
    ap.add_argument("--min-bytes", type=parse_bytes, default=64 << 10)
    ap.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--codecs", default="fp16,bf16,int8,int4,zfp:16")
    ap.add_argument("--algorithms", default="p2p,ring,a2a")
    ap.add_argument("--extra", default="",
                    help="more columns ALGORITHM:CODEC, e.g. ring:bf16,ring:zfp:16")
    ap.add_argument("--aa", action="store_true",
                    help="also time the baseline a second time (column 'BACKEND A/A'): the noise")
    ap.add_argument("--auto", default="fp16+int8",
                    help="codecs allowed to the auto column ('' for no auto column)")
    ap.add_argument("--zfp-max-bytes", type=parse_bytes, default=4 << 20,
                    help="zfp columns only up to this size (zfpy runs at ~0.1 GB/s)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-ms", type=float, default=30.0)
    ap.add_argument("--label", default=None, help="run name (default: <hosts>host)")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--fsdp", type=int, default=0, metavar="STEPS",
                    help="train FSDP2 for STEPS steps with and without compression instead")
    ap.add_argument("--fsdp-codecs", default="int8,fp16")
    return ap.parse_args(argv)


def columns(args, nbytes: int, op: str = "all_gather") -> dict:
    """column name -> Compression (None: the backend's own collective). all_to_all has
    one algorithm, a2a (ring and p2p columns are left out for it)."""
    a2a_only = op == "all_to_all"
    cols = {args.backend: None}
    if args.aa:
        cols[f"{args.backend} A/A"] = None
    if not a2a_only:
        cols["ring"] = Compression("none", "ring")
    algorithms = ["a2a"] if a2a_only else [a for a in args.algorithms.split(",") if a]
    for codec in [c for c in args.codecs.split(",") if c]:
        if codec.startswith("zfp") and nbytes > args.zfp_max_bytes:
            continue
        for algo in algorithms:
            cols[f"{algo}:{codec}"] = Compression(codec, algo)
    for col in [c for c in args.extra.split(",") if c]:
        algo, _, codec = col.partition(":")
        if a2a_only and algo != "a2a":
            continue
        if not (codec.startswith("zfp") and nbytes > args.zfp_max_bytes):
            cols[col] = Compression(codec, algo)
    if args.auto and not a2a_only:
        cols[f"auto:{args.auto}"] = "auto:" + args.auto
    return cols


def make_call(op: str, backend: str, cz, n: int, x, out):
    if op == "all_gather":
        return lambda: mc.all_gather_into_tensor(out, x, backend=backend, compression=cz)
    if op == "reduce_scatter":
        return lambda: mc.reduce_scatter_tensor(out, x, backend=backend, compression=cz)
    if op == "all_to_all":
        return lambda: mc.all_to_all_single(out, x, backend=backend, compression=cz)
    raise SystemExit(f"unknown op {op!r}: use all_gather, reduce_scatter, all_to_all")


def buffers(op: str, n: int, size: int, rank: int):
    """(input, output) of one call: ``n`` float32 values per rank in (all-gather), per
    rank out (reduce-scatter), or per rank in and out, in ``size`` equal blocks
    (all-to-all: ``n`` rounded down to a multiple of ``size``)."""
    if op == "all_to_all":
        x = np.random.default_rng(rank).standard_normal(n - n % size).astype(np.float32)
        return x, np.empty_like(x)
    x = np.random.default_rng(rank).standard_normal(n * (size if op == "reduce_scatter" else 1))
    x = x.astype(np.float32)
    out = np.empty(n * size if op == "all_gather" else n, np.float32)
    return x, out


def worst(value: float) -> float:
    return COMM.allreduce(value, op=MPI.MAX)


def measure(args, op: str, nbytes: int):
    rank, size = COMM.Get_rank(), COMM.Get_size()
    n = nbytes // 4
    x, _ = buffers(op, n, size, rank)
    cols = columns(args, nbytes, op)
    outs = {name: np.empty_like(buffers(op, n, size, rank)[1]) for name in cols}
    calls = {name: make_call(op, args.backend, cz, n, x, outs[name]) for name, cz in cols.items()}
    ref = outs[args.backend]
    calls[args.backend]()
    errors, per_call = {}, {}
    for name, fn in calls.items():  # warm-up, error, and a time for the batch length
        fn()
        t0 = time.perf_counter()
        fn()
        per_call[name] = worst(time.perf_counter() - t0)
        diff = np.linalg.norm(outs[name].astype(np.float64) - ref) / np.linalg.norm(ref)
        errors[name] = worst(float(diff))
    names = list(calls)
    # one batch length for every column (that of the baseline): a column timed in shorter
    # batches would carry more of the barrier's skew between ranks per call
    batch = [max(1, int(args.batch_ms * 1e-3 / max(per_call[args.backend], 1e-6)))] * len(names)
    times = interleaved_batches([calls[k] for k in names], batch, args.rounds)
    med = {k: float(statistics.median(times[i])) for i, k in enumerate(names)}
    picks = {}
    if args.auto:
        from mcrdl_core.compress import auto

        picks = {k: auto.describe(cz, op, size, n, args.backend) for k, cz in cols.items()
                 if isinstance(cz, str)}
    return med, errors, picks


def fsdp_losses(steps: int, codec: str | None) -> tuple[list, float]:
    """Per-step mean loss over ranks of an FSDP2-sharded MLP fitting a fixed teacher,
    and the seconds the steps took; MCRDL_COMPRESSION=codec while it trains."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if codec:
        os.environ["MCRDL_COMPRESSION"] = codec
    else:
        os.environ.pop("MCRDL_COMPRESSION", None)
    rank, size = dist.get_rank(), dist.get_world_size()

    def mlp(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 8))

    teacher, model = mlp(1), mlp(0)
    mesh = init_device_mesh("cpu", (size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 64, generator=g)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # compressed too when the codec allows all_reduce: fine
        losses.append(mean.item() / size)
    os.environ.pop("MCRDL_COMPRESSION", None)
    return losses, time.perf_counter() - t0


def fsdp_main(args, label: str, size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("mcrdl")
    base, t_base = fsdp_losses(args.fsdp, None)
    tail = lambda v: sum(v[-10:]) / len(v[-10:])  # noqa: E731
    result = {"steps": args.fsdp, "ranks": size, "plain": {"final": tail(base), "first": base[0],
                                                           "seconds": t_base}}
    for codec in [c for c in args.fsdp_codecs.split(",") if c]:
        comp, t = fsdp_losses(args.fsdp, codec)
        diff = abs(tail(comp) - tail(base)) / tail(base)
        result[codec] = {"final": tail(comp), "rel_diff": diff, "seconds": t}
        if COMM.Get_rank() == 0:
            print(f"FSDP2 {args.fsdp} steps, {size} ranks: loss {base[0]:.4f} -> plain "
                  f"{tail(base):.5f}, {codec} {tail(comp):.5f} (rel. diff {diff:.3%}); "
                  f"{t_base:.1f} s vs {t:.1f} s", flush=True)
    dist.destroy_process_group()
    if COMM.Get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"compression_fsdp_{label}_{size}r.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, size = COMM.Get_rank(), COMM.Get_size()
    hosts = len(set(COMM.allgather(socket.gethostname())))
    label = args.label or f"{hosts}host"
    if args.fsdp:
        return fsdp_main(args, label, size)
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= args.factor
    rows = []
    for op in [o for o in args.ops.split(",") if o]:
        for nbytes in sizes:
            med, errors, picks = measure(args, op, nbytes)
            base = med[args.backend]
            for name, t in med.items():
                rows.append({"op": op, "bytes_per_rank": nbytes, "column": name, "time_s": t,
                             "speedup": base / t, "rel_l2_error": errors[name],
                             "auto_pick": picks.get(name, "")})
            if rank == 0:
                print(f"\n{op} {nbytes >> 10} KiB/rank, {size} ranks, {hosts} host(s), "
                      f"baseline {args.backend} {base * 1e3:.2f} ms", flush=True)
                for name, t in sorted(med.items(), key=lambda kv: kv[1]):
                    pick = f"  [{picks[name]}]" if name in picks else ""
                    print(f"  {name:<22} {t * 1e3:9.2f} ms  x{base / t:5.2f}  "
                          f"err {errors[name]:.1e}{pick}", flush=True)
                write(args, rows, label, size, hosts, final=False)  # a cut-off run keeps these
    if rank == 0:
        write(args, rows, label, size, hosts)
    return 0


def write(args, rows, label: str, size: int, hosts: int, final: bool = True) -> None:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"compression_{label}_{size}r")
    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"ranks": size, "hosts": hosts, "label": label, "backend": args.backend,
            "rounds": args.rounds, "host": socket.gethostname(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:]}
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if final:
        png = plot(rows, stem + ".png", f"{label}, {size} ranks, {args.backend}")
        print(f"\nwrote {stem}.csv, {stem}.json" + (f", {png}" if png else ""))


def plot(rows, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'mcr-dl[bench]')")
        return None
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(7 * len(ops), 5.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for col in dict.fromkeys(r["column"] for r in rows if r["op"] == op):
            pts = [(r["bytes_per_rank"], r["speedup"]) for r in rows
                   if r["op"] == op and r["column"] == col]
            ax.plot(*zip(*pts), marker="o", label=col)
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("speedup over the backend's collective")
        ax.set_title(f"{op} ({title})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
