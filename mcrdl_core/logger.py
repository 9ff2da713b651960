"""The comm logger: per call op, bytes, backend, group size, latency, algbw and busbw.

Off by default (``MCRDL_COMM_LOG=1`` or ``logger().enable()`` turns it on); when off, a
call pays one attribute test. Latency is from issue to completion as seen by this
rank (for async calls: until the progress loop saw the work complete).

Bandwidth follows nccl-tests: algbw = S / t with S the full buffer (for all-gather and
reduce-scatter the per-rank count times ranks; for all-to-all the per-rank input),
busbw = algbw x factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all
(n-1)/n; broadcast, reduce, send/recv, gather, scatter 1.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def bandwidths(op: str, nbytes: int, nranks: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second; ``nbytes`` is S of the nccl-tests formulas."""
    if seconds <= 0:
        return 0.0, 0.0
    alg = nbytes / seconds
    return alg, alg * BUS_FACTOR.get(op, lambda n: 1.0)(nranks)


class CommLogger:
    def __init__(self):
        self.enabled = os.environ.get("MCRDL_COMM_LOG", "").lower() in ("1", "true", "yes")
        self.records: list[tuple] = []  # (op, nbytes, backend, nranks, seconds)

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def clear(self) -> None:
        self.records = []

    def record(self, op: str, nbytes: int, backend: str, nranks: int, seconds: float) -> None:
        self.records.append((op, nbytes, backend, nranks, seconds))

    def start(self, op: str, nbytes: int, backend: str, nranks: int):
        """A callback that records the call when invoked at completion."""
        t0 = time.perf_counter()
        return lambda: self.record(op, nbytes, backend, nranks, time.perf_counter() - t0)

    # --- views --------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """One row per (op, bytes, backend, ranks): count, median/min/max latency (s),
        median algbw and busbw (bytes/s)."""
        groups = defaultdict(list)
        for op, nbytes, backend, n, s in self.records:
            groups[(op, nbytes, backend, n)].append(s)
        out = []
        for (op, nbytes, backend, n), ts in sorted(groups.items()):
            med = statistics.median(ts)
            alg, bus = bandwidths(op, nbytes, n, med)
            out.append({"op": op, "bytes": nbytes, "backend": backend, "ranks": n,
                        "calls": len(ts), "median_s": med, "min_s": min(ts), "max_s": max(ts),
                        "algbw_Bps": alg, "busbw_Bps": bus})
        return out

    def to_dict(self) -> dict:
        return {"calls": len(self.records), "summary": self.rows()}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def summary(self, print_fn=print) -> str:
        lines = [f"{'op':16s} {'bytes':>10s} {'backend':8s} {'ranks':>5s} {'calls':>6s} "
                 f"{'median us':>10s} {'algbw GB/s':>10s} {'busbw GB/s':>10s}"]
        for r in self.rows():
            lines.append(f"{r['op']:16s} {r['bytes']:10d} {r['backend']:8s} {r['ranks']:5d} "
                         f"{r['calls']:6d} {r['median_s'] * 1e6:10.2f} "
                         f"{r['algbw_Bps'] / 1e9:10.3f} {r['busbw_Bps'] / 1e9:10.3f}")
        text = "\n".join(lines)
        if print_fn:
            print_fn(text)
        return text


_LOGGER = CommLogger()


def logger() -> CommLogger:
    return _LOGGER
