"""Deciding, verifying, merging, locating and printing tuning tables (format: selection.py).

How a table is decided (the why is in docs/tuning.md):

* **Paired rounds.** The sweep (sweep.py) measures a point (op, size) as rounds: in each
  round every candidate runs one block of back-to-back calls (its first calls untimed),
  the blocks in an order that rotates over whole cycles of a Williams design. A
  candidate's figure in a round is the slowest rank's time per call in its block.
* **Evidence for a switch** (``compare``). At each size the tuner keeps the *current*
  choice (the policy's, the neighbouring range's, or, re-tuning some sizes of an
  existing entry, that entry's) unless a candidate is faster with confidence: its
  median *paired ratio* (its time / the current choice's time, round by round) is at
  most ``1 - MARGIN`` and its median paired gain at least ``MIN_GAIN_S``, **and** it
  wins in at least ``wins_needed(n)`` of the n rounds: the one-sided sign test at level
  ``ALPHA``. Why these statistics: a ratio taken inside one round cancels what the
  round's calls shared (a busy neighbour, the clock, cache state), so the comparison is
  of the backends and not of the moments they ran in; the median ignores the heavy
  right tail that preemption adds; the sign test needs no assumption about the shape of
  that noise (timings under load are far from normal) and tells how often a coin would
  do as well. The margin keeps flips that buy less than a user would notice.
* **Undecided points** (the ratio beats the margin but the rounds do not agree often
  enough) are measured again, more rounds appended (at most ``REMEASURE_PASSES``
  times); a point still undecided keeps the current choice.
* **Ranges as one optimisation** (``choose_backends``). Per op, dynamic programming over
  the sizes picks the backend of every size to minimise the total expected time (each
  size's median, relative to the current choice's there, so every size weighs alike)
  plus ``SWITCH_COST`` per range boundary. A switch to a backend other than the current
  choice is only possible at a size where the evidence rule allows it. A one-size flip
  pays two boundaries, so it survives only if it is confident and saves at least
  ``2 x SWITCH_COST`` of that size's time.
* **Verification** (``verify_point``, ``repair``). ``mcrdl tune`` then measures
  ``auto`` through the new table against every single backend, side by side, at both
  sides of every range boundary and a few sizes inside each range
  (``verification_sizes``). A point is *lost* when a single backend beats auto by the
  same evidence rule. A lost range that is not the policy's backend is given back to
  the policy and verified again (``repair``); the figures go into the entry's
  ``"verification"`` block, and a reader uses the policy for a range still marked lost.

Every figure is already the slowest rank's (the sweep reduces with MAX), and only rank 0
decides: it broadcasts the table, so every rank holds the same decisions.

Re-tuning a key (op, ranks, hosts, device, dtype class) replaces its entry and keeps the
rest, so runs at several world sizes and on several host counts (an emulated cluster is
the same machine) share one file; with ``splice=True`` (``mcrdl tune --sizes ...``) only
the measured sizes of the entry are decided again and the rest of it is kept.

With ``mcrdl tune --compression CODECS`` the sweep also holds compressed variants
(columns named ``BACKEND+CODEC@ALGORITHM``, see sweep.py). They never enter ``ranges``
(an uncompressed call must not be sent to a codec); ``compressed_ranges`` records, per
size, those that beat the fastest plain backend by ``COMPRESS_MARGIN`` (with the same
sign test when rounds were measured), fastest first, into the entry's optional
``"compressed"`` field.

A table records the machine it was measured on (``fingerprint()``, defined with the
table's reader in selection.py) and the load it was measured under (sweep.py's
``LoadWatch``); the runtime refuses, with a warning naming the file, a table from
another machine.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import time
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..dispatch.selection import (POLICY, SCHEMA, TuningTable, default_path, fingerprint,
                                  backend_at, fmt_bytes, machine_differences, range_status)

#: every tuned op. p2p is measured as a ping-pong and written as "send" and "recv",
#: so both sides of a transfer pick the same backend.
TUNED_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
             "all_to_all", "gather", "scatter", "send_recv", "barrier")

#: a candidate replaces the current choice only if its median paired ratio is at most
#: 1 - MARGIN (5% faster): the same bound the bench uses to call auto "as fast"
MARGIN = 0.05
#: ... and its median paired gain is at least this (seconds): a sub-microsecond gain is
#: nothing a job would see, and those sizes are the noisiest
MIN_GAIN_S = 1e-6
#: level of the one-sided sign test: the candidate must win in so many rounds that equal
#: backends (a fair coin per round) would do as well with probability at most ALPHA
ALPHA = 0.01
#: the range optimiser's price of one range boundary, in units of one size's time
SWITCH_COST = 0.25
#: how many times an undecided point is measured again (each time as many rounds again)
REMEASURE_PASSES = 2
#: sizes verified inside each range, besides the two at its ends
VERIFY_INSIDE = 2

#: a compressed variant is recorded at a size only if it is this many times faster than
#: the fastest plain backend there: a lossy result must buy a clear gain
COMPRESS_MARGIN = 1.1


def is_variant(label: str) -> bool:
    """True for a compressed column of a sweep (``mpi+int8@ring``), False for a plain
    backend (``mpi``, or the A/A control ``mpi@2``)."""
    return "+" in label


# --- the evidence rule ----------------------------------------------------------------
@lru_cache(maxsize=None)
def wins_needed(rounds: int, alpha: float = ALPHA) -> int:
    """The fewest wins out of ``rounds`` paired rounds that the one-sided sign test
    accepts at level ``alpha``: the smallest k with P(Binomial(rounds, 1/2) >= k) <=
    alpha. ``rounds + 1`` (never) when even winning every round is not enough."""
    tail, total = 0, 1 << rounds
    for k in range(rounds, -1, -1):
        tail += math.comb(rounds, k)
        if tail / total > alpha:
            return k + 1
    return 0


class Evidence(NamedTuple):
    """A candidate against the current choice at one size. ``faster``: True (faster by
    the margin, with confidence), False (not faster by the margin), None (undecided: the
    median says faster but too few rounds agree). ``ratio``: median paired ratio
    candidate / current; ``gain_s``: median paired gain (seconds); ``wins`` of ``rounds``
    (``needed`` for confidence; 0 for figures given without rounds)."""
    faster: bool | None
    ratio: float
    gain_s: float
    wins: int
    rounds: int
    needed: int


def _rounds(v) -> np.ndarray:
    return np.atleast_1d(np.asarray(v, dtype=np.float64))


def is_exact(v) -> bool:
    """True for a figure given as one number (synthetic tables, old callers): it is
    taken as exact; a list or array is per-round samples."""
    return np.ndim(v) == 0


def compare(cand, current, margin: float = MARGIN, min_gain_s: float = MIN_GAIN_S,
            alpha: float = ALPHA) -> Evidence:
    """The evidence rule (module docstring). ``cand`` and ``current``: per-round seconds
    of the same rounds (paired), or one exact figure each."""
    exact = is_exact(cand) and is_exact(current)
    c, r = _rounds(cand), _rounds(current)
    n = min(len(c), len(r))
    c, r = c[:n], r[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = float(np.median(np.where(r > 0, c / r, np.inf)))
    gain = float(np.median(r - c))
    wins = int(np.count_nonzero(c < r))
    beats = ratio <= 1.0 - margin and gain >= min_gain_s
    if exact:
        return Evidence(beats, ratio, gain, wins, n, 0)
    needed = wins_needed(n, alpha)
    if not beats:
        return Evidence(False, ratio, gain, wins, n, needed)
    return Evidence(True if wins >= needed else None, ratio, gain, wins, n, needed)


def policy_choice(device: str, columns) -> str:
    """The backend the policy would take among the measured ``columns`` (the first of
    POLICY's order that was measured; else the first column in sorted order)."""
    cols = [c for c in columns if not is_variant(c)]
    for name in POLICY.get(device, ()):
        if name in cols:
            return name
    return sorted(cols)[0]


def _median(v) -> float:
    return float(np.median(_rounds(v)))


# --- ranges as one optimisation -------------------------------------------------------
def choose_backends(points: list, current: list, switch_cost: float = SWITCH_COST,
                    margin: float = MARGIN, min_gain_s: float = MIN_GAIN_S,
                    alpha: float = ALPHA) -> list[str]:
    """The backend of every point, as one optimisation (module docstring).

    ``points``: ``[(size, figures)]`` sorted by size, ``figures`` either ``{backend:
    rounds or seconds}`` (plain backends only) or a backend name (a fixed point: kept
    from an existing entry). ``current``: per point, the choice kept without evidence.
    The state before the first point is ``current[0]``. Cost of a measured point for
    backend b: b's median over the current choice's median there; a fixed point costs
    nothing. A boundary costs ``switch_cost``; it may lead to ``current[i]`` or into a
    fixed point freely, to any other backend only where ``compare`` says it is faster
    than the backend it leaves. Ties prefer no switch, then the current choice."""
    if not points:
        return []
    names = {b for _, f in points for b in ([f] if isinstance(f, str) else f)}
    order = {b: i for i, b in enumerate(dict.fromkeys(list(current) + sorted(names)))}
    best = {current[0]: (0.0, 0)}  # backend -> (cost, switches)
    back: list[dict] = []
    for i, (_, figs) in enumerate(points):
        cur = current[i]
        if isinstance(figs, str):
            costs = {figs: 0.0}
        else:
            meds = {b: _median(v) for b, v in figs.items()}
            ref = meds.get(cur) or min(meds.values()) or 1.0
            costs = {b: m / ref if ref > 0 else 0.0 for b, m in meds.items()}
        new, arg = {}, {}
        for b, cost in costs.items():
            options = []
            for a, (acc, sw) in best.items():
                if a == b:
                    options.append((acc, sw, 0, order[a], a))
                elif b == cur or isinstance(figs, str) or (
                        isinstance(figs, dict) and a in figs and
                        compare(figs[b], figs[a], margin, min_gain_s, alpha).faster):
                    options.append((acc + switch_cost, sw + 1, 1, order[a], a))
            if options:
                acc, sw, _, _, a = min(options)
                new[b] = (acc + cost, sw)
                arg[b] = a
        if not new:  # nothing reachable (cannot happen with cur measured): keep cur
            new = {cur: (min(v[0] for v in best.values()), 0)}
            arg = {cur: next(iter(best))}
        best = new
        back.append(arg)
    last = min(best, key=lambda b: (best[b][0], best[b][1], b != current[-1], order[b]))
    out = [last]
    for i in range(len(points) - 1, 0, -1):
        out.append(back[i][out[-1]])
    return out[::-1]


def undecided(figs: dict, cur: str, margin: float = MARGIN, min_gain_s: float = MIN_GAIN_S,
              alpha: float = ALPHA) -> bool:
    """True when a switch at this point could be wanted but the rounds do not settle
    it: some backend other than ``cur`` is, against some other backend, undecided by
    ``compare``. Exact figures are never undecided."""
    for b, vb in figs.items():
        if b == cur:
            continue
        for a, va in figs.items():
            if a != b and compare(vb, va, margin, min_gain_s, alpha).faster is None:
                return True
    return False


def merge_ranges(points: list[tuple[int, str]]) -> list[list]:
    """[(size, backend)] sorted by size -> [[max_bytes, backend], ..., [None, backend]]:
    a range ends at its last size (a message between two sizes takes the larger one's
    backend) and the last range is open (beyond the sweep the large-message choice is
    the best guess)."""
    ranges: list[list] = []
    for size, backend in points:
        if ranges and ranges[-1][1] == backend:
            ranges[-1][0] = size
        else:
            ranges.append([size, backend])
    if ranges:
        ranges[-1][0] = None
    return ranges


def _plain(figs: dict) -> dict:
    return {b: v for b, v in figs.items() if not is_variant(b)}


def compressed_ranges(figures: dict, margin: float = COMPRESS_MARGIN) -> dict | None:
    """{size: {column: rounds or seconds}} -> the "compressed" field of an entry, or
    None when no compressed column was measured. Per size, the variants at least
    ``margin`` times faster than the fastest plain backend (by median), with the sign
    test when rounds were measured, fastest first; neighbouring sizes with the same list
    merge as ``merge_ranges`` does (the last range is open)."""
    labels = {b for by in figures.values() for b in by if is_variant(b)}
    if not labels:
        return None
    codecs = sorted({b.partition("+")[2].partition("@")[0] for b in labels})
    ranges: list[list] = []
    for size, by in sorted(figures.items()):
        plain = _plain(by)
        fastest = min(plain, key=lambda b: _median(plain[b]))
        wins = [b for t, b in sorted((_median(t), b) for b, t in by.items() if is_variant(b))
                if compare(by[b], plain[fastest], 1 - 1 / margin, 0.0).faster]
        if ranges and ranges[-1][1] == wins:
            ranges[-1][0] = size
        else:
            ranges.append([size, wins])
    ranges[-1][0] = None
    return {"codecs": codecs, "margin": margin, "ranges": ranges}


def decide_entry(figures: dict, device: str, existing: dict | None = None,
                 switch_cost: float = SWITCH_COST, margin: float = MARGIN) -> dict:
    """One key's ``ranges`` and ``measured`` fields (a dict of both) from {size:
    {column: rounds or seconds}}. With ``existing`` (an entry of the same key, re-tuned
    at some sizes), its other measured sizes are kept as fixed points (with their old
    figures) and its choices are the current ones; else the current choice is the
    policy's everywhere."""
    sizes = sorted(figures)
    plain = {s: _plain(figures[s]) for s in sizes}
    cols = set.intersection(*(set(p) for p in plain.values()))
    plain = {s: {b: v for b, v in p.items() if b in cols} for s, p in plain.items()}
    policy = policy_choice(device, cols)
    points: list = [(s, plain[s]) for s in sizes]
    if existing is not None:
        old_sizes = existing.get("measured", {}).get("sizes") or \
            [m for m, _ in existing["ranges"] if m is not None]
        points += [(s, backend_at(existing["ranges"], s)) for s in old_sizes
                   if s not in figures]
        points.sort(key=lambda p: p[0])

    def cur_at(size, figs):
        if isinstance(figs, str):
            return figs
        if existing is not None and backend_at(existing["ranges"], size) in figs:
            return backend_at(existing["ranges"], size)
        return policy

    current = [cur_at(s, f) for s, f in points]
    choice = choose_backends(points, current, switch_cost, margin)
    old = (existing or {}).get("measured") or {}
    at = {s: i for i, s in enumerate(old.get("sizes", []))}

    def old_figure(field, size, b=None):
        seq = old.get(field, []) if b is None else old.get("median_s", {}).get(b, [])
        i = at.get(size)
        return seq[i] if i is not None and i < len(seq) else None

    def rounds_of(size, f):
        if isinstance(f, str):
            return old_figure("rounds", size) or 0
        v = next(iter(f.values()))
        return 0 if is_exact(v) else len(_rounds(v))

    measured = {"sizes": [s for s, _ in points],
                "rounds": [rounds_of(s, f) for s, f in points],
                "median_s": {b: [_median(f[b]) if isinstance(f, dict) else old_figure(None, s, b)
                                 for s, f in points] for b in sorted(cols)}}
    return {"ranges": merge_ranges(list(zip([s for s, _ in points], choice))),
            "measured": measured}


def build_entries(results: dict, existing: dict | None = None,
                  switch_cost: float = SWITCH_COST, margin: float = MARGIN) -> list[dict]:
    """{(op, world_size, hosts, device, dtype_class): {size: {column: rounds or
    seconds}}} -> entries (op "send_recv" becomes "send" and "recv"). ``existing``: a
    table dict whose entries of the same keys are spliced into (``splice`` of
    ``merge_table``) instead of replaced."""
    old = {}
    if existing:
        old = {_key(e): e for e in existing.get("entries", [])}
    entries = []
    for (op, world, hosts, device, dclass), figures in sorted(results.items()):
        names = ("send", "recv") if op == "send_recv" else (op,)
        prior = old.get((names[0], world, hosts, device, dclass))
        decided = decide_entry(figures, device, prior, switch_cost, margin)
        comp = compressed_ranges(figures)
        for name in names:
            e = {"op": name, "world_size": world, "hosts": hosts, "device": device,
                 "dtype_class": dclass, "ranges": [list(r) for r in decided["ranges"]],
                 "measured": decided["measured"]}
            if prior is not None and "verification" in prior:  # splice: keep what still holds
                e["verification"] = keep_verification(prior["verification"], e,
                                                      set(figures))
            if comp is not None:
                e["compressed"] = comp
            entries.append(e)
    return entries


def _key(e: dict) -> tuple:
    return (e["op"], e["world_size"], e.get("hosts", 1), e["device"], e["dtype_class"])


# --- verification ---------------------------------------------------------------------
def verification_sizes(sizes, ranges, inside: int = VERIFY_INSIDE) -> list[int]:
    """The sizes to verify: of each range's sizes (among ``sizes``), the first and the
    last (so both sides of every boundary) and ``inside`` more, evenly spaced."""
    bounds = [m if m is not None else math.inf for m, _ in ranges]
    by_range: dict = {}
    for s in sorted(sizes):
        by_range.setdefault(bisect.bisect_left(bounds, s), []).append(s)
    out = set()
    for group in by_range.values():
        k = min(len(group), inside + 2)
        out.update(group[round(i * (len(group) - 1) / max(k - 1, 1))] for i in range(k))
    return sorted(out)


def verify_point(size: int, auto_backend: str, figures: dict, margin: float = MARGIN,
                 min_gain_s: float = MIN_GAIN_S, alpha: float = ALPHA) -> dict:
    """One verification point from paired rounds ``{"auto": ..., backend: ...}``:
    medians, and the verdict "lost" (a single backend beats auto by the evidence
    rule; ``against`` names the one with the best ratio), "unsure" (one might, the
    rounds do not settle it) or "ok"."""
    auto = figures["auto"]
    point = {"bytes": int(size), "auto": auto_backend, "auto_s": _median(auto),
             "single_s": {b: _median(v) for b, v in sorted(figures.items()) if b != "auto"},
             "rounds": 0 if is_exact(auto) else len(_rounds(auto)),
             "verdict": "ok", "against": None, "ratio": None}
    worst = None
    for b, v in sorted(figures.items()):
        if b == "auto":
            continue
        ev = compare(v, auto, margin, min_gain_s, alpha)
        rank = {True: 2, None: 1, False: 0}[ev.faster]
        if rank and (worst is None or (rank, -ev.ratio) > (worst[0], -worst[1].ratio)):
            worst = (rank, ev, b)
    if worst is not None:
        point.update(verdict="lost" if worst[0] == 2 else "unsure", against=worst[2],
                     ratio=round(worst[1].ratio, 4))
    return point


def repair(ranges: list, points: list, policy: str) -> tuple[list, list[str]]:
    """Ranges with every range that lost at a verification point and is not the
    policy's backend given back to ``policy`` (neighbours merged), and a line per
    change. A lost policy range stays, and so does a range whose backend measured faster
    than the policy's (``range_status``): the table is no worse than the default there."""
    status = range_status(ranges, points, policy)
    out, notes, lo = [], [], 0
    for (hi, b), st in zip(ranges, status):
        if st == "lost":
            notes.append(f"{fmt_bytes(lo)}–{fmt_bytes(hi)}: {b} -> {policy}")
            b = policy
        if out and out[-1][1] == b:
            out[-1][0] = hi
        else:
            out.append([hi, b])
        lo = (hi or 0) + 1
    return out, notes


def keep_verification(block: dict, entry: dict, remeasured: set) -> dict | None:
    """An entry's verification block after re-tuning some sizes: the points at sizes
    not re-measured whose auto backend is still the one the entry picks there."""
    pts = [p for p in block.get("points", []) if p["bytes"] not in remeasured
           and backend_at(entry["ranges"], p["bytes"]) == p["auto"]]
    return dict(block, points=pts) if pts else None


def verification_totals(points: list) -> dict:
    """Sums over verification points (seconds): auto and each single backend, and the
    best single backend (smallest sum)."""
    totals = {"auto": sum(p["auto_s"] for p in points)}
    names = set.intersection(*(set(p["single_s"]) for p in points)) if points else set()
    for b in sorted(names):
        totals[b] = sum(p["single_s"][b] for p in points)
    best = min(names, key=totals.get) if names else None
    return {"points": len(points), "totals_s": totals, "best": best}


def verification_line(op: str, points: list, ranges: list, policy: str, notes=()) -> str:
    """One line per op: points, the sums of auto and of each backend, the verdict."""
    t = verification_totals(points)
    sums = ", ".join(f"{b} {s * 1e6:.1f} µs" for b, s in t["totals_s"].items() if b != "auto")
    status = range_status(ranges, points, policy)
    lost = [p for p in points if p["verdict"] == "lost"]
    verdict = ("ok" if not lost else
               f"{len(lost)} point(s) slower than a single backend ("
               + "; ".join(f"{fmt_bytes(p['bytes'])} {p['auto']} vs {p['against']} "
                           f"x{1 / p['ratio']:.2f}" for p in lost[:3]) + ")")
    if "missed" in status:
        verdict += "; a faster backend exists (range kept: the default is no faster there)"
    if notes:
        verdict += "; repaired " + ", ".join(notes)
    return (f"{op:15s} {t['points']:3d} points: auto {t['totals_s']['auto'] * 1e6:.1f} µs"
            f" | {sums}: {verdict}")


def total_line(blocks: list) -> str:
    """The whole verification's total: auto against the best single backend."""
    pts = [p for b in blocks for p in b]
    t = verification_totals(pts)
    if not t["best"]:
        return "verification: no points"
    auto, best = t["totals_s"]["auto"], t["totals_s"][t["best"]]
    others = ", ".join(f"{b} {s * 1e6:.1f} µs" for b, s in t["totals_s"].items()
                       if b not in ("auto", t["best"]))
    return (f"verification total over {t['points']} points: auto {auto * 1e6:.1f} µs vs best "
            f"single backend ({t['best']}) {best * 1e6:.1f} µs ({(auto / best - 1) * 100:+.1f}%)"
            + (f"; {others}" if others else ""))


# --- the table as a whole -------------------------------------------------------------
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
    TuningTable(table, "<new table>", warn=False)  # validate before anything is written
    return table


def write_table(table: dict, path: str) -> None:
    """Write atomically: into a temporary file of the same folder, flushed to disk,
    then renamed over ``path``. A reader never sees half a file, and a run interrupted
    before the rename (Ctrl-C, a killed rank, a full disk) leaves the old table as it
    was and no temporary file behind."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _fmt(b) -> str:
    return fmt_bytes(b)


def crossover_lines(table: TuningTable, world_size: int | None = None,
                    hosts: int | None = None) -> list[str]:
    """The MCR-DL paper's "message size -> backend" view of a table, one line per key
    (only ``world_size`` ranks on ``hosts`` hosts when given; a range its verification
    found slower than a single backend is marked, the policy runs there), and under it
    a line of the compressed variants that win per range where the key has them."""
    lines = []
    for e in table.data["entries"]:
        e_hosts = e.get("hosts", 1)
        if (world_size is not None and e["world_size"] != world_size) or \
                (hosts is not None and e_hosts != hosts):
            continue
        ver = e.get("verification") or {}
        status = range_status(e["ranges"], ver.get("points", []),
                              POLICY.get(e["device"], ("",))[0])
        parts, lo = [], 0
        for (hi, backend), st in zip(e["ranges"], status):
            mark = {"lost": " [LOST: policy used]", "missed": " [a faster backend exists]"}
            parts.append(f"{_fmt(lo)}–{_fmt(hi)} -> {backend}{mark.get(st, '')}")
            lo = (hi or 0) + 1
        when = f" (verified {ver['when']})" if ver.get("when") else ""
        lines.append(f"{e['op']:15s} n={e['world_size']} hosts={e_hosts} {e['device']} "
                     f"{e['dtype_class']:5s}: "
                     + ", ".join(parts) + when)
        if "compressed" in e:
            c, parts, lo = e["compressed"], [], 0
            for hi, variants in c["ranges"]:
                parts.append(f"{_fmt(lo)}–{_fmt(hi)} -> {' > '.join(variants) or 'plain'}")
                lo = (hi or 0) + 1
            lines.append(f"{'':15s}   compressed ({'+'.join(c['codecs'])}, allowed calls "
                         f"only): " + ", ".join(parts))
    return lines


# --- a tuning run: every rank calls these, rank 0 decides --------------------------------
def on_root(rt, fn):
    """``fn()`` run on rank 0 only, its result handed to every rank (the bootstrap's
    broadcast), so every rank holds the same decision whatever its own figures. An
    exception on rank 0 is raised on every rank (the others would otherwise wait in
    the broadcast forever)."""
    err = None
    msg = None
    if rt.rank == 0:
        try:
            msg = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 -- re-raised below, on every rank
            err, msg = exc, ("error", f"{type(exc).__name__}: {exc}")
    msg = rt.bootstrap.bcast(msg)
    if msg[0] == "error":
        if err is not None:
            raise err
        raise RuntimeError(f"rank 0 failed while deciding the tuning table: {msg[1]}")
    return msg[1]


def remeasure_undecided(rt, results: dict, device: str, measure,
                        passes: int = REMEASURE_PASSES, margin: float = MARGIN) -> list:
    """Measure the undecided points of ``results`` ({op: {size: {column: rounds}}},
    updated in place) again, as many rounds again appended, at most ``passes`` times;
    rank 0 picks the points. ``measure(op, size, columns, rounds)`` -> {column:
    rounds}. Returns the points still undecided: they keep the current choice."""
    def todo():
        out = []
        for op, pts in results.items():
            for size, figs in pts.items():
                plain = _plain(figs)
                if len(plain) > 1 and undecided(plain, policy_choice(device, plain), margin):
                    out.append((op, size))
        return out

    for _ in range(passes):
        points = on_root(rt, todo)
        if not points:
            return []
        for op, size in points:
            size = int(size)
            figs = results[op][size]
            more = measure(op, size, list(figs), len(_rounds(next(iter(figs.values())))))
            results[op][size] = {c: np.concatenate([_rounds(figs[c]), _rounds(more[c])])
                                 for c in figs}
    return on_root(rt, todo)


def entry_name(op: str) -> str:
    """The table's op name of a sweep op (send_recv is written as send and recv)."""
    return "send" if op == "send_recv" else op


def entries_of(table: dict, key: tuple) -> list[dict]:
    """The entries of ``table`` for a sweep key (two for send_recv: send, recv)."""
    op, world, hosts, device, dclass = key
    names = ("send", "recv") if op == "send_recv" else (op,)
    return [e for e in table["entries"]
            if (e["op"], e["world_size"], e.get("hosts", 1), e["device"], e["dtype_class"])
            in {(n, world, hosts, device, dclass) for n in names}]


def verify(rt, table: dict, keys: list, backends: list, measure, *, sizes: dict | None = None,
           repairs: int = 2, margin: float = MARGIN, inside: int = VERIFY_INSIDE,
           reuse: bool = True) -> dict:
    """The verification pass (every rank calls it): for each key ``(op, world_size,
    hosts, device, dtype_class)`` (op as the sweep names it: ``send_recv``) measure
    ``auto`` through ``table`` against each of ``backends`` at ``verification_sizes``
    (of ``sizes[key]``, default the entry's measured sizes), "unsure" points once more,
    then, while ``repairs`` last, give lost ranges back to the policy (``repair``) and
    verify what changed. ``measure(op, size, columns, rounds or None)``. ``reuse``:
    keep an entry's stored points that still hold (a re-tune of some sizes) instead of
    measuring every point afresh (``mcrdl tune --verify``). The runtime's
    table is left set to the last one verified (the caller restores its own).

    Returns (the same on every rank) {"table": the table with each verified entry's
    ``"verification"`` block, "lines": one per key (``verification_line``), "total":
    ``total_line``, "lost": lost points left, "repaired": ranges given back}."""
    state = {"table": json.loads(json.dumps(table)), "points": {k: {} for k in keys},
             "notes": {k: [] for k in keys}}
    for e_key in keys if reuse else ():  # a re-tuned entry keeps old points that hold
        for e in entries_of(state["table"], e_key)[:1]:
            for p in (e.get("verification") or {}).get("points", []):
                state["points"][e_key][p["bytes"]] = p

    def policy_of(key):
        return policy_choice(key[3], backends)

    def plan():
        out = []
        for key in keys:
            es = entries_of(state["table"], key)
            if not es:
                continue
            e = es[0]
            cands = (sizes or {}).get(key) or e.get("measured", {}).get("sizes") or []
            for s in verification_sizes(cands, e["ranges"], inside):
                old = state["points"][key].get(s)
                if old is None or old["auto"] != backend_at(e["ranges"], s):
                    out.append((keys.index(key), s, backend_at(e["ranges"], s)))
        return out

    cols = ["auto"] + list(backends)
    for attempt in range(repairs + 1):
        rt.set_table(TuningTable(state["table"], "<table being verified>", warn=False))
        todo = [(keys[i], s, b) for i, s, b in on_root(rt, plan)]
        if not todo:
            break
        figs = {(key, s): measure(key[0], s, cols, None) for key, s, _ in todo}

        def unsure():
            return [j for j, (key, s, b) in enumerate(todo)
                    if verify_point(s, b, figs[(key, s)], margin)["verdict"] == "unsure"]

        for key, s, _ in (todo[j] for j in on_root(rt, unsure)):
            more = measure(key[0], s, cols, len(_rounds(figs[(key, s)]["auto"])))
            figs[(key, s)] = {c: np.concatenate([_rounds(figs[(key, s)][c]), _rounds(more[c])])
                              for c in cols}

        def update():
            changed = False
            for key, s, b in todo:
                state["points"][key][s] = verify_point(s, b, figs[(key, s)], margin)
            if attempt < repairs:
                for key in keys:
                    es = entries_of(state["table"], key)
                    if not es:
                        continue
                    ranges, notes = repair(es[0]["ranges"], list(state["points"][key].values()),
                                           policy_of(key))
                    if notes:
                        changed = True
                        state["notes"][key] += notes
                        for e in es:
                            e["ranges"] = [list(r) for r in ranges]
            return state["table"] if changed else None

        new = on_root(rt, update)
        if new is None:
            break
        state["table"] = new

    def finish():
        when = time.strftime("%Y-%m-%dT%H:%M:%S")
        lines, blocks, lost, repaired = [], [], 0, 0
        for key in keys:
            es = entries_of(state["table"], key)
            if not es:
                continue
            pts = sorted((p for p in state["points"][key].values()
                          if backend_at(es[0]["ranges"], p["bytes"]) == p["auto"]),
                         key=lambda p: p["bytes"])
            for e in es:
                e["verification"] = {"when": when, "margin": margin, "points": pts}
            lines.append(verification_line(key[0], pts, es[0]["ranges"], policy_of(key),
                                           state["notes"][key]))
            blocks.append(pts)
            lost += sum(st == "lost" for st in range_status(es[0]["ranges"], pts,
                                                            policy_of(key)))
            repaired += len(state["notes"][key])
        return {"table": state["table"], "lines": lines, "total": total_line(blocks),
                "lost": lost, "repaired": repaired}

    return on_root(rt, finish)
