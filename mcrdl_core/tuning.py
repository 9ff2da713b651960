"""Building, merging, locating and printing tuning tables (the format: selection.py).

``build_entries`` turns measured medians into ranges: for each size the fastest backend
wins; neighbouring sizes with the same winner merge into one range; a range ends at its
last measured size (a message between two measured sizes takes the larger one's
winner) and the last range is open (``null``): beyond the sweep the large-message
winner is the best guess. Re-tuning a key (op, ranks, hosts, device, dtype class)
replaces its entry and keeps the rest, so runs at several world sizes and on several
host counts (an emulated cluster is the same machine) share one file.

With ``mcrdl tune --compression CODECS`` the sweep also holds compressed variants
(columns named ``BACKEND+CODEC@ALGORITHM``, see sweep.py). They never enter ``ranges``
(an uncompressed call must not be sent to a codec); ``compressed_ranges`` records, per
size, those that beat the fastest plain backend by ``COMPRESS_MARGIN``, fastest first,
into the entry's optional ``"compressed"`` field (format: selection.py). Every figure is
already the slowest rank's (the sweep reduces with MAX), and only rank 0 decides and
writes: every rank then reads the same choice from the same file.

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


#: a compressed variant is recorded at a size only if it is this many times faster than
#: the fastest plain backend there: a lossy result must buy a clear gain, and the sweep's
#: medians still move by a few per cent between runs on a shared machine
COMPRESS_MARGIN = 1.1


def is_variant(label: str) -> bool:
    """True for a compressed column of a sweep (``mpi+int8@ring``), False for a plain
    backend (``mpi``, or the A/A control ``mpi@2``)."""
    return "+" in label


def winners(medians: dict) -> list[tuple[int, str]]:
    """{size: {backend: seconds}} -> [(size, fastest plain backend)] sorted by size
    (compressed columns are left out)."""
    out = []
    for size, by_backend in sorted(medians.items()):
        plain = {b: t for b, t in by_backend.items() if not is_variant(b)}
        out.append((size, min(plain, key=plain.get)))
    return out


def compressed_ranges(medians: dict, margin: float = COMPRESS_MARGIN) -> dict | None:
    """{size: {column: seconds}} -> the "compressed" field of an entry, or None when no
    compressed column was measured. Per size, the variants at least ``margin`` times
    faster than the fastest plain backend, fastest first; neighbouring sizes with the
    same list merge as ``merge_ranges`` does (the last range is open)."""
    labels = {b for by in medians.values() for b in by if is_variant(b)}
    if not labels:
        return None
    codecs = sorted({b.partition("+")[2].partition("@")[0] for b in labels})
    ranges: list[list] = []
    for size, by in sorted(medians.items()):
        best = min(t for b, t in by.items() if not is_variant(b))
        wins = [b for t, b in sorted((t, b) for b, t in by.items() if is_variant(b))
                if t * margin <= best]
        if ranges and ranges[-1][1] == wins:
            ranges[-1][0] = size
        else:
            ranges.append([size, wins])
    ranges[-1][0] = None
    return {"codecs": codecs, "margin": margin, "ranges": ranges}


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
        comp = compressed_ranges(medians)
        names = ("send", "recv") if op == "send_recv" else (op,)
        for name in names:
            entries.append({"op": name, "world_size": world, "hosts": hosts, "device": device,
                            "dtype_class": dclass, "ranges": [list(r) for r in ranges]})
            if comp is not None:
                entries[-1]["compressed"] = comp
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
    (only ``world_size`` ranks on ``hosts`` hosts when given), and under it a line of
    the compressed variants that win per range where the key has them."""
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
        if "compressed" in e:
            c, parts, lo = e["compressed"], [], 0
            for hi, variants in c["ranges"]:
                parts.append(f"{_fmt(lo)}–{_fmt(hi)} -> {' > '.join(variants) or 'plain'}")
                lo = (hi or 0) + 1
            lines.append(f"{'':15s}   compressed ({'+'.join(c['codecs'])}, allowed calls "
                         f"only): " + ", ".join(parts))
    return lines
