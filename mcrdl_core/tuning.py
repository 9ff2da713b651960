"""Building, merging, locating and printing tuning tables (the format: selection.py).

``build_entries`` turns measured medians into ranges: for each size the fastest backend
wins; neighbouring sizes with the same winner merge into one range; a range ends at its
last measured size (a message between two measured sizes takes the larger one's
winner) and the last range is open (``null``): beyond the sweep the large-message
winner is the best guess. Re-tuning a key (op, world size, device, dtype class)
replaces its entry and keeps the rest, so runs at several world sizes share one file.

A table records the machine it was measured on (``fingerprint()``); the runtime
refuses, with a warning naming the file, a table from another machine.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import time
from importlib import metadata

from .selection import SCHEMA, TuningTable

#: every tuned op. p2p is measured as a ping-pong and written as "send" and "recv",
#: so both sides of a transfer pick the same backend.
TUNED_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
             "all_to_all", "gather", "scatter", "send_recv", "barrier")


def default_path() -> str:
    """$MCRDL_TUNING_TABLE, else $XDG_CACHE_HOME/mcrdl/tuning.json (~/.cache/...)."""
    if os.environ.get("MCRDL_TUNING_TABLE"):
        return os.environ["MCRDL_TUNING_TABLE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mcrdl", "tuning.json")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def fingerprint() -> dict:
    """What makes a table valid: host, CPU model, core count, library versions."""
    return {"host": socket.gethostname(), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "mpich": _version("mpich"), "mpi4py": _version("mpi4py"), "torch": _version("torch")}


def machine_differences(a: dict, b: dict) -> list[str]:
    """Fields that differ (empty if the table fits this machine)."""
    return [k for k in ("host", "cpu", "cores", "mpich", "torch") if a.get(k) != b.get(k)]


def winners(medians: dict) -> list[tuple[int, str]]:
    """{size: {backend: seconds}} -> [(size, fastest backend)] sorted by size."""
    return [(size, min(by_backend, key=by_backend.get))
            for size, by_backend in sorted(medians.items())]


def merge_ranges(points: list[tuple[int, str]]) -> list[list]:
    """[(size, backend)] sorted by size -> [[max_bytes, backend], ..., [None, backend]]."""
    ranges: list[list] = []
    for size, backend in points:
        if ranges and ranges[-1][1] == backend:
            ranges[-1][0] = size
        else:
            ranges.append([size, backend])
    if ranges:
        ranges[-1][0] = None
    return ranges


def build_entries(results: dict) -> list[dict]:
    """{(op, world_size, device, dtype_class): {size: {backend: seconds}}} -> entries."""
    entries = []
    for (op, world, device, dclass), medians in sorted(results.items()):
        ranges = merge_ranges(winners(medians))
        names = ("send", "recv") if op == "send_recv" else (op,)
        for name in names:
            entries.append({"op": name, "world_size": world, "device": device,
                            "dtype_class": dclass, "ranges": [list(r) for r in ranges]})
    return entries


def merge_table(existing: dict | None, entries: list[dict], machine: dict) -> dict:
    """A new table dict: ``existing`` (if from this machine) with ``entries`` replacing
    those of the same key."""
    key = lambda e: (e["op"], e["world_size"], e["device"], e["dtype_class"])  # noqa: E731
    kept = []
    if existing and not machine_differences(existing.get("machine", {}), machine):
        fresh = {key(e) for e in entries}
        kept = [e for e in existing.get("entries", []) if key(e) not in fresh]
    table = {"schema": SCHEMA, "machine": machine,
             "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "entries": sorted(kept + entries, key=key)}
    TuningTable(table, "<new table>")  # validate before anything is written
    return table


def write_table(table: dict, path: str) -> None:
    """Write atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, path)


def _fmt(b) -> str:
    if b is None:
        return "inf"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def crossover_lines(table: TuningTable, world_size: int | None = None) -> list[str]:
    """The MCR-DL paper's "message size -> backend" view of a table, one line per key."""
    lines = []
    for e in table.data["entries"]:
        if world_size is not None and e["world_size"] != world_size:
            continue
        parts, lo = [], 0
        for hi, backend in e["ranges"]:
            parts.append(f"{_fmt(lo)}–{_fmt(hi)} -> {backend}")
            lo = (hi or 0) + 1
        lines.append(f"{e['op']:15s} n={e['world_size']} {e['device']} {e['dtype_class']:5s}: "
                     + ", ".join(parts))
    return lines
