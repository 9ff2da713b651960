"""``mcrdl``: the command line of MCR-DL. Run it under the launcher, e.g.

    mpiexec -n 2 mcrdl tune --max-bytes 64M     # measure, decide, verify, write the table
    mpiexec -n 2 mcrdl tune --verify            # re-check the table in place (no rewrite)
    mpiexec -n 2 mcrdl tune --ops all_reduce --sizes 64K 128K   # re-tune just those
    mpiexec -n 2 mcrdl bench --max-bytes 1M     # latency/bandwidth per backend and auto
    mcrdl info                                  # backends, bootstrap, table in force
    mpiexec -n 2 mcrdl tune --device cuda       # CUDA buffers (one GPU per rank for nccl)
    mpiexec -n 2 mcrdl tune --compression fp16,int8   # + compressed variants as candidates
    mcrdl cluster run --hosts 2 --rate 1gbit -- mcrdl bench --ops all_gather --sizes 16M
                                                # on an emulated 2-host cluster (root)

Only rank 0 prints and writes files. ``mcrdl cluster`` runs without a launcher (it is
one): see mcrdl_core/cluster/command.py.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys

from ..base import dtypes
from ..base.errors import McrdlError
from ..algorithms import hier as _hier
from ..base.ops import Op, ReduceOp
from ..cluster.command import add_parser as add_cluster_parser
from ..compress import native as _native
from ..compress.spec import make_codec
from ..dispatch.runtime import init
from ..dispatch.selection import TuningTable
from ..memory.buffer import Buffer, Device
from ..memory.cuda import cupy, device_count, device_reason
from ..observe import recorder as _recorder
from ..observe.logger import bandwidths
from ..world.backend import load_attr
from ..world.bootstrap import cluster_info
from . import sweep as _sweep
from . import trace as _trace
from . import tuning as _tuning

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = SUFFIX.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if text[-1:] in SUFFIX else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 4096, 64K, 64M") from None


def _usable(rt, wanted, device: str = "cpu"):
    """The backends to measure: ``wanted``, or every available one that handles
    ``device`` buffers (nccl included for "cuda" when it can run here)."""
    avail = {b for b, r in rt.available_backends().items() if r is None}
    if wanted:
        missing = [b for b in wanted if b not in avail]
        if missing:
            raise SystemExit(f"mcrdl: backends {missing} are not available here: "
                             f"{ {b: rt.available_backends()[b] for b in missing} }")
        return list(wanted)
    probe = _probe(device, 4)
    return [b for b in ("mpi", "gloo", "nccl") if b in avail
            and rt.backend(b).unsupported_reason(Op.ALL_REDUCE, Device(device), probe.dtype,
                                                 ReduceOp.SUM) is None]


def _probe(device: str, count: int):
    """A float32 Buffer of ``count`` elements for selection (metadata only on a GPU)."""
    import numpy as np

    if device == "cpu":
        return Buffer.from_numpy(np.empty(count, dtype=np.float32))
    return Buffer(0, (count,), dtypes.float32, Device(device, 0))


def _use_device(rt, device: str) -> None:
    """On a GPU: each rank of a host takes its own device (local rank modulo devices)."""
    if device == "cuda":
        reason = device_reason()
        if reason is not None:
            raise SystemExit(f"mcrdl: --device cuda, but {reason}")
        cupy().cuda.Device(rt.bootstrap.local_rank % device_count()).use()


class _Progress:
    """A rich progress bar on rank 0 (plain lines if rich is missing)."""

    def __init__(self, rank: int, total: int, title: str):
        self.bar = None
        self.rank = rank
        if rank != 0:
            return
        try:
            from rich.progress import Progress

            self.bar = Progress(transient=False)
            self.bar.start()
            self.task = self.bar.add_task(title, total=total)
        except ImportError:
            print(f"{title}: {total} points", flush=True)

    def step(self, op, size):
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{op} {size} B")

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def _run_sweep(rt, args, backends, title, watch=None):
    """{op: {size: {column: per-round seconds}}} of the bench's sweep, with a progress
    bar; ``watch`` (a LoadWatch) sampled after each point."""
    sizes = _sizes(args)
    total = sum(1 if op == "barrier" else len(sizes) for op in args.ops)
    bar = _Progress(rt.rank, total, title)

    def on_point(op, size):
        if watch is not None:
            watch.sample()
        bar.step(op, size)

    try:
        return _sweep.sweep_rounds(args.ops, sizes, backends, trials_scale=args.trials_scale,
                                   on_point=on_point, device=args.device)
    finally:
        bar.close()


def _tune_codecs(text: str | None, device: str, ops) -> tuple:
    """The codecs of ``--compression`` ("fp16,int8"), checked before anything is sent:
    known codec names (no algorithm: the sweep measures ring, and a2a for
    reduce_scatter, the encoded all-to-all for all_to_all), usable on ``device``. Empty
    without the option."""
    if not text:
        return ()
    codecs = tuple(dict.fromkeys(c.strip().lower() for c in text.split(",") if c.strip()))
    for c in codecs:
        if "@" in c or "+" in c or c.startswith("auto") or c == "table":
            raise SystemExit(f"mcrdl tune: --compression takes codec names (e.g. fp16,int8), "
                             f"not {c!r}: the sweep measures each codec's ring (and a2a for "
                             "reduce_scatter and all_to_all) over every backend itself")
        try:
            make_codec(c, "float32").check_device(device)
        except McrdlError as exc:
            raise SystemExit(f"mcrdl tune: --compression {c}: {exc}") from None
    if not set(ops) & set(_sweep.COMPRESSED_ALGORITHMS):
        raise SystemExit("mcrdl tune: --compression needs one of the ops "
                         f"{sorted(_sweep.COMPRESSED_ALGORITHMS)} in --ops")
    return codecs


def _measure(args):
    """``measure(op, size, columns, rounds or None)`` for the tuner: paired rounds of
    the sweep (``trials_for`` rounds unless given)."""
    def measure(op, size, cols, rounds):
        return _sweep.measure_rounds(op, size, cols,
                                     rounds or _sweep.trials_for(size, args.trials_scale),
                                     device=args.device)
    return measure


def _read_table(path: str, quiet: bool = False) -> dict | None:
    """The table dict at ``path``, or None (absent; unreadable, with a warning)."""
    if not os.path.exists(path):
        return None
    try:
        return TuningTable.load(path).data
    except Exception as exc:  # a bad old file is replaced, and we say so
        if not quiet:
            logging.getLogger("mcrdl.tune").warning("replacing unreadable table: %s", exc)
        return None


TUNE_LOAD_ADVICE = ("The table stays safe: a backend replaces the policy's only where it won "
                    "with confidence, and ranges that lose in the verification go back to the "
                    "policy (docs/tuning.md). Tune again on a quiet machine for the crossovers.")
BENCH_LOAD_ADVICE = ("What load does to these figures: another process that takes a rank's "
                     "core in the middle of a block adds its time to that block, at random, "
                     "most to the smallest messages (a 3 µs call can read 10 µs or more), so "
                     "two columns of one point can differ by tens of percent by chance and "
                     "the verdict below says little about auto; the A/A control (--control) "
                     "shows how much. Bench again on a quiet machine.")


def _print_load(report: dict, when: str, advice: str = TUNE_LOAD_ADVICE) -> None:
    if report["warnings"]:
        print(f"\nWARNING: timings {when} may describe the machine more than the backends:")
        for w in report["warnings"]:
            print("  - " + w)
        print("  " + advice)


def tuned_ops(ops, device: str) -> list:
    """The ops a tune measures on ``device``. Barrier on CUDA buffers is left out: a
    barrier is selected with a CUDA probe only when a backend is named for it (nccl as
    the group's default, say), and a named backend comes before the table, so a cuda
    barrier entry would never be read (an H200 tune wrote one, verified against the host
    barrier auto actually ran). Barriers take their entry from the host tune."""
    return [op for op in ops if not (device == "cuda" and op == "barrier")]


def cmd_tune(args) -> int:
    args.ops = tuned_ops(args.ops, args.device)
    codecs = _tune_codecs(args.compression, args.device, args.ops)
    if os.environ.pop("MCRDL_COMPRESSION", None):  # else plain columns would be compressed
        logging.getLogger("mcrdl.tune").warning(
            "MCRDL_COMPRESSION is ignored while tuning: the plain columns are the backends' own "
            "collectives (allow codecs with --compression)")
    rt = init()
    _use_device(rt, args.device)
    backends = _usable(rt, args.backends, args.device)
    path = args.output or _tuning.default_path()
    hosts = len(rt.bootstrap.hosts)
    watch = _sweep.LoadWatch(rt)
    before = watch.finish()  # the conditions as the run starts (collective)
    if rt.rank == 0:
        _print_load(before, "taken now")
    in_force = rt.table
    try:
        if args.verify:
            return _verify_only(rt, args, backends, path, hosts)
        return _tune(rt, args, backends, codecs, path, hosts, _sweep.LoadWatch(rt))
    finally:
        rt.set_table(in_force)


def _tune(rt, args, backends, codecs, path, hosts, watch) -> int:
    hierarchical = (args.device == "cpu" and not args.no_hier
                    and _hier.applies(rt, rt.world))
    what = (f"{len(backends)} backends" + (" + hier" if hierarchical else "")
            + (f" + {'/'.join(codecs)} variants" if codecs else ""))
    sizes = _sizes(args)
    total = sum(1 if op == "barrier" else len(sizes) for op in args.ops)
    bar = _Progress(rt.rank, total, f"tuning {what} ({args.device})")

    def on_point(op, size):
        watch.sample()
        bar.step(op, size)

    try:
        res = _sweep.sweep_rounds(args.ops, sizes, backends, trials_scale=args.trials_scale,
                                  on_point=on_point, device=args.device, compression=codecs,
                                  hierarchical=hierarchical)
    finally:
        bar.close()
    measure = _measure(args)
    still = _tuning.remeasure_undecided(rt, res, args.device, measure, margin=args.margin)
    results = {(op, rt.world_size, hosts, args.device, "float"): pts for op, pts in res.items()}
    machine = _tuning.fingerprint(rt.bootstrap.hosts)

    def decide():
        existing = _read_table(path)
        prior = existing if (args.sizes and existing and not _tuning.machine_differences(
            existing.get("machine", {}), machine)) else None
        return _tuning.merge_table(existing, _tuning.build_entries(
            results, prior, switch_cost=args.switch_cost, margin=args.margin), machine)

    table = _tuning.on_root(rt, decide)
    if rt.rank == 0:
        print(f"\nVerifying: auto through the new table against each backend "
              f"({', '.join(backends)}), side by side")
    keys = list(results)
    ver = _tuning.verify(rt, table, keys, backends, measure, margin=args.margin,
                         sizes={k: sorted(v) for k, v in results.items()} if args.sizes else None,
                         repairs=0 if args.no_repair else 2)
    load = watch.finish(_sweep.round_spread(res))
    if rt.rank != 0:
        return 0
    table = ver["table"]
    table["machine"]["load"] = load
    _tuning.write_table(table, path)
    print(f"\nCrossover table for {rt.world_size} ranks on {hosts} host(s) "
          "(message size per rank -> backend"
          + ("; compressed: the variants that beat it, fastest first" if codecs else "") + "):")
    for line in _tuning.crossover_lines(TuningTable(table, path, warn=False), rt.world_size, hosts):
        print("  " + line)
    if still:
        print(f"  {len(still)} point(s) stayed undecided after re-measuring and keep the "
              "current choice: " + ", ".join(f"{op} {_tuning.fmt_bytes(s)}" for op, s in still[:8])
              + (" ..." if len(still) > 8 else ""))
    print("Verification (sums over the verified points, each measured side by side):")
    for line in ver["lines"]:
        print("  " + line)
    print("  " + ver["total"])
    _print_load(load, "of this run")
    print(f"Tuning table written to {path}")
    return 0


def _verify_only(rt, args, backends, path, hosts) -> int:
    """``mcrdl tune --verify``: the verification pass on the table at ``path`` for this
    job's shape, printed; the file is not rewritten. Exit status 1 if a range loses."""
    def load():
        if not os.path.exists(path):
            raise SystemExit(f"mcrdl tune --verify: no table at {path}")
        return TuningTable.load(path).data

    table = _tuning.on_root(rt, load)
    wanted = {_tuning.entry_name(op) for op in args.ops}
    keys = sorted({("send_recv" if e["op"] in ("send", "recv") else e["op"], e["world_size"],
                    e.get("hosts", 1), e["device"], e["dtype_class"]) for e in table["entries"]
                   if e["op"] in wanted | ({"recv"} if "send" in wanted else set())
                   and e["world_size"] == rt.world_size and e.get("hosts", 1) == hosts
                   and e["device"] == args.device})
    if not keys:
        if rt.rank == 0:
            print(f"{path} has no entries for {rt.world_size} ranks on {hosts} host(s), "
                  f"{args.device}, ops {' '.join(args.ops)}: nothing to verify")
        return 0
    fallback = _sizes(args)
    sizes = {k: (e.get("measured", {}).get("sizes") or
                 ([0] if k[0] == "barrier" else fallback))
             for k in keys for e in _tuning.entries_of(table, k)[:1]}
    ver = _tuning.verify(rt, table, keys, backends, _measure(args), sizes=sizes, repairs=0,
                         margin=args.margin, reuse=False)
    if rt.rank != 0:
        return 1 if ver["lost"] else 0
    print(f"\nVerification of {path} ({rt.world_size} ranks on {hosts} host(s); the file is "
          "not rewritten):")
    for line in ver["lines"]:
        print("  " + line)
    print("  " + ver["total"])
    if ver["lost"]:
        print(f"{ver['lost']} range(s) lose against a single backend: re-tune them "
              "(mcrdl tune --ops OP --sizes SIZES, docs/tuning.md)")
    return 1 if ver["lost"] else 0


def _sizes(args) -> list[int]:
    return (sorted(set(args.sizes)) if args.sizes
            else _sweep.sizes_between(args.min_bytes, args.max_bytes))


def control_backend(choice: str | None, backends, device: str) -> str | None:
    """The backend the A/A control measures again (``--control [BACKEND]``): None without
    the option; the named one (it must be measured); by default the policy's (mpi for
    host buffers where measured), whatever the order of ``--backends``, so the control
    is the backend a table naming one backend runs."""
    if choice is None:
        return None
    if choice:
        if choice not in backends:
            raise SystemExit(f"mcrdl bench: --control {choice}: not among the measured "
                             f"backends {backends}")
        return choice
    return _tuning.policy_choice(device, backends)


def cmd_bench(args) -> int:
    rt = init()
    _use_device(rt, args.device)
    backends = _usable(rt, args.backends, args.device)
    ctl = control_backend(args.control, backends, args.device)
    control = [f"{ctl}@2"] if ctl else []
    cols = backends + ["auto"] + control
    watch = _sweep.LoadWatch(rt)
    rounds = _run_sweep(rt, args, cols, f"bench {', '.join(cols)}", watch)
    load = watch.finish(_sweep.round_spread(rounds))
    if rt.rank != 0:
        return 0
    res = _sweep.medians(rounds)
    n = rt.world_size
    rows = []
    for op, pts in res.items():
        for size, lat in pts.items():
            for be, s in lat.items():
                alg, bus = bandwidths(op, _sweep.algbw_bytes(op, size, n), n, s)
                rows.append({"op": op, "bytes": size, "backend": be, "latency_us": s * 1e6,
                             "algbw_GBps": alg / 1e9, "busbw_GBps": bus / 1e9})
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench-n{n}")
    with open(stem + ".csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    verdict = _auto_verdict(res, backends, "auto")
    if control:
        verdict["control"] = _auto_verdict(res, [ctl], control[0])
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump({"world_size": n, "table": getattr(rt.table, "path", None), "rows": rows,
                   "auto_vs_best": verdict, "load": load}, f, indent=1)
    _print_bench(res, backends, control, n, rt, args.device)
    png = _plot(res, cols, n, stem + ".png")
    _print_load(load, "of this run", BENCH_LOAD_ADVICE)
    print(f"auto within max(5%, 2 µs) of the best single backend at {verdict['within']} of "
          f"{verdict['points']} points; sweep total: auto {verdict['auto_total_us']:.1f} µs vs "
          f"best single backend ({verdict['best_backend']}) {verdict['best_total_us']:.1f} µs"
          f" ({_pct(verdict['auto_total_us'], verdict['best_total_us'])})"
          + ("; measured under load (the warning above): these figures describe the machine "
             "as much as auto" if load["warnings"] else ""))
    if verdict["misses"]:
        print("  outside the bound: " + "; ".join(verdict["misses"][:10]))
    if control:
        c = verdict["control"]
        print(f"A/A control: {control[0]} (the same backend measured again) within the same "
              f"bound of {ctl} at {c['within']} of {c['points']} points; total "
              f"{c['auto_total_us']:.1f} µs vs {c['best_total_us']:.1f} µs "
              f"({_pct(c['auto_total_us'], c['best_total_us'])}): the noise floor of this "
              "machine")
    print(f"wrote {stem}.csv, {stem}.json" + (f", {png}" if png else ""))
    return 0


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.1f}%" if b > 0 else "n/a"


def _auto_verdict(res, backends, col: str) -> dict:
    """How often column ``col`` is within max(5%, 2 µs) of the best of ``backends``."""
    within, points, misses = 0, 0, []
    totals = {b: 0.0 for b in backends + [col]}
    for op, pts in res.items():
        for size, lat in pts.items():
            best = min(lat[b] for b in backends)
            points += 1
            ok = lat[col] <= best + max(0.05 * best, 2e-6)
            within += ok
            if not ok:
                misses.append(f"{op} {size} B: {col} {lat[col] * 1e6:.1f} µs vs best "
                              f"{best * 1e6:.1f} µs")
            for b in totals:
                totals[b] += lat[b]
    best_b = min(backends, key=totals.get)
    return {"points": points, "within": within, "misses": misses,
            "auto_total_us": totals[col] * 1e6, "best_backend": best_b,
            "best_total_us": totals[best_b] * 1e6,
            "totals_us": {b: t * 1e6 for b, t in totals.items()}}


def _print_bench(res, backends, control, n, rt, device="cpu"):
    print(f"\nLatency (µs, median of per-call max over {n} ranks); table: "
          f"{getattr(rt.table, 'path', None) or 'none (auto = policy)'}")
    cols = backends + ["auto"] + control
    head = f"{'op':15s} {'bytes':>9s} " + " ".join(f"{b:>9s}" for b in cols)
    print(head + f" {'fastest':>8s} {'auto picks':>10s} {'auto busbw GB/s':>16s}")
    for op, pts in res.items():
        for size, lat in pts.items():
            _, bus = bandwidths(op, _sweep.algbw_bytes(op, size, n), n, lat["auto"])
            fastest = min(backends, key=lat.get)
            print(f"{op:15s} {size:9d} " + " ".join(f"{lat[b] * 1e6:9.1f}" for b in cols)
                  + f" {fastest:>8s} {_pick(rt, op, size, device):>10s} {bus / 1e9:16.3f}")


def _pick(rt, op: str, size: int, device: str = "cpu") -> str:
    """The backend ``backend="auto"`` chooses for this sweep point (as the call would)."""
    import numpy as np

    core_op = Op.SEND if op == "send_recv" else Op(op)
    if core_op is Op.BARRIER:
        buf = Buffer.from_numpy(np.zeros(1, dtype=np.uint8))
    else:
        buf = _probe(device, _sweep.element_count(op, size, rt.world_size, 4))
    reduce_op = ReduceOp.SUM if core_op in (Op.ALL_REDUCE, Op.REDUCE, Op.REDUCE_SCATTER) else None
    return rt.select(core_op, rt.world, buf, "auto", reduce_op).name


def _plot(res, cols, n, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'mcr-dl[bench]')")
        return None
    ops = [op for op in res if op != "barrier"]
    cols_n = 3
    rows_n = (len(ops) + cols_n - 1) // cols_n
    fig, axes = plt.subplots(rows_n, cols_n, figsize=(5 * cols_n, 3.6 * rows_n), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        sizes = sorted(res[op])
        for b in cols:
            ax.plot(sizes, [res[op][s][b] * 1e6 for s in sizes], marker=".",
                    linestyle="--" if b == "auto" else "-", label=b)
        latency_axes(ax, op)
        ax.legend()
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"MCR-DL latency per backend, {n} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def latency_axes(ax, title: str) -> None:
    """Log-log axes of latency (µs) against bytes per rank (the bench plots)."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("latency (µs)")
    ax.grid(True, alpha=0.3)


def cmd_info(args) -> int:
    rt = init()
    if rt.rank != 0:
        return 0
    bs = rt.bootstrap
    print(f"bootstrap: {bs.kind}; world size {rt.world_size}; topology: {bs.topology()}")
    cl = cluster_info()
    if cl:
        print(f"emulated cluster {cl['name']} on machine {cl['machine']}: hosts "
              f"{', '.join(cl['hosts'])}, {cl['ranks_per_host']} rank(s) per host, links "
              f"{cl['rate']}, delay {cl['delay']} (mcrdl cluster)")
    print("backends:")
    for name, reason in rt.available_backends().items():
        print(f"  {name:5s} {'available' if reason is None else 'unavailable: ' + reason}")
    if rt.unavailable_reason("mpi") is None:
        from mpi4py import MPI

        cuda_support = load_attr("mcrdl_backends.mpi:cuda_support")
        compiled = load_attr("mcrdl_backends.mpi:compiled")
        fast_module = load_attr("mcrdl_backends.mpi:fast_module")

        aware, how = cuda_support()
        print(f"MPI library: {MPI.Get_library_version().splitlines()[0].strip()}; CUDA-aware: "
              f"{'yes' if aware else 'no'} ({how}): CUDA buffers "
              f"{'go to MPI as device pointers' if aware else 'are staged through pinned host memory'}")
        mod, why = compiled()
        print("MPI fast path: " + ("compiled issuers (mcrdl_backends.mpi_fast)"
                                   if fast_module() is not None else
                                   "mpi4py issuers: " + (why if mod is None else
                                                         "MCRDL_MPI_FAST is off")))
    try:
        facts = load_attr("mcrdl_torch.facts:compiled")
    except ImportError:  # no torch here: no torch frontend to report on
        facts = None
    if facts is not None:
        mod, why = facts()
        print("torch tensor facts: " + ("compiled (mcrdl_torch.tensor_facts)" if mod is not None
                                        else "read from Python: " + why))
    lib, why = _native.library()
    print("codec kernels: " + ("compiled (mcrdl_core/compress/codec_kernels.so; fp16 on "
                               + ("the CPU's F16C conversions)" if lib.mcrdl_fp16_simd(-1)
                                  else "bit arithmetic: no AVX2/F16C here)")
                               if _native.active() is not None else
                               "NumPy path: " + (why if lib is None else
                                                 "MCRDL_CODEC_KERNELS is off")))
    print("flight recorder: " + (
        "off (MCRDL_TRACE_ENTRIES=0)" if not _recorder.ON else
        f"{_recorder.SIZE} entries, " + (
            "compiled ring (mcrdl_core/observe/ring.c)" if _recorder.NATIVE is not None else
            "Python ring: " + ("MCRDL_TRACE_STACK=1 (each call's frame)" if _recorder.STACK
                               else "observe/ring.c not built (python -m "
                               "mcrdl_core.tools.build_ring)"))))
    reason = device_reason()
    print(f"CUDA: {'available, ' + str(_device_count()) + ' device(s)' if reason is None else reason}")
    print(_conditions_now(bs))
    path = _tuning.default_path()
    if rt.table is not None:
        hosts = len(bs.hosts)
        where = f"{rt.world_size} ranks on {hosts} host(s)"
        print(f"tuning table in force: {rt.table.path} ({rt.table.data['schema']}"
              + (": an older table, its entries count as one host)"
                 if rt.table.data["schema"] != _tuning.SCHEMA else ")"))
        lines = _tuning.crossover_lines(rt.table, rt.world_size, hosts)
        print(f"  entries for {where} (the world group):" if lines else
              f"  no entries for {where}: every lookup on the world falls back to the policy")
        for line in lines:
            print("    " + line)
        others = sorted({(e["world_size"], e.get("hosts", 1)) for e in rt.table.data["entries"]}
                        - {(rt.world_size, hosts)})
        if others:
            print("  also holds " + ", ".join(f"{n} ranks on {h} host(s)" for n, h in others)
                  + " (used by groups of that shape)")
        for line in rt.table.lost:
            print(f"  not used (its verification lost; the policy runs there): {line}")
        print("  " + _load_line(rt.table.data.get("machine", {}).get("load")))
    elif os.path.exists(path):
        print(f"tuning table: {path} exists but is not in force (see the warning above); "
              "selection uses the policy")
    else:
        print(f"tuning table: none ({path} absent); selection uses the policy "
              "(mpi, then gloo, for host buffers; nccl, then mpi, then gloo, for CUDA buffers)")
    return 0


def _load_line(load: dict | None) -> str:
    """What a table's machine block says of the load it was tuned under."""
    if not load:
        return "tuned under: not recorded (a table from before load was recorded)"
    hosts = "; ".join(f"{h['host']}: {h['ranks']} ranks on {h['cores']} cores, load average "
                      f"{h['load_before']} before / {h['load_max']} max, other processes "
                      f"{h['others_cores']} cores, steal {h['steal']}" for h in load["hosts"])
    head = (f"tuned {load.get('when', '?')} under load (timings may describe the machine; the "
            "table only switches where confident and verified): " + "; ".join(load["warnings"])
            if load.get("warnings") else f"tuned {load.get('when', '?')} on a quiet machine")
    return f"{head} [{hosts}; round spread {load.get('round_spread')}]"


def _conditions_now(bs) -> str:
    """This host now: this job's ranks here against cores, the load average."""
    cores = os.cpu_count() or 1
    try:
        la = os.getloadavg()[0]
    except OSError:
        la = None
    note = ("; more ranks than cores: timings taken now mean little" if bs.local_size > cores
            else "; busy: timings taken now describe the load"
            if la is not None and la > max(cores - bs.local_size, 0) + _sweep.LOAD_MARGIN
            else "")
    return (f"this host now: {bs.local_size} rank(s) of this job on {cores} cores, load average "
            f"{'?' if la is None else f'{la:.2f}'}{note}")


def _device_count() -> int:
    return device_count()


TUNE_HELP = """\
Measure every op on every backend and write the tuning table (run under mpiexec).

How the table is decided: each (op, size) is measured in paired rounds (all backends
back to back per round). A backend replaces the current choice (the policy's, or the
neighbouring range's) only with evidence: its median paired ratio beats --margin AND it
wins in enough rounds for a one-sided sign test at 1%; undecided points are measured
again (twice at most), then keep the current choice. The ranges of an op are one
optimisation over all sizes (total time plus --switch-cost per crossover), so one-size
flips survive only if large and confident.

How it is verified: auto through the new table is measured against each backend at
both sides of every range boundary and inside each range; ranges that lose go back to
the policy and are verified again. One line per op and the total of auto against the
best single backend are printed and stored in the table (per entry: figures, time,
verdicts). A table whose verification lost a range is not used there (policy instead).

Load: ranks beyond cores, a high load average, other processes' CPU use or CPU steal
during the run, and rounds that disagree are reported, stored in the table's machine
block and shown by `mcrdl info`.

Re-tune some sizes of some ops into the same file (e.g. after the comm logger's
"table stale" report):  mpiexec -n 2 mcrdl tune --ops all_reduce --sizes 64K 128K
(with --sizes, the other sizes of those entries are kept). Details: docs/tuning.md.
"""


def cmd_fuzz(args) -> int:
    """``mcrdl fuzz ...``: tests/fuzz/driver.py of the checkout this package runs from
    (the fuzzer checks the installed code with the test suite's programs; it is not
    shipped in a wheel)."""
    import importlib.util
    from pathlib import Path
    driver = Path(__file__).resolve().parents[2] / "tests" / "fuzz" / "driver.py"
    if not driver.exists():
        print(f"mcrdl fuzz: {driver} not found; the fuzzer runs from a checkout of MCR-DL "
              "(pip install -e .)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("mcrdl_fuzz_driver", driver)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mcrdl", description="MCR-DL command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ops = list(_tuning.TUNED_OPS)
    for name, fn, hi in (("tune", cmd_tune, "64M"), ("bench", cmd_bench, "1M")):
        p = sub.add_parser(name, help=f"{name} every op on every backend (run under mpiexec)")
        p.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest size (4)")
        p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes(hi),
                       help=f"largest size, powers of two in between ({hi})")
        p.add_argument("--sizes", nargs="+", type=parse_bytes, metavar="SIZE",
                       help="exactly these sizes (e.g. --sizes 64K 16M), instead of the "
                            "powers of two from --min-bytes to --max-bytes")
        p.add_argument("--ops", nargs="+", default=ops, choices=ops)
        p.add_argument("--backends", nargs="+", help="default: every available backend")
        p.add_argument("--trials-scale", type=float, default=1.0,
                       help="multiply the number of trials per point")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="buffers in host memory or on the GPU (CuPy arrays; nccl is "
                            "measured too when it can run)")
        if name == "tune":
            p.description = TUNE_HELP
            p.formatter_class = argparse.RawDescriptionHelpFormatter
            p.add_argument("--output", "-o", help="table path (default: MCRDL_TUNING_TABLE or "
                                                  "~/.cache/mcrdl/tuning.json)")
            p.add_argument("--verify", action="store_true",
                           help="only verify the table at --output for this job's ranks, hosts "
                                "and device (auto against each backend at range boundaries "
                                "and inside ranges); prints the verdicts, rewrites nothing; "
                                "exit status 1 if a range loses")
            p.add_argument("--margin", type=float, default=_tuning.MARGIN,
                           help="relative gain a backend needs to replace the current choice "
                                f"(median paired ratio <= 1 - MARGIN; {_tuning.MARGIN})")
            p.add_argument("--switch-cost", type=float, default=_tuning.SWITCH_COST,
                           help="price of one range boundary, in units of one size's time "
                                f"({_tuning.SWITCH_COST}): fewer crossovers when larger")
            p.add_argument("--no-repair", action="store_true",
                           help="verify, but do not give ranges that lose back to the policy "
                                "(readers then skip them, with a warning)")
            p.add_argument("--no-hier", action="store_true",
                           help="do not measure the two-level all_reduce and all_to_all "
                                "(measured by default as a lossless candidate, column "
                                "'hier', where the job's ranks share hosts: several hosts "
                                "with the same number, at least 2, of ranks on each)")
            p.add_argument("--compression", metavar="CODECS",
                           help="also measure these lossy codecs (e.g. fp16,int8): their ring "
                                "(and a2a for reduce_scatter) over each backend for all_gather, "
                                "reduce_scatter and all_reduce; the table records where they "
                                "win, used only by calls that allow the codec "
                                "(compression='auto:...' or 'table'). Default: none")
        else:
            p.add_argument("--out", default="mcrdl-bench", help="folder for CSV/JSON/PNG")
            p.add_argument("--control", nargs="?", const="", default=None, metavar="BACKEND",
                           help="add an A/A column BACKEND@2: that backend measured a second "
                                "time, in every position of the rounds like the others "
                                "(default: the policy's, mpi for host buffers)")
        p.set_defaults(fn=fn)
    p = sub.add_parser("info", help="backends, bootstrap and the tuning table in force")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("fuzz", add_help=False,
                       help="the differential fuzzer (tests/fuzz/ of a checkout): random mixed "
                            "programs checked against NumPy on every rank; launches mpiexec "
                            "itself (mcrdl fuzz --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_fuzz)
    # (listed for --help: main() hands both to tools/trace.py, which has its own options)
    sub.add_parser("trace", add_help=False,
                   help="read every rank's flight-recorder dump in DIR and say what went "
                        "wrong first (mcrdl trace --help; docs/reliability.md)")
    sub.add_parser("explain", add_help=False,
                   help="which backend, algorithm and codec a call would get here, and the "
                        "rule that chose them (mcrdl explain --help)")
    add_cluster_parser(sub)
    return ap


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["trace"], ["explain"]):  # the flight recorder's reader (tools/trace.py)
        return _trace.main(argv)
    if argv[:1] == ["fuzz"]:  # its own options (the driver's parser), passed on whole
        return cmd_fuzz(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    if args.cmd == "cluster":  # its errors are the user's to act on: a message, no traceback
        try:
            return args.fn(args)
        except McrdlError as exc:
            print(f"mcrdl cluster: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("mcrdl cluster: interrupted", file=sys.stderr)
            return 130
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
