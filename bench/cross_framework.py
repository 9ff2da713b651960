"""Cross-framework benchmark: one collective through raw libraries and through MCR-DL.

Run: mpiexec -n 2 .venv/bin/python bench/cross_framework.py [--op all_reduce]
         [--min-bytes 8] [--max-bytes 1M] [--factor 2] [--iters N] [--out bench/out]

The same op (all_reduce SUM, or all_gather; float32; sizes in bytes per rank) through:

  mpi4py            raw mpi4py: comm.Allreduce / Allgather on NumPy arrays (out of place)
  mpi4jax-jit       raw mpi4jax under jax.jit: jit(lambda x: mpi4jax.allreduce(x, MPI.SUM))
  torch-gloo        torch.distributed, init_process_group("gloo") (rank/size from MPI)
  jax-shard_map     JAX's own collectives: jax.distributed (CPU, Gloo collectives) and a
                    jitted jax.shard_map with lax.psum / lax.all_gather over a 1-D mesh of
                    the processes' devices
  mcrdl_torch-mpi   mcrdl_torch.all_reduce(t, backend="mpi")
  mcrdl_torch-auto  mcrdl_torch.all_reduce(t) (backend=None: table or policy)
  mcrdl_jax-eager   mcrdl_jax.all_reduce(x, backend="mpi")
  mcrdl_jax-jit     jax.jit(lambda x: mcrdl_jax.all_reduce(x, backend="mpi"))

Every call that returns a JAX array is followed by block_until_ready(). Before a size is
timed, each implementation's result is checked once against a NumPy reference on every
rank (the run aborts naming the implementation and ranks if one is wrong). Timing: each
implementation is warmed up, then runs in batches of back-to-back calls (batch length
chosen per implementation from the warm-up so a batch takes about --batch-ms, the same on
every rank and for the columns the ratio compares; or --iters). Each round runs one
batch of every implementation, in the order of a Williams design (over the rounds each
runs at each position and directly after every other equally often), an MPI barrier
before each batch, the collector off. A batch's figure is its time per call on the
slowest rank (MPI MAX); a column's figure is the median over the rounds. Rank 0 prints the table, the ratio
mcrdl_jax-jit / mpi4jax-jit per size (the JAX issue asks for 0.9-1.1), the added cost of
the mcrdl_jax eager path at the smallest size, and writes CSV, JSON and a PNG plot into
--out. MCRDL_TUNING_TABLE is set to "none" (auto = the policy) unless --table is given.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback

IMPLS = ("mpi4py", "mpi4jax-jit", "torch-gloo", "jax-shard_map", "mcrdl_torch-mpi",
         "mcrdl_torch-auto", "mcrdl_jax-eager", "mcrdl_jax-jit")
CONTROL = "mpi4jax-jit(A/A)"
SAME_BATCH = ("mpi4jax-jit", "mcrdl_jax-jit", CONTROL)
SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        return int(float(t[:-1]) * SUFFIX[t[-1]]) if t[-1:] in SUFFIX else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 8, 64K, 1M") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[5:15]))
    ap.add_argument("--op", choices=("all_reduce", "all_gather"), default="all_reduce")
    ap.add_argument("--min-bytes", type=parse_bytes, default=8, help="smallest size per rank (8)")
    ap.add_argument("--max-bytes", type=parse_bytes, default=1 << 20,
                    help="largest size per rank (1M); always measured")
    ap.add_argument("--factor", type=int, default=2, help="sizes grow by this factor (2)")
    ap.add_argument("--iters", type=int, default=None,
                    help="calls per batch for every implementation (default: from the warm-up, "
                         "so that a batch takes about --batch-ms)")
    ap.add_argument("--batch-ms", type=float, default=10.0, help="target batch length (10 ms)")
    ap.add_argument("--rounds", type=int, default=24,
                    help="rounds per size, at least (24; rounded up to whole Williams squares: "
                         "8 rounds for 8 columns, 18 for 9): each round runs one batch of "
                         "every implementation")
    ap.add_argument("--out", default="bench/out", help="folder for CSV, JSON, PNG (bench/out)")
    ap.add_argument("--table", nargs="?", const="", default=None, metavar="PATH",
                    help="let 'auto' use a tuning table: PATH, or the default one if no PATH "
                         "(without --table, MCRDL_TUNING_TABLE=none and auto = the policy)")
    ap.add_argument("--skip", default="", help=f"comma-separated columns to leave out, of {IMPLS}")
    ap.add_argument("--control", action="store_true",
                    help=f"add {CONTROL}: raw mpi4jax measured a second time (separately jitted), "
                         "an A/A column that shows the noise floor of the ratio")
    ap.add_argument("--reverse", action="store_true",
                    help="set up, check and interleave the implementations in reverse order "
                         "(to see whether a column's place in the order moves its figure)")
    args = ap.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = args.skip - set(IMPLS)
    if unknown:
        ap.error(f"--skip: unknown {sorted(unknown)}; columns are {IMPLS}")
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        ap.error("need 4 <= --min-bytes <= --max-bytes")
    if args.factor < 2:
        ap.error("--factor must be 2 or more")
    return args


def sizes_for(lo: int, hi: int, factor: int) -> list[int]:
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    return out + [hi]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- setup (before any JAX computation: jax.distributed must come first) --------------------
def setup(args):
    if args.table is None:
        os.environ["MCRDL_TUNING_TABLE"] = "none"
    elif args.table:
        os.environ["MCRDL_TUNING_TABLE"] = args.table
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    ports = comm.bcast([free_port(), free_port()] if comm.rank == 0 else None)
    env = {"comm": comm, "MPI": MPI, "rank": comm.rank, "n": comm.size, "dropped": {}}

    import jax

    if "jax-shard_map" not in args.skip:
        reason = None
        try:
            # CPU collectives across processes: off unless an implementation is named
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=f"127.0.0.1:{ports[0]}",
                                       num_processes=comm.size, process_id=comm.rank,
                                       initialization_timeout=120)
            if len(jax.devices()) != comm.size or len(jax.local_devices()) != 1:
                reason = (f"expected {comm.size} devices, 1 per process; got {jax.devices()} "
                          f"with local {jax.local_devices()}")
        except Exception as exc:  # noqa: BLE001  (any failure: leave the column out)
            reason = f"jax.distributed.initialize failed: {type(exc).__name__}: {exc}"
        reasons = [r for r in comm.allgather(reason) if r]
        if reasons:
            env["dropped"]["jax-shard_map"] = reasons[0]
    env["jax"] = jax

    import torch
    import torch.distributed as tdist

    if "torch-gloo" not in args.skip:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1]))
        tdist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    env["torch"], env["tdist"] = torch, tdist

    import mcrdl_jax
    import mcrdl_torch

    import mcrdl_core

    mcrdl_torch.init_process_group()
    env["mcrdl_core"], env["mj"], env["mdist"] = mcrdl_core, mcrdl_jax, mcrdl_torch
    return env


# --- implementations: make(x) -> (call, fetch); call() does one op, fetch(result) -> NumPy ----
def implementations(env, op: str, control: bool) -> dict:
    import jax.numpy as jnp
    import mpi4jax
    import numpy as np

    jax, MPI, comm, n = env["jax"], env["MPI"], env["comm"], env["n"]
    torch, tdist, mdist, mj = env["torch"], env["tdist"], env["mdist"], env["mj"]
    ar = op == "all_reduce"
    done = lambda y: y.block_until_ready()
    as_np = np.asarray

    def raw_mpi4py(x):
        out = np.empty_like(x) if ar else np.empty(n * x.size, x.dtype)
        if ar:
            return (lambda: (comm.Allreduce(x, out, MPI.SUM), out)[1]), as_np
        return (lambda: (comm.Allgather(x, out), out)[1]), as_np

    def jitted(fn):
        def make(x):
            xj = jnp.asarray(x)
            return (lambda: done(fn(xj))), (lambda y: np.asarray(y).reshape(-1))
        return make

    if ar:
        raw_jax = lambda: jax.jit(lambda x: mpi4jax.allreduce(x, op=MPI.SUM))
    else:
        raw_jax = lambda: jax.jit(lambda x: mpi4jax.allgather(x))

    def torch_gloo(x):
        t = torch.from_numpy(x.copy())
        if ar:
            return (lambda: (tdist.all_reduce(t), t)[1]), (lambda y: y.numpy())
        out = torch.empty(n * x.size, dtype=t.dtype)
        return (lambda: (tdist.all_gather_into_tensor(out, t), out)[1]), (lambda y: y.numpy())

    def shard_map_make():
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        smap = getattr(jax, "shard_map", None)
        if smap is None:  # older JAX
            from jax.experimental.shard_map import shard_map as smap
        mesh = Mesh(np.array(jax.devices()), ("p",))
        sharding = NamedSharding(mesh, P("p"))
        body = (lambda x: jax.lax.psum(x, "p")) if ar else \
            (lambda x: jax.lax.all_gather(x, "p", tiled=True))
        f = jax.jit(smap(body, mesh=mesh, in_specs=P("p"), out_specs=P("p")))
        dev = jax.local_devices()[0]

        def make(x):
            g = jax.make_array_from_single_device_arrays(
                (n * x.size,), sharding, [jax.device_put(x, dev)])
            return (lambda: done(f(g))), (lambda y: np.asarray(y.addressable_shards[0].data))
        return make

    def mcrdl_torch(backend):
        def make(x):
            t = torch.from_numpy(x.copy())
            if ar:
                return (lambda: (mdist.all_reduce(t, backend=backend), t)[1]), (lambda y: y.numpy())
            out = torch.empty(n * x.size, dtype=t.dtype)
            return ((lambda: (mdist.all_gather_into_tensor(out, t, backend=backend), out)[1]),
                    (lambda y: y.numpy()))
        return make

    if ar:
        mj_call = lambda x: mj.all_reduce(x, backend="mpi")
    else:
        mj_call = lambda x: mj.all_gather(x, backend="mpi", tiled=True)

    def mcrdl_jax_eager(x):
        xj = jnp.asarray(x)
        return (lambda: done(mj_call(xj))), (lambda y: np.asarray(y).reshape(-1))

    impls = {
        "mpi4py": raw_mpi4py,
        "mpi4jax-jit": jitted(raw_jax()),
        "torch-gloo": torch_gloo,
        "jax-shard_map": shard_map_make if "jax-shard_map" not in env["dropped"] else None,
        "mcrdl_torch-mpi": mcrdl_torch("mpi"),
        "mcrdl_torch-auto": mcrdl_torch(None),
        "mcrdl_jax-eager": mcrdl_jax_eager,
        "mcrdl_jax-jit": jitted(jax.jit(mj_call)),
    }
    if impls["jax-shard_map"] is not None:
        impls["jax-shard_map"] = impls["jax-shard_map"]()
    if control:
        impls[CONTROL] = jitted(raw_jax())  # a second jax.jit object: compiled on its own
    return impls


def abort(env, msg: str):
    sys.stderr.write(f"[rank {env['rank']}] {msg}\n")
    sys.stderr.flush()
    env["comm"].Abort(1)
    os._exit(1)  # in case Abort returns before the launcher ends this process


def check(env, name: str, make, x, ref, nbytes: int):
    """One call on the check input, compared with the NumPy reference on every rank."""
    try:
        call, fetch = make(x)
        got = fetch(call())
        err = None if got.shape == ref.shape and (got == ref).all() else (
            f"shape {got.shape} vs {ref.shape}" if got.shape != ref.shape else
            f"{int((got != ref).sum())} of {ref.size} elements differ, e.g. {got[:4]} vs {ref[:4]}")
    except Exception:  # noqa: BLE001  (a rank that raises would leave the others hanging)
        abort(env, f"{name} at {nbytes} B raised:\n{traceback.format_exc()}")
    errs = env["comm"].allgather(err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        if env["rank"] == 0:
            sys.stderr.write(f"WRONG RESULT: {name} at {nbytes} B per rank: " + "; ".join(
                f"rank {r}: {e}" for r, e in bad) + "\n")
        env["comm"].Barrier()
        abort(env, "aborting: an implementation returned a wrong result")


def measure_size(env, impls: dict, op: str, nbytes: int, args):
    """{name: {"median", "p25", "p75", "rounds", "calls", "samples"}}, seconds per call."""
    import numpy as np
    from timing import interleaved_batches

    comm, MPI, n, rank = env["comm"], env["MPI"], env["n"], env["rank"]
    count = max(nbytes // 4, 1)
    base = (np.arange(count) % 13).astype(np.float32)
    x = base + 3 * rank + 1
    ref = (sum(base + 3 * r + 1 for r in range(n)) if op == "all_reduce" else
           np.concatenate([base + 3 * r + 1 for r in range(n)])).astype(np.float32)
    zeros = np.zeros(count, np.float32)  # timing input: sums stay 0 through in-place calls
    calls = {}
    for name, make in impls.items():
        check(env, name, make, x, ref, nbytes)
        calls[name] = make(zeros)[0]
    names = list(calls)
    fns = [calls[k] for k in names]
    # warm-up, and the time of one call (slowest rank), from which each batch's length
    est = np.zeros(len(fns))
    for i, fn in enumerate(fns):
        for _ in range(3):
            fn()
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        est[i] = (time.perf_counter() - t0) / 5
    comm.Allreduce(MPI.IN_PLACE, est, op=MPI.MAX)
    # the columns compared by the ratio run batches of the same length
    same = [i for i, k in enumerate(names) if k in SAME_BATCH]
    if same:
        est[same] = est[same].max()
    if args.iters:
        per = [args.iters] * len(fns)
    else:
        per = [int(min(1000, max(1, args.batch_ms * 1e-3 / e))) for e in est]
    times = interleaved_batches(fns, per, args.rounds)
    out = {}
    for i, name in enumerate(names):
        q = np.percentile(times[i], [25, 50, 75])
        out[name] = {"median": float(statistics.median(times[i])), "p25": float(q[0]),
                     "p75": float(q[2]), "rounds": int(times.shape[1]), "calls": per[i],
                     "samples": times[i].tolist()}
    return out


def auto_pick(env, op: str, nbytes: int) -> str:
    """The backend mcrdl_torch-auto chooses at this size (as the call would)."""
    try:
        from mcrdl_core.tools.cli import _pick

        return _pick(env["mcrdl_core"].get_runtime(), op, nbytes)
    except Exception as exc:  # noqa: BLE001  (informational only)
        return f"? ({type(exc).__name__})"


# --- report (rank 0) ------------------------------------------------------------------------
def report(env, args, sizes, res, picks, cols):
    n, op = env["n"], args.op
    ratio = {s: res[s]["mcrdl_jax-jit"]["median"] / res[s]["mpi4jax-jit"]["median"]
             for s in sizes if {"mcrdl_jax-jit", "mpi4jax-jit"} <= set(res[s])}
    aa = {s: res[s][CONTROL]["median"] / res[s]["mpi4jax-jit"]["median"]
          for s in sizes if CONTROL in res[s]}
    # the same ratio taken round by round (both batches of a round ran close in time)
    paired = {s: statistics.median(a / b for a, b in zip(res[s]["mcrdl_jax-jit"]["samples"],
                                                         res[s]["mpi4jax-jit"]["samples"]))
              for s in ratio}
    s0 = sizes[0]
    eager = {}
    if "mcrdl_jax-eager" in res[s0]:
        e = res[s0]["mcrdl_jax-eager"]["median"]
        for k in ("mpi4py", "mpi4jax-jit"):
            if k in res[s0]:
                eager[f"vs {k}"] = (e - res[s0][k]["median"]) * 1e6
    table = getattr(env["mcrdl_core"].get_runtime(), "table", None)
    table_desc = getattr(table, "path", None) or "none (auto = the policy)"

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    title = (f"{op} float32, {n} ranks: median µs per call over rounds (per batch: the slowest "
             f"rank); table: {table_desc}")
    heads = ["bytes"] + cols + (["jit/mpi4jax"] if ratio else []) + \
        (["A/A"] if aa else []) + ["auto picks"]
    rows = []
    for s in sizes:
        row = [str(s)] + [f"{res[s][c]['median'] * 1e6:.1f}" if c in res[s] else "-" for c in cols]
        if ratio:
            row.append(f"{ratio[s]:.3f}" if s in ratio else "-")
        if aa:
            row.append(f"{aa[s]:.3f}" if s in aa else "-")
        rows.append(row + [picks[s]])
    if Console:
        t = Table(title=title, title_justify="left")
        for h in heads:
            t.add_column(h, justify="left" if h == "auto picks" else "right")
        for row in rows:
            style = None
            if ratio and row[len(cols) + 1] != "-" and not 0.9 <= float(row[len(cols) + 1]) <= 1.1:
                style = "yellow"
            t.add_row(*row, style=style)
        Console(width=sum(max(len(h), 8) + 3 for h in heads) + 1).print(t)
    else:
        print(title)
        print(" ".join(f"{h:>12s}" for h in heads))
        for row in rows:
            print(" ".join(f"{v:>12s}" for v in row))
    for name, why in env["dropped"].items():
        print(f"column {name} left out: {why}")
    if ratio:
        inside = [s for s in sizes if s in ratio and 0.9 <= ratio[s] <= 1.1]
        print(f"mcrdl_jax-jit / mpi4jax-jit: {min(ratio.values()):.3f}..{max(ratio.values()):.3f}; "
              f"within 0.9-1.1 at {len(inside)} of {len(ratio)} sizes"
              + ("" if len(inside) == len(ratio) else "; outside: " + ", ".join(
                  f"{s} B {ratio[s]:.3f}" for s in sizes if s in ratio and s not in inside)))
    if paired:
        print(f"  the same ratio round by round (median over rounds of the two batches' ratio): "
              f"{min(paired.values()):.3f}..{max(paired.values()):.3f}")
    if aa:
        print(f"A/A control {CONTROL} / mpi4jax-jit: {min(aa.values()):.3f}..{max(aa.values()):.3f}"
              " (the same program twice: the noise floor of the ratio)")
    if eager:
        print(f"mcrdl_jax eager added cost at {s0} B: " + ", ".join(
            f"{v:+.1f} µs {k}" for k, v in eager.items()))

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"cross_framework-{op}-n{n}")
    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["op", "bytes", "implementation", "median_us", "p25_us", "p75_us", "rounds",
                    "calls_per_batch"])
        for s in sizes:
            for c in cols:
                if c in res[s]:
                    r = res[s][c]
                    w.writerow([op, s, c, f"{r['median'] * 1e6:.3f}", f"{r['p25'] * 1e6:.3f}",
                                f"{r['p75'] * 1e6:.3f}", r["rounds"], r["calls"]])
    meta = {"op": op, "dtype": "float32", "world_size": n, "host": platform.node(),
            "cpus": os.cpu_count(), "table": table_desc, "args": {
                k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
            "versions": versions(env), "dropped": env["dropped"]}
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "columns": cols,
                   "results_us": {str(s): {c: {k: us(k, v) for k, v in r.items()}
                                           for c, r in res[s].items()} for s in sizes},
                   "auto_picks": {str(s): picks[s] for s in sizes},
                   "ratio_mcrdl_jax_jit_over_mpi4jax": {str(s): r for s, r in ratio.items()},
                   "ratio_paired_median": {str(s): r for s, r in paired.items()},
                   "ratio_control_aa": {str(s): r for s, r in aa.items()},
                   "mcrdl_jax_eager_added_us": {"bytes": s0, **eager}}, f, indent=1)
    png = plot(res, sizes, cols, f"{op} float32, {n} ranks: median latency per call", stem + ".png")
    print(f"wrote {stem}.csv, {stem}.json" + (f", {png}" if png else ""))


def us(key, v):
    if key in ("median", "p25", "p75"):
        return v * 1e6
    return [round(t * 1e6, 3) for t in v] if key == "samples" else v


def versions(env) -> dict:
    import importlib.metadata as md

    out = {}
    for p in ("jax", "jaxlib", "mpi4jax", "mpi4py", "torch", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    out["mpi"] = env["MPI"].Get_library_version().splitlines()[0].strip()
    return out


def plot(res, sizes, cols, title, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for c in cols:
        xs = [s for s in sizes if c in res[s]]
        ax.plot(xs, [res[s][c]["median"] * 1e6 for s in xs], marker=".",
                linestyle="--" if c.startswith("mcrdl") else "-", label=c)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("latency per call (µs, median)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/timing.py
    env = setup(args)
    rank = env["rank"]
    impls = {k: v for k, v in implementations(env, args.op, args.control).items()
             if v is not None and k not in args.skip}
    if args.reverse:
        impls = dict(reversed(impls.items()))
    cols = [c for c in (*IMPLS, CONTROL) if c in impls]  # the table's order, whatever the run's
    if rank == 0:
        for name, why in env["dropped"].items():
            print(f"column {name} left out: {why}", flush=True)
    sizes = sizes_for(args.min_bytes, args.max_bytes, args.factor)
    res, picks = {}, {}
    t_start = time.perf_counter()
    for s in sizes:
        res[s] = measure_size(env, impls, args.op, s, args)
        picks[s] = auto_pick(env, args.op, s)
        if rank == 0:
            print(f"  {s:>8d} B done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr,
                  flush=True)
    if rank == 0:
        report(env, args, sizes, res, picks, cols)
    env["comm"].Barrier()
    if env["tdist"].is_initialized():
        env["tdist"].destroy_process_group()
    env["mdist"].destroy_process_group()
    if "jax-shard_map" not in env["dropped"] and "jax-shard_map" not in args.skip:
        env["jax"].distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
