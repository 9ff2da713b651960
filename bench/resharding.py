"""Cross-mesh resharding benchmark: link calibration, then the issue's cases, every
method side by side (broadcast, send/recv, send/recv + all-gather, and the balancing /
ordering variants), plus the planner's speed on 64x64 meshes.

Run on the emulated cluster (hosts come from the ranks' host names):
    mcrdl cluster run --hosts 5 --ranks-per-host 2 --rate 1gbit -- \
        .venv/bin/python bench/resharding.py --sizes 1M,64M,256M
or on one machine, telling the planner how ranks map to (pretend) hosts:
    mpiexec -n 6 .venv/bin/python bench/resharding.py --ranks-per-host 2 --sizes 1M,16M

Ranks are block-placed: host h holds ranks h*K .. h*K+K-1 (K ranks per host). A case
runs only where the topology has room for it and says so otherwise. Each case's global
tensor is float32 (rows x 1024); every method's result is first checked against the
NumPy values on every rank. Timing: bench/timing.py's interleaved batches (a Williams
order of the variants in every round, a barrier before each, the slowest rank's time);
each call ends with a barrier that sleeps while it waits, so that ranks done early do
not spin on the cores the others need;
each figure is the median (and p90) over the rounds. The plan's predicted time and lower
bound use the calibrated link model. Rank 0 prints the table with the issue's goals and
writes CSV, JSON and a PNG into --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import COMM, interleaved_batches  # noqa: E402

import mcrdl_core as mc  # noqa: E402
from mcrdl_core.reshard import Layout, LinkModel, Mesh  # noqa: E402
from mcrdl_core.reshard.planner import make_plan  # noqa: E402

COLS = 1024
SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(t[:-1]) * SUFFIX[t[-1]]) if t[-1:] in SUFFIX else int(t)


# --- topology ------------------------------------------------------------------------------
def topology(ranks_per_host: int | None):
    """(hosts for the planner, number of hosts, ranks per host)."""
    if ranks_per_host:
        k = ranks_per_host
        return k, SIZE // k, k
    names = COMM.allgather(socket.gethostname())
    k = names.count(names[0])
    if any(names[i] != names[(i // k) * k] for i in range(SIZE)):
        raise SystemExit("ranks are not block-placed on hosts; pass --ranks-per-host")
    return names, len(set(names)), k


# --- calibration ---------------------------------------------------------------------------
def _pair_time(pairs, nbytes, reps=3, stat=np.median):
    """Seconds (median, or ``stat``, over ``reps``; the slowest rank each time) for the
    sends of ``pairs`` [(src, dst)] issued together."""
    from mpi4py import MPI

    buf = np.ones(nbytes, np.uint8)
    out = np.empty(nbytes, np.uint8)
    ts = np.empty(reps)
    for i in range(reps):
        COMM.Barrier()
        t0 = time.perf_counter()
        reqs = [COMM.Isend(buf, d, 7) for s, d in pairs if s == RANK]
        reqs += [COMM.Irecv(out, s, 7) for s, d in pairs if d == RANK]
        MPI.Request.Waitall(reqs)
        ts[i] = time.perf_counter() - t0
        quiet_barrier()  # ranks in no pair sleep instead of spinning on the shared cores
    worst = np.empty_like(ts)
    COMM.Allreduce(ts, worst, op=MPI.MAX)
    return float(stat(worst))


def calibrate(nhosts: int, k: int, nbytes: int) -> tuple[LinkModel, dict]:
    """One send between hosts; two concurrent sends out of one host; two disjoint pairs;
    every host sending to the next at once (a ring: the aggregate of all links); one
    send inside a host; an 8-byte send for the latency."""
    res = {}
    if nhosts < 2:
        return LinkModel(), {"note": "one host: no link to calibrate"}
    h = lambda i, j=0: i * k + j  # noqa: E731
    res["latency_s"] = _pair_time([(h(0), h(1))], 8, 20, np.min)  # noise only adds
    t1 = _pair_time([(h(0), h(1))], nbytes)
    res["one_send_Bps"] = nbytes / t1
    if nhosts >= 3:
        src2 = h(0, 1) if k > 1 else h(0)
        t2 = _pair_time([(h(0), h(1)), (src2, h(2))], nbytes)
        res["two_from_one_host_Bps_each"] = nbytes / t2
    if nhosts >= 4:
        t3 = _pair_time([(h(0), h(1)), (h(2), h(3))], nbytes)
        res["two_disjoint_pairs_Bps_each"] = nbytes / t3
    agg = 0.0
    if nhosts >= 3:  # every host sends to the next at once: what all links carry together
        t4 = _pair_time([(h(i), h((i + 1) % nhosts)) for i in range(nhosts)], nbytes)
        res["ring_Bps_each"] = nbytes / t4
        agg = res["ring_Bps_total"] = nhosts * nbytes / t4
    intra = 4e9
    if k > 1:
        ti = _pair_time([(h(0), h(0, 1))], nbytes)
        intra = res["intra_host_Bps"] = nbytes / ti
    return LinkModel(res["one_send_Bps"], res["latency_s"], intra, agg), res


# --- cases ---------------------------------------------------------------------------------
def cases(nhosts: int, k: int):
    """[(name, goal text, src, dst, rows per MiB factor, variants, comparisons)] that fit."""
    h = lambda i, j=0: i * k + j  # noqa: E731
    out, skipped = [], []

    def add(name, need, goal, src, dst, variants, compare):
        if need:
            out.append((name, goal, src(), dst(), variants, compare))
        else:
            skipped.append(name)

    B, S, SA = "broadcast", "send_recv", "send_recv_allgather"
    three = [B, S, SA]
    rep = lambda ranks: Layout(Mesh(ranks), [])  # noqa: E731
    m = min(nhosts - 1, 4)
    add("1 rank -> %d hosts x 1, replicated" % m, nhosts >= 2, ">= 3.3x (must 3x) at 4 hosts",
        lambda: rep([h(0)]), lambda: rep([h(i) for i in range(1, m + 1)]), three,
        [(B, S)])
    add("1 rank -> 2 hosts x 2, replicated", nhosts >= 3 and k >= 2,
        ">= 3.3x; >= 1.7x vs send/recv+all-gather",
        lambda: rep([h(0)]), lambda: rep([[h(1), h(1, 1)], [h(2), h(2, 1)]]), three,
        [(B, S), (B, SA)])
    add("1 rank -> 4 hosts x 4, replicated", nhosts >= 5 and k >= 4,
        ">= 10x; >= 3x vs send/recv+all-gather",
        lambda: rep([h(0)]), lambda: rep([[h(i, j) for j in range(4)] for i in range(1, 5)]),
        three, [(B, S), (B, SA)])
    # 1x4 rows on the first four ranks -> 2x2 columns (replicated over x) on the next four
    add("1D -> 2D, (1x4) rows -> (2x2) columns", SIZE >= 8 or (nhosts >= 4 and k == 1 and
                                                              SIZE >= 8), ">= 1.8x",
        lambda: Layout(Mesh([list(range(4))], ("x", "y")), ["y", None]),
        lambda: Layout(Mesh(np.arange(4, 8).reshape(2, 2), ("x", "y")), [None, "y"]),
        three + [B + "/waited"], [(B, S), (B, B + "/waited")])
    add("replicated on 2 hosts -> sharded on 2x2", nhosts >= 4 and k >= 2 or nhosts >= 6,
        "balanced >= 1.8x unbalanced (must 1.5x)",
        lambda: rep([h(0), h(1)]),
        lambda: Layout(Mesh([[h(2), h(2, 1)], [h(3), h(3, 1)]] if k > 1 else
                            [[h(2), h(3)], [h(4), h(5)]], ("x", "y")), ["x", "y"]),
        [B, B + "/first"], [(B, B + "/first")])
    add("halves on 2 hosts -> thirds on 3 hosts", nhosts >= 5, "rounds >= 1.7x naive order",
        lambda: Layout(Mesh([h(0), h(1)], ("r",)), ["r"]),
        lambda: Layout(Mesh([h(2), h(3), h(4)], ("r",)), ["r"]),
        [B, B + "/naive", B + "/waited"], [(B, B + "/naive"), (B, B + "/waited")])
    p = min(nhosts, 4) if nhosts >= 2 else min(SIZE, 4)
    add(f"row -> column on {p} ranks (an all-to-all)", p >= 2, "0.9-1.1x, never a regression",
        lambda: Layout(Mesh([h(i) if nhosts >= 2 else i for i in range(p)], ("r",)), ["r"]),
        lambda: Layout(Mesh([h(i) if nhosts >= 2 else i for i in range(p)], ("r",)),
                       [None, "r"]),
        three + [B + "/waited"], [(B, S), (B, B + "/waited")])
    add("overlapping meshes (rows 4-way -> rows 2-way x 2)", SIZE >= 4,
        "zero bytes on the links for data in place",
        lambda: Layout(Mesh(list(range(4)), ("r",)), ["r"]),
        lambda: Layout(Mesh(np.arange(4).reshape(2, 2), ("x", "y")), ["x"]),
        three, [(B, S)])
    return out, skipped


VARIANT = {"broadcast": {}, "send_recv": {"method": "send_recv"},
           "send_recv_allgather": {"method": "send_recv_allgather"},
           "broadcast/first": {"balance": "first"}, "broadcast/naive": {"order": "naive"},
           "broadcast/waited": {"overlap": False}}
PLAN_KEYS = ("method", "balance", "order")


def values(box):
    (r0, r1), (c0, c1) = box
    return ((np.arange(r0, r1, dtype=np.int64)[:, None] * COLS
             + np.arange(c0, c1, dtype=np.int64)[None, :]) % 251).astype(np.float32)


def quiet_barrier(nap: float = 1e-4) -> None:
    """A barrier that sleeps while it waits. Ranks done early (outside the meshes, or a
    sender whose last send left) would otherwise spin in MPI's blocking barrier and take
    the CPU from the ranks still moving data (the cluster's hosts share this machine's
    cores)."""
    req = COMM.Ibarrier()
    while not req.Test():
        time.sleep(nap)


def run_case(name, src, dst, variants, nbytes, hosts, link, backend, rounds):
    shape = (max(nbytes // (4 * COLS), 1), COLS)
    sbox, dbox = src.tile(shape, RANK), dst.tile(shape, RANK)
    local = values(sbox) if sbox is not None else None
    kw = dict(hosts=hosts, link=link, backend=backend, dtype=np.float32)
    plans, fns = {}, []
    for v in variants:
        opts = VARIANT[v]
        plans[v] = mc.plan_reshard(shape, np.float32, src, dst, hosts=hosts, link=link,
                                   **{"method": "broadcast",
                                      **{k: x for k, x in opts.items() if k in PLAN_KEYS}})
        y = mc.reshard(local, src, dst, shape, **kw, **opts)  # warm-up and check
        ok = y is None if dbox is None else np.array_equal(y, values(dbox))
        bad = [r for r, good in enumerate(COMM.allgather(ok)) if not good]
        if bad:
            raise SystemExit(f"{name} / {v}: wrong result on ranks {bad}")
        fns.append(lambda opts=opts: (mc.reshard(local, src, dst, shape, **kw, **opts),
                                      quiet_barrier()))
    t = interleaved_batches(fns, [1] * len(fns), rounds)
    rows = []
    for i, v in enumerate(variants):
        p = plans[v]
        rows.append({"case": name, "bytes": shape[0] * COLS * 4, "variant": v,
                     "median_s": float(np.median(t[i])), "p90_s": float(np.percentile(t[i], 90)),
                     "predicted_s": p.predicted_waited_s if v.endswith("/waited") else p.predicted_s,
                     "lower_bound_s": p.lower_bound_s,
                     "transfers": len(p.transfers), "rounds": p.rounds,
                     "link_bytes": int(sum(o for o, _ in p.host_bytes.values())),
                     "local_copies": len(p.local)})
    return rows


# --- planning speed ------------------------------------------------------------------------
def planning_speed(reps: int = 7) -> list:
    """make_plan on 64x64 -> 64x64 meshes (4096 ranks each, hosts of 8 ranks): wall and
    CPU milliseconds per plan, median and min over ``reps``. Each plan is kept until the
    case ends, so no timing includes freeing the previous one (about 6 ms at 10^4
    transfers)."""
    a = Mesh(np.arange(4096).reshape(64, 64), ("x", "y"))
    b = Mesh(np.arange(4096, 8192).reshape(64, 64), ("x", "y"))
    tests = [("64x64 (x,y) -> 64x64 (y,x)", (6400, 6400), Layout(a, ["x", "y"]),
              Layout(b, ["y", "x"])),
             ("64x64 rows replicated 64x -> 64x64 tiles", (6400, 6400), Layout(a, ["x"]),
              Layout(b, ["y", "x"])),
             ("64x64 JAX flat -> DTensor nested, uneven", (44955, 8),
              Layout(a, [("x", "y")]), Layout(b, [("x", "y")], "nested")),
             ("64x64 tiles -> rows over (x,y)", (160, 6400), Layout(a, ["x", "y"]),
              Layout(b, [("x", "y")]))]
    out = []
    for name, shape, s, d in tests:
        ts, cpu, keep = [], [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            keep.append(make_plan(shape, "float32", s, d, hosts=8))
            ts.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        p = keep[-1]
        out.append({"case": name, "units": len(p.transfers) + len(p.local),
                    "transfers": len(p.transfers), "rounds": p.rounds,
                    "median_ms": 1e3 * float(np.median(ts)), "min_ms": 1e3 * min(ts),
                    "cpu_median_ms": 1e3 * float(np.median(cpu))})
        del keep
    return out


def print_planning(planning: list) -> None:
    print(f"planning speed (make_plan, hosts of 8 ranks; load average "
          f"{os.getloadavg()[0]:.1f}; goal: 10^4 units < 50 ms):")
    for p in planning:
        print(f"  {p['case']:42} {p['units']:6d} units {p['rounds']:4d} rounds  median "
              f"{p['median_ms']:5.1f} ms (min {p['min_ms']:.1f}, CPU {p['cpu_median_ms']:.1f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,64M", help="global tensor sizes, e.g. 1M,64M,256M")
    ap.add_argument("--ranks-per-host", type=int, default=None,
                    help="pretend hosts of K ranks each (one machine); default: host names")
    ap.add_argument("--backend", default="mpi")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per case and size")
    ap.add_argument("--calibrate-bytes", default="64M")
    ap.add_argument("--cases", default="", help="substring filter on case names")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    ap.add_argument("--plan-only", action="store_true",
                    help="only time the planner on 64x64 meshes (no communication)")
    args = ap.parse_args(argv)
    if args.plan_only:
        if RANK == 0:
            print_planning(planning_speed())
        return
    hosts, nhosts, k = topology(args.ranks_per_host)
    link, calib = calibrate(nhosts, k, parse_bytes(args.calibrate_bytes))
    todo, skipped = cases(nhosts, k)
    todo = [c for c in todo if args.cases in c[0]]
    rows = []
    for name, goal, src, dst, variants, compare in todo:
        for size in [parse_bytes(s) for s in args.sizes.split(",")]:
            rows += run_case(name, src, dst, variants, size, hosts, link, args.backend,
                             args.rounds)
    planning = planning_speed() if RANK == 0 else None
    idle = COMM.Ibarrier()  # the other ranks sleep meanwhile instead of spinning in MPI
    while not idle.Test():
        time.sleep(0.01)
    if RANK == 0:
        report(rows, todo, skipped, calib, link, planning, nhosts, k, args)


def report(rows, todo, skipped, calib, link, planning, nhosts, k, args):
    print(f"# resharding: {SIZE} ranks, {nhosts} hosts x {k} ranks, backend {args.backend}")
    print("link calibration:", json.dumps(calib))
    print(f"link model: {link.bandwidth / 1e6:.1f} MB/s, latency {link.latency * 1e6:.1f} us, "
          f"intra-host {link.intra_bandwidth / 1e9:.2f} GB/s, all links together "
          f"{link.aggregate_bandwidth / 1e6:.0f} MB/s")
    hdr = (f"{'case':44} {'MiB':>6} {'variant':22} {'median ms':>10} {'p90 ms':>9} "
           f"{'pred ms':>9} {'LB ms':>8} {'link MiB':>9}")
    print(hdr)
    for r in rows:
        print(f"{r['case'][:44]:44} {r['bytes'] / 2**20:6.0f} {r['variant']:22} "
              f"{r['median_s'] * 1e3:10.2f} {r['p90_s'] * 1e3:9.2f} {r['predicted_s'] * 1e3:9.2f} "
              f"{r['lower_bound_s'] * 1e3:8.2f} {r['link_bytes'] / 2**20:9.1f}")
    print("\nratios (slower variant's median / faster's), goal from the issue:")
    by = {(r["case"], r["bytes"], r["variant"]): r for r in rows}
    ratios = []
    for name, goal, _, _, _, compare in todo:
        for a, b in compare:
            for size in sorted({r["bytes"] for r in rows if r["case"] == name}):
                ra, rb = by[(name, size, a)], by[(name, size, b)]
                x = rb["median_s"] / ra["median_s"]
                ratios.append({"case": name, "bytes": size, "pair": f"{b} / {a}", "ratio": x,
                               "goal": goal})
                print(f"  {name[:44]:44} {size / 2**20:6.0f} MiB  {b} / {a}: {x:5.2f}x   "
                      f"(goal {goal})")
    for r in rows:
        if r["variant"] == "broadcast" and r["median_s"] > 0:
            r["predicted_over_measured"] = r["predicted_s"] / r["median_s"]
    if skipped:
        print("not run (the topology has no room for them):", "; ".join(skipped))
    print()
    print_planning(planning)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "resharding")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + ["predicted_over_measured"])
        w.writeheader()
        w.writerows(rows)
    with open(base + ".json", "w") as f:
        json.dump({"ranks": SIZE, "hosts": nhosts, "ranks_per_host": k,
                   "backend": args.backend, "calibration": calib, "link": link.to_dict(),
                   "rows": rows, "ratios": ratios, "planning": planning}, f, indent=1)
    with open(base + "_link.json", "w") as f:
        json.dump(link.to_dict(), f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        size = max(r["bytes"] for r in rows)
        sel = [r for r in rows if r["bytes"] == size]
        names = list(dict.fromkeys(r["case"] for r in sel))
        variants = list(dict.fromkeys(r["variant"] for r in sel))
        fig, ax = plt.subplots(figsize=(11, 4.5))
        w = 0.8 / len(variants)
        for j, v in enumerate(variants):
            xs = [i + j * w for i, n in enumerate(names) for r in sel
                  if r["case"] == n and r["variant"] == v]
            ys = [r["median_s"] * 1e3 for n in names for r in sel
                  if r["case"] == n and r["variant"] == v]
            ax.bar(xs, ys, w, label=v)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))])
        ax.set_xticklabels([n[:28] for n in names], rotation=20, ha="right", fontsize=7)
        ax.set_ylabel(f"median ms (slowest rank), {size / 2**20:.0f} MiB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"\nwrote {base}.csv, .json, .png, {base}_link.json")


if __name__ == "__main__":
    main()
