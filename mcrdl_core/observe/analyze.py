"""What the ranks' flight-recorder dumps say, side by side (``mcrdl trace DIR``).

``verdict(dumps)`` takes the dumps of one job (``recorder.snapshot``'s dicts, one per
rank) and finds the first call where the ranks part: on each group it walks the
collectives by sequence number (the same on every member) and stops at the first one
that some member never reached, that the members made differently (op, size, dtype,
root, reduce op, backend, codec, algorithm), or that did not complete everywhere; of
those, the earliest in time is the verdict. Its kinds:

- ``dead rank``: a member left no dump (killed, or never started), or its dump stops
  (written by SIGUSR1 or ``dump_trace()`` long before the others' fault);
- ``missing call``: a member has a dump but never made the call (it waits elsewhere,
  or ended);
- ``slow rank``: every member made the call alike, one of them much later than the
  others, which gave up waiting;
- ``different ops`` / ``sizes`` / ``dtypes`` / ``roots`` / ``reduce ops`` /
  ``backends`` / ``codecs`` / ``algorithms``: the members made the call differently;
- ``stuck``: every member made the call alike and it did not complete (the library or
  something outside the dumps);
- ``unmatched point-to-point``: collectives agree, a send or receive never completed;
- ``ok``: the ranks agree.

``stragglers(dumps)``: per collective that every member made, who arrived last and by
how much (seconds after the median of the others), summed per rank.
"""
from __future__ import annotations

import statistics

#: fields a collective's members must agree on, with the kind a difference is
FIELDS = (("op", "different ops"), ("dtype", "different dtypes"),
          ("count", "different sizes"), ("counts", "different sizes"),
          ("root", "different roots"), ("reduce_op", "different reduce ops"),
          ("backend", "different backends"), ("codec", "different codecs"),
          ("algorithm", "different algorithms"))
#: a rank that reached a call this much later than the others' latest arrival, after
#: they gave up on it, is slow (seconds)
SLOW_S = 1.0
_DONE = ("completed", "lowered")


def fmt_bytes(b) -> str:
    if b is None:
        return "? B"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift:
            v = b / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{b} B"


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def call_text(e, with_seq=True) -> str:
    """"all_reduce #41 (gloo, 4 MiB)"."""
    parts = [e.get("backend") or "?"]
    if e.get("codec"):
        parts.append(e["codec"])
    if e.get("algorithm") and e["algorithm"] not in ("compressed",):
        parts.append(e["algorithm"])
    if e["op"] != "barrier":
        parts.append("uneven" if e.get("counts") else fmt_bytes(e.get("bytes")))
    seq = f" #{e['seq']}" if with_seq and e.get("seq") is not None else ""
    return f"{e['op']}{seq} ({', '.join(parts)})"


def group_name(dumps, key) -> str:
    for d in dumps.values():
        g = d.get("groups", {}).get(key)
        if g:
            return f"group '{g.get('name', key)}'"
    return f"group '{key}'"


def _members(dumps, key):
    for d in dumps.values():
        g = d.get("groups", {}).get(key)
        if g:
            return list(g["ranks"])
    return []


def _collectives(d) -> dict:
    """{group key: {seq: entry}} of one dump's collectives."""
    out: dict = {}
    for e in d.get("entries", ()):
        if e.get("p2p") or e.get("seq") is None:
            continue
        out.setdefault(e["group"], {})[e["seq"]] = e
    return out


def _fault_time(d):
    """When a rank gave up (its dump's time where the dump is a fault's)."""
    return d.get("time") if d.get("faults") else None


def pending(d):
    """The last entry of a dump that did not complete (what the rank waits in)."""
    for e in reversed(d.get("entries", ())):
        if e.get("state") not in _DONE:
            return e
    return None


def _where(dumps, d) -> str:
    e = pending(d)
    if e is not None:
        verb = {"issued": "waits in", "timed out": "timed out in",
                "failed": "failed in"}.get(e["state"], "is in")
        return f"{verb} {call_text(e)} on {group_name(dumps, e['group'])}"
    last = d.get("entries", [])[-1:] or None
    tail = f" (its last call: {call_text(last[0])}, completed)" if last else ""
    return f"is in no call: it {'ended' if d.get('reason', '').startswith('exit') else 'went on'}" \
           f"{tail}"


def _first_problem(dumps: dict, key: str):
    """The first call of group ``key`` where the members part, as (time, problem dict),
    or None."""
    members = _members(dumps, key)
    per = {r: _collectives(dumps[r]).get(key, {}) for r in members if r in dumps}
    dead = [r for r in members if r not in dumps]
    seqs = sorted({s for m in per.values() for s in m})
    if not seqs:
        return None
    # the ring may have dropped a rank's oldest calls: compare from where all have them
    start = max((min(m) for m in per.values() if m), default=seqs[0])
    for s in (x for x in seqs if x >= start):
        here = {r: m[s] for r, m in per.items() if s in m}
        absent = [r for r in per if s not in per[r]]
        t0 = min(e["t_issue"] for e in here.values())
        first = next(iter(here.values()))
        base = {"group": key, "seq": s, "op": first["op"], "time": t0, "present": here}
        uneven = any(e.get("counts") for e in here.values())
        for field, kind in FIELDS:
            if uneven and field in ("count", "counts"):
                continue  # (each rank's own splits and sizes, by design)
            values = {}
            for r, e in here.items():
                values.setdefault(repr(e.get(field)), []).append(r)
            if len(values) > 1:
                return t0, dict(base, kind=kind, field=field, sides=values)
        states = {r: e["state"] for r, e in here.items()}
        unfinished = any(st not in _DONE for st in states.values())
        # a rank without a dump is absent from every call: it matters at the first one
        # the others did not complete (or their last)
        if absent or (dead and (unfinished or s == seqs[-1])):
            return t0, dict(base, kind="absent", dead=dead, absent=absent)
        if unfinished:
            return t0, dict(base, kind="pending", states=states)
    return None


def verdict(dumps_list) -> dict:
    """The first-line verdict of a job's dumps (module docstring): ``{"line", "kind",
    "problem", "group", "seq", "ranks"}`` (ranks: the ones the line blames)."""
    dumps = {d["rank"]: d for d in dumps_list}
    world = max(d.get("world_size", 1) for d in dumps.values())
    keys = []
    for d in dumps.values():
        for k in d.get("groups", {}):
            if k not in keys:
                keys.append(k)
    found = [p for p in (_first_problem(dumps, k) for k in keys) if p is not None]
    if found:
        return _describe(dumps, min(found, key=_rank_problem)[1])
    missing = [r for r in range(world) if r not in dumps]
    if missing:
        return {"line": f"dead rank: {ranks_text(missing)} left no dump (killed, or never "
                        f"started MCR-DL); the others' collectives agree",
                "kind": "dead rank", "problem": True, "ranks": missing, "group": None,
                "seq": None}
    p2p = [(r, _pending_p2p(d)) for r, d in sorted(dumps.items())]
    p2p = [(r, e) for r, e in p2p if e is not None]
    if p2p:
        r, e = p2p[0]
        peer = e.get("peer")
        who = f"{'to' if e['op'] == 'send' else 'from'} " \
              f"{'any rank' if peer is None else 'group rank ' + str(peer)}"
        return {"line": f"unmatched point-to-point: rank {r} {e['state']} in "
                        f"{call_text(e, False)} {who} on {group_name(dumps, e['group'])}; "
                        "the collectives agree",
                "kind": "unmatched point-to-point", "problem": True, "ranks": [r],
                "group": e["group"], "seq": e.get("seq")}
    n = sum(len(m) for d in dumps.values() for m in _collectives(d).values())
    return {"line": f"the ranks agree: {n} collective entries of {len(dumps)} ranks on "
                    f"{len(keys)} group{'s' if len(keys) != 1 else ''} match, none pending",
            "kind": "ok", "problem": False, "ranks": [], "group": None, "seq": None}


def _rank_problem(found) -> tuple:
    """Which group's first problem is the job's: calls made differently first (the
    earliest), then calls some member never reached, where most members wait (the
    smaller side is the one that went elsewhere: rank 1 in a barrier on one group and
    the others in an all-reduce on another is rank 1's missing all-reduce, whichever
    was issued first), then calls that did not complete."""
    t, p = found
    if p["kind"] == "absent":
        return (1, -len(p["present"]), t)
    return (0 if p["kind"] != "pending" else 2, 0, t)


def _pending_p2p(d):
    for e in reversed(d.get("entries", ())):
        if e.get("p2p") and e.get("state") not in _DONE:
            return e
    return None


def _describe(dumps, p) -> dict:
    key, s = p["group"], p["seq"]
    gname = group_name(dumps, key)
    here = p["present"]
    out = {"problem": True, "group": key, "seq": s}
    if p["kind"] == "absent":
        e = next(iter(here.values()))
        waiting = sorted(here)
        faults = [_fault_time(dumps[r]) for r in waiting if _fault_time(dumps[r])]
        if p["dead"]:
            return dict(out, kind="dead rank", ranks=p["dead"],
                        line=f"dead rank: {ranks_text(p['dead'])} left no dump (killed, or "
                             f"never started MCR-DL); {ranks_text(waiting)} wait in "
                             f"{call_text(e)} on {gname}")
        stopped = [r for r in p["absent"] if not dumps[r].get("faults")
                   and dumps[r].get("reason") in ("SIGUSR1", "dump_trace()")
                   and faults and dumps[r]["time"] < min(faults) - SLOW_S]
        if stopped:
            r = stopped[0]
            return dict(out, kind="dead rank", ranks=stopped,
                        line=f"dead rank: rank {r}'s dump stops "
                             f"{min(faults) - dumps[r]['time']:.1f} s before the others' "
                             f"fault and it never reached {call_text(e)} on {gname}; "
                             f"{ranks_text(waiting)} wait in it")
        r = p["absent"][0]
        return dict(out, kind="missing call", ranks=p["absent"],
                    line=f"missing call: {ranks_text(p['absent'])} never called {call_text(e)} "
                         f"on {gname} ({ranks_text(waiting)} wait in it); rank {r} "
                         f"{_where(dumps, dumps[r])}")
    if p["kind"] == "pending":
        states = p["states"]
        waiting = [r for r, st in states.items() if st not in _DONE]
        e = here[waiting[0]]
        t = {r: x["t_issue"] for r, x in here.items()}
        late = max(t, key=t.get)
        others = [r for r in t if r != late]
        gave_up = [r for r in others if states[r] in ("timed out", "failed")]
        prior = max((t[r] for r in others), default=t[late])
        ends = [_fault_time(dumps[r]) or t[r] for r in gave_up]
        if gave_up and ends and t[late] - prior > SLOW_S and t[late] >= min(ends) - 0.1:
            return dict(out, kind="slow rank", ranks=[late],
                        line=f"slow rank: rank {late} reached {call_text(here[late])} on "
                             f"{gname} {t[late] - prior:.1f} s after {ranks_text(others)}, "
                             f"which gave up waiting ({states[gave_up[0]]})")
        done = [r for r in states if r not in waiting]
        if done:
            return dict(out, kind="stuck", ranks=waiting,
                        line=f"stuck: {ranks_text(waiting)} did not complete {call_text(e)} "
                             f"on {gname}, which {ranks_text(done)} completed")
        return dict(out, kind="stuck", ranks=waiting,
                    line=f"stuck: every member made {call_text(e)} on {gname} alike and it "
                         f"did not complete ({', '.join(sorted(set(states.values())))}): the "
                         "library, or a rank outside the dumps, holds it")
    # the members made the call differently: the smaller side first
    sides = sorted(p["sides"].values(), key=lambda rs: (len(rs), rs))
    few, rest = sides[0], [r for rs in sides[1:] for r in rs]
    a, b = here[few[0]], here[rest[0]]
    kind, field = p["kind"], p["field"]
    if field == "op":
        what = (f"{ranks_text(few)} call{'s' if len(few) == 1 else ''} {call_text(a, False)}, "
                f"{ranks_text(rest)} {call_text(b, False)}")
        line = f"{kind} at #{s} on {gname}: {what}"
    else:
        def val(e):
            if field in ("count", "counts"):
                return (f"{e.get('count')} {e.get('dtype')} ({fmt_bytes(e.get('bytes'))})"
                        if field == "count" else f"split counts {e.get('counts')}")
            return str(e.get(field) or "none")
        line = (f"{kind} at {a['op']} #{s} on {gname}: {ranks_text(few)} "
                f"{'has' if len(few) == 1 else 'have'} {val(a)}, {ranks_text(rest)} {val(b)}")
        if field in ("backend", "codec", "algorithm"):
            line = (f"{kind} at {a['op']} #{s} on {gname}: {ranks_text(few)} "
                    f"run{'s' if len(few) == 1 else ''} it on {val(a)}, {ranks_text(rest)} "
                    f"on {val(b)}")
    return dict(out, kind=kind, ranks=few, line=line)


def stragglers(dumps_list, top: int = 5) -> dict:
    """Who arrived last at the collectives every member made: ``{"calls": the ``top``
    calls by spread [(group, seq, op, last rank, seconds after the median of the
    others)], "ranks": {rank: [times last, seconds late in all]}}``."""
    dumps = {d["rank"]: d for d in dumps_list}
    per_rank = {r: _collectives(d) for r, d in dumps.items()}
    calls, ranks = [], {}
    keys = {k for c in per_rank.values() for k in c}
    for key in keys:
        members = _members(dumps, key)
        if len(members) < 2 or any(m not in per_rank for m in members):
            continue
        seqs = set.intersection(*(set(per_rank[m].get(key, {})) for m in members))
        for s in seqs:
            t = {m: per_rank[m][key][s]["t_issue"] for m in members}
            last = max(t, key=t.get)
            late = t[last] - statistics.median(v for m, v in t.items() if m != last)
            calls.append((key, s, per_rank[last][key][s]["op"], last, round(late, 6)))
            agg = ranks.setdefault(last, [0, 0.0])
            agg[0] += 1
            agg[1] = round(agg[1] + late, 6)
    calls.sort(key=lambda c: -c[4])
    return {"calls": calls[:top], "ranks": ranks}
