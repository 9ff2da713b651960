"""The comm logger: per call op, bytes, backend, group size, latency, algbw and busbw.

Off by default (``MCRDL_COMM_LOG=1`` or ``logger().enable()`` turns it on); when off, a
call pays one attribute test. Latency is from issue to completion as seen by this
rank (for async calls: until the progress loop saw the work complete).

Bandwidth follows nccl-tests: algbw = S / t with S the full buffer (for all-gather and
reduce-scatter the per-rank count times ranks; for all-to-all the per-rank input),
busbw = algbw x factor: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all
(n-1)/n; broadcast, reduce, send/recv, gather, scatter 1.

The stale-table report (``stale()``, printed by ``summary()`` under the table): with a
tuning table in force, each (op, size, backend) logged is compared with the latency the
table's verification measured for that backend in that size range (mcrdl tune; see
selection.py's ``verified_figure``). An entry is flagged when it is *persistently* off:
at least ``STALE_MIN_CALLS`` calls, and at least ``STALE_SHARE`` of them more than
``STALE_FACTOR`` times slower (or faster) than the verified figure, so that a few
stalls or a warm-up do not flag it. Flags say "table stale: re-run mcrdl tune" with the
command that re-tunes just those sizes; nothing switches inside the job (every rank
must choose alike). ``mcrdl_core.tools.stragglers.stale_ranks`` gathers the flags of every
rank, to say on which ranks an entry is off.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

from ..base import config as _config

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


#: the stale-table report: a call is "off" when its latency is more than STALE_FACTOR
#: times the verified figure (or less than 1/STALE_FACTOR of it); an entry is flagged
#: when at least STALE_SHARE of its calls, and STALE_MIN_CALLS or more, are off alike
STALE_FACTOR = 2.0
STALE_SHARE = 0.75
STALE_MIN_CALLS = 20

#: ops whose logged size S is the per-rank payload times the ranks (nccl-tests S)
_TIMES_RANKS = ("all_gather", "reduce_scatter", "gather", "scatter")


def selection_bytes(op: str, nbytes: int, nranks: int) -> int:
    """The tuning table's size (bytes per rank) of a call logged with size ``nbytes``."""
    return nbytes // max(nranks, 1) if op in _TIMES_RANKS else nbytes


def _runtime_view():
    """(table, hosts_of) of the process's runtime, without importing it (the runtime
    imports this module): None, None when no runtime is up. ``hosts_of(n)``: the
    hosts of a group of n ranks (the world's; else those of the first n ranks)."""
    mod = sys.modules.get("mcrdl_core.dispatch.runtime")
    if mod is None or not mod.is_initialized():
        return None, None
    rt = mod.get_runtime()
    bs = rt.bootstrap

    def hosts_of(n):
        return len(bs.hosts) if n == rt.world_size else bs.hosts_in(range(n))
    return rt.table, hosts_of


class CommLogger:
    def __init__(self):
        self.enabled = _config.get("MCRDL_COMM_LOG")
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

    def stale(self, table=None, hosts_of=None, factor: float = STALE_FACTOR,
              share: float = STALE_SHARE, min_calls: int = STALE_MIN_CALLS) -> list[dict]:
        """The entries of ``table`` (default: the runtime's table in force) that the
        logged calls find persistently off their verified figure (module docstring).
        One row per (op, bytes, backend, ranks) flagged: ``bytes`` per rank (the table's
        size), ``calls``, ``median_s``, ``verified_s``, ``ratio`` (median / verified),
        ``slower`` (True: slower than verified), ``range`` ((lo, hi or None) bytes) and
        ``retune`` (the mcrdl tune command for it). ``hosts_of(n)``: hosts of a group of
        n ranks (default: the runtime's topology; 1 without a runtime)."""
        if table is None:
            table, rt_hosts = _runtime_view()
            hosts_of = hosts_of or rt_hosts
        if table is None:
            return []
        hosts_of = hosts_of or (lambda n: 1)
        groups = defaultdict(list)
        for op, nbytes, backend, n, s in self.records:
            groups[(op, nbytes, backend, n)].append(s)
        out = []
        for (op, nbytes, backend, n), ts in sorted(groups.items()):
            if len(ts) < min_calls:
                continue
            size = selection_bytes(op, nbytes, n)
            found = None
            for device in (("cuda", "cpu") if backend == "nccl" else ("cpu", "cuda")):
                found = table.verified_figure(op, n, device, "float", size, backend, hosts_of(n))
                if found:
                    break
            if not found or found[0] <= 0:
                continue
            ref, rng = found
            arr = sorted(ts)
            slow = sum(t > factor * ref for t in arr) / len(arr)
            fast = sum(t * factor < ref for t in arr) / len(arr)
            if max(slow, fast) < share:
                continue
            med = statistics.median(arr)
            sizes = " ".join(str(b) for b in dict.fromkeys(x for x in (size, rng[1]) if x))
            tuned = "send_recv" if op in ("send", "recv") else op
            out.append({"op": op, "bytes": size, "backend": backend, "ranks": n,
                        "calls": len(arr), "median_s": med, "verified_s": ref,
                        "ratio": med / ref, "slower": slow >= share, "range": rng,
                        "retune": f"mpiexec -n {n} mcrdl tune --ops {tuned} --sizes {sizes}"})
        return out

    @staticmethod
    def stale_lines(rows: list[dict]) -> list[str]:
        """The report's lines for ``stale()``'s rows (none when nothing is flagged)."""
        if not rows:
            return []
        lines = [f"table stale: re-run mcrdl tune for these {len(rows)} entr"
                 f"{'y' if len(rows) == 1 else 'ies'} (persistently more than "
                 f"{STALE_FACTOR:g}x off the table's verified latency):"]
        for r in rows:
            lo, hi = r["range"]
            lines.append(f"  {r['op']} {r['bytes']} B on {r['backend']} ({r['ranks']} ranks; "
                         f"range {lo}-{'inf' if hi is None else hi} B): median "
                         f"{r['median_s'] * 1e6:.1f} us over {r['calls']} calls vs verified "
                         f"{r['verified_s'] * 1e6:.1f} us ({r['ratio']:.2f}x, "
                         f"{'slower' if r['slower'] else 'faster'}); re-tune: {r['retune']}")
        return lines

    def to_dict(self) -> dict:
        return {"calls": len(self.records), "summary": self.rows()}

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def summary(self, print_fn=print, table=None) -> str:
        """The per-(op, bytes, backend, ranks) table, then the stale-table report
        against ``table`` (default: the runtime's table in force), if anything is
        flagged."""
        lines = [f"{'op':16s} {'bytes':>10s} {'backend':8s} {'ranks':>5s} {'calls':>6s} "
                 f"{'median us':>10s} {'algbw GB/s':>10s} {'busbw GB/s':>10s}"]
        for r in self.rows():
            lines.append(f"{r['op']:16s} {r['bytes']:10d} {r['backend']:8s} {r['ranks']:5d} "
                         f"{r['calls']:6d} {r['median_s'] * 1e6:10.2f} "
                         f"{r['algbw_Bps'] / 1e9:10.3f} {r['busbw_Bps'] / 1e9:10.3f}")
        lines += self.stale_lines(self.stale(table))
        text = "\n".join(lines)
        if print_fn:
            print_fn(text)
        return text


_LOGGER = CommLogger()


def logger() -> CommLogger:
    return _LOGGER
