"""Building, merging, locating and printing tuning tables (the format: selection.py).

``build_entries`` turns measured medians into ranges: for each size the fastest backend
wins; neighbouring sizes with the same winner merge into one range; a range ends at its
last measured size (a message between two measured sizes takes the larger one's
winner) and the last range is open (``null``): beyond the sweep the large-message
winner is the best guess. Re-tuning a key (op, ranks, hosts, device, dtype class)
replaces its entry and keeps the rest, so runs at several world sizes and on several
host counts (an emulated cluster is the same machine) share one file.

A table records the machine it was measured on (``fingerprint()``, defined with the
table's reader in selection.py); the runtime refuses, with a warning naming the file,
a table from another machine.
"""
from __future__ import annotations

import json
import os
import time

from .selection import (SCHEMA, TuningTable, default_path, fingerprint,  # noqa: F401
                        machine_differences)

#: every tuned op. p2p is measured as a ping-pong and written as "send" and "recv",
#: so both sides of a transfer pick the same backend.
TUNED_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
             "all_to_all", "gather", "scatter", "send_recv", "barrier")


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
    """{(op, world_size, hosts, device, dtype_class): {size: {backend: seconds}}} ->
    entries."""
    entries = []
    for (op, world, hosts, device, dclass), medians in sorted(results.items()):
        ranges = merge_ranges(winners(medians))
        names = ("send", "recv") if op == "send_recv" else (op,)
        for name in names:
            entries.append({"op": name, "world_size": world, "hosts": hosts, "device": device,
                            "dtype_class": dclass, "ranges": [list(r) for r in ranges]})
    return entries


def _key(e: dict) -> tuple:
    return (e["op"], e["world_size"], e.get("hosts", 1), e["device"], e["dtype_class"])


def merge_table(existing: dict | None, entries: list[dict], machine: dict) -> dict:
    """A new (schema 2) table dict: ``existing`` (if from this machine; a schema 1
    table's entries become one-host entries) with ``entries`` replacing those of the
    same key."""
    kept = []
    if existing and not machine_differences(existing.get("machine", {}), machine):
        fresh = {_key(e) for e in entries}
        kept = [dict(e, hosts=_key(e)[2]) for e in existing.get("entries", [])
                if _key(e) not in fresh]
        hosts = set(existing.get("machine", {}).get("hosts", ())) | set(machine.get("hosts", ()))
        if hosts:  # a table shared by several jobs' hosts keeps accepting all of them
            machine = dict(machine, hosts=sorted(hosts | {machine["host"]}))
    table = {"schema": SCHEMA, "machine": machine,
             "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "entries": sorted(kept + entries, key=_key)}
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


def crossover_lines(table: TuningTable, world_size: int | None = None,
                    hosts: int | None = None) -> list[str]:
    """The MCR-DL paper's "message size -> backend" view of a table, one line per key
    (only ``world_size`` ranks on ``hosts`` hosts when given)."""
    lines = []
    for e in table.data["entries"]:
        e_hosts = e.get("hosts", 1)
        if (world_size is not None and e["world_size"] != world_size) or \
                (hosts is not None and e_hosts != hosts):
            continue
        parts, lo = [], 0
        for hi, backend in e["ranges"]:
            parts.append(f"{_fmt(lo)}–{_fmt(hi)} -> {backend}")
            lo = (hi or 0) + 1
        lines.append(f"{e['op']:15s} n={e['world_size']} hosts={e_hosts} {e['device']} "
                     f"{e['dtype_class']:5s}: "
                     + ", ".join(parts))
    return lines
