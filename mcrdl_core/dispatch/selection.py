"""Which backend runs a call (``decide``): explicit argument > MCRDL_BACKEND > tuning table
> policy; and the tuning tables it reads.

Tuning table (JSON, never pickle)::

    {"schema": "mcrdl.tuning/2",
     "machine": {"host": "...", "hosts": [...], ...},  # where it was measured
     "entries": [{"op": "all_reduce", "world_size": 4, "hosts": 2, "device": "cpu",
                  "dtype_class": "float",
                  "ranges": [[4096, "mpi"], [null, "gloo"]]}]}

Entries are keyed by op, ranks (``world_size``: the group's size) and ``hosts`` (how
many hosts those ranks span: 4 ranks on one host and 4 ranks on 2 hosts are different
machines to a backend), device and dtype class. ``ranges`` is sorted by
``max_bytes``; a message of ``b`` bytes takes the first range with ``b <= max_bytes``
(``null`` = no upper bound), found by bisect. A lookup miss (other op, ranks, hosts,
device or a size past the last bound) falls back to the policy. Tables of schema 1
(before entries knew hosts; every one was measured on a single host) are still read:
their entries count as ``"hosts": 1``; ``mcrdl tune`` rewrites them as schema 2.

Compressed variants (``mcrdl tune --compression fp16,int8``) add an optional field to
the entries of all_gather, reduce_scatter and all_reduce::

    "compressed": {"codecs": ["fp16", "int8"], "margin": 1.1,
                   "ranges": [[131072, []], [null, ["mpi+int8@ring", "gloo+fp16@ring"]]]}

``codecs``: the codecs that were measured; each range lists the variants
(``BACKEND+CODEC@ALGORITHM``) that beat the fastest plain backend of ``ranges`` by at
least ``margin`` at those sizes, fastest first (empty: no compression pays there).
``ranges`` above stays what an uncompressed call uses. An entry without the field (every
table written before, or tuned without ``--compression``) means: nothing measured about
compression. Readers that predate the field ignore it. A call uses the field only if it
allows compression (mcrdl_core/compress/auto.py, docs/compression.md).

Two more optional fields per entry, written by ``mcrdl tune`` (mcrdl_core/tools/tuning.py
says how a table is decided; docs/tuning.md why)::

    "measured": {"sizes": [4, 8, ...], "rounds": [200, 200, ...],
                 "median_s": {"mpi": [...], "gloo": [...]}},
    "verification": {"when": "2025-01-01T12:00:00", "margin": 0.05,
                     "points": [{"bytes": 4096, "auto": "gloo", "auto_s": 5.1e-05,
                                 "single_s": {"gloo": 5.0e-05, "mpi": 9.8e-05},
                                 "rounds": 120, "verdict": "ok", "against": null,
                                 "ratio": null}, ...]}

``measured``: the sizes the ranges were decided from, the paired rounds per size and each
backend's median (seconds). ``verification``: auto (through this table; ``auto`` names
the backend it ran) measured against every single backend side by side at the sizes
listed; ``verdict`` "lost" means a single backend (``against``; ``ratio``: its median
paired time over auto's) was faster by the tuner's margin with confidence, "unsure"
that it may be. A range holding a lost point on the backend it names (other than the
policy's) is **not used**: lookups there fall back to the policy, with a warning when
the table is loaded (``range_status``). The machine block may hold ``"load"``: what the
tuning run saw of other load on its hosts (sweep.py's ``LoadWatch``).

The message size used for lookup is the per-rank payload, the same on every rank so
that every rank picks the same backend: the buffer for all_reduce, broadcast, reduce,
send/recv; the input for all_gather, gather and even all_to_all; the output for
reduce_scatter and scatter. Uneven all_to_all sizes differ per rank, so it uses the
largest range listed for the op (documented, rank-consistent). A table tuned for one
dtype class ("float" or "int") also serves the other if that has no entry of its own.

Policy without a table: CUDA buffers prefer nccl, then mpi, then gloo; host buffers
prefer mpi, then gloo (MPI's shared-memory transport is the faster of the two on one
node in ``make demo``'s measurements); the first backend that is available and can do
the op/dtype wins. So CUDA buffers fall through to mpi (staged or CUDA-aware) when NCCL
cannot run (no GPU, a GPU shared by several ranks, no NCCL library: every rank of a
homogeneous job gets the same verdict) and for what NCCL lacks (bitwise reductions,
any-source receives are refused by it at call time). ``mcrdl tune --device cuda``
measures nccl as one more backend and writes entries with ``"device": "cuda"``.
"""
from __future__ import annotations

import bisect
import json
import logging
import math
import os
import platform
import socket
from importlib import metadata

from ..base import config as _config
from ..base import exact as _exact
from ..base.dtypes import dtype_class
from ..base.errors import InvalidArgumentError, TableError, UnsupportedError
from ..base.ops import Op, ReduceOp
from ..memory.buffer import as_buffer
from . import hooks as _hooks
from . import validate as _v

log = logging.getLogger("mcrdl.selection")

SCHEMA = "mcrdl.tuning/2"
SCHEMA_V1 = "mcrdl.tuning/1"  # read (entries without "hosts": one host), never written
POLICY = {"cuda": ("nccl", "mpi", "gloo"), "cpu": ("mpi", "gloo")}
#: table names that are algorithms over the backends, not backends: ``hier`` (the
#: two-level all-reduce and all-to-all, ``mcrdl_core.algorithms.hier``), which
#: ``mcrdl tune`` measures as a lossless candidate where ranks share hosts
ALGORITHMS = ("hier",)
VERDICTS = ("ok", "lost", "unsure")


def decide(rt, op, group, device, dtype, reduce_op, backend, nbytes):
    """The Backend instance of ``rt`` for a call: the one the user named (refused with
    the backends that can, where it cannot run the call), else the tuning table's for
    this op, group, dtype class and size where it can, else the first of the policy
    that can. ``Runtime.select`` memoizes what this returns."""
    return decide_why(rt, op, group, device, dtype, reduce_op, backend, nbytes)[0]


def named_why(rt, op, group, requested) -> str | None:
    """Which rule named the backend of a call whose ``backend=`` was ``requested``
    (before the group's default replaced None), as ``Runtime.named_backend`` decides:
    the call, the group's default, MCRDL_BACKEND; None where nobody named one."""
    if requested not in (None, "auto"):
        return f"explicit: backend={requested!r}"
    if requested is None and group.backend not in (None, "auto"):
        return f"group default: backend={group.backend!r} of {group.describe()}"
    if op.value in rt.override:
        return f"MCRDL_BACKEND: {op.value}={rt.override[op.value]}"
    if "*" in rt.override:
        return f"MCRDL_BACKEND={rt.override['*']}"
    return None


def table_range(table, op: str, world_size: int, device: str, dtype_class: str,
                nbytes, hosts: int = 1):
    """Where a tuning table's lookup lands: (entry, lo, hi or None, name the table gives
    there, or None where its verification lost there) with ``entry`` a short text of
    the entry's key; None where it has no entry or the size is past its last range."""
    hit = _either_class(table.index, op, world_size, hosts, device, dtype_class)
    if hit is None:
        return None
    bounds, names = hit
    i = len(names) - 1 if nbytes is None else bisect.bisect_left(bounds, nbytes)
    if i >= len(names):
        return None
    lo = 0 if i == 0 else int(bounds[i - 1]) + 1
    hi = None if bounds[i] == float("inf") else int(bounds[i])
    entry = (f"{op} {world_size} ranks {hosts} host{'s' if hosts > 1 else ''} {device} "
             f"{dtype_class}")
    return entry, lo, hi, names[i]


def table_why(rt, op, group, device, dtype, nbytes) -> tuple:
    """(name the tuning table gives the call or None, text of its entry and range)."""
    where = table_range(rt.table, op.value, group.size, device.kind, dtype_class(dtype),
                        nbytes, rt.bootstrap.hosts_in(group.ranks))
    if where is None:
        return None, f"table {rt.table.path} has no range for {op.value} at {group.size} ranks"
    entry, lo, hi, name = where
    text = f"table {rt.table.path}: {entry}, range {fmt_bytes(lo)}-{fmt_bytes(hi)}"
    if name is None:
        return None, text + " (not used: its verification lost there)"
    return name, text


def decide_why(rt, op, group, device, dtype, reduce_op, backend, nbytes, requested=-1):
    """``decide``'s Backend instance and the rule that chose it, as one line:
    ``explicit``, ``group default``, ``MCRDL_BACKEND``, ``table`` (its file, entry and
    range) or ``policy`` (and why the table did not decide, where there is one).
    ``requested``: the call's own ``backend=`` (-1: the same as ``backend``)."""
    name = rt.named_backend(op, group, backend)
    if name is not None:
        be = rt.backend(name)
        reason = be.unsupported_reason(op, device, dtype, reduce_op)
        if reason:
            raise UnsupportedError(f"{reason}. Backends that can: "
                                   f"{capable(rt, op, device, dtype, reduce_op)}")
        why = named_why(rt, op, group, backend if requested == -1 else requested)
        return be, why or f"explicit: backend={name!r}"
    note = ""
    if rt.table is not None:
        hit, text = table_why(rt, op, group, device, dtype, nbytes)
        if hit is not None and not is_algorithm(hit) and runnable(rt, hit, op, device, dtype,
                                                                  reduce_op):
            return rt.backend(hit), text
        note = (f" ({text}: {hit!r} cannot run this call here)" if hit is not None
                and not is_algorithm(hit) else f" ({text})" if hit is None else
                f" ({text}: algorithm {hit!r})")
    names = capable(rt, op, device, dtype, reduce_op)
    if not names:
        raise UnsupportedError(
            f"no available backend can do {op} on {dtype.name} {device.kind} buffers"
            f"{f' with {reduce_op.name}' if reduce_op else ''}; availability: "
            f"{rt.available_backends()}")
    return rt.backend(names[0]), (f"policy: {device.kind} buffers prefer "
                                  f"{', '.join(POLICY.get(device.kind, ()))}; {names[0]} is the "
                                  f"first that can run it here{note}")


def compression_for(compression, op, rt, g, backend, buf, reduce_op=None):
    """The compression allowed for a call (``compression=``, then MCRDL_COMPRESSION),
    checked against its dtype and reduce op; None also where an ``auto:`` spec keeps the
    backend's own collective (``pipeline.compression_for`` is this, after its cheaper
    test of the variable)."""
    if compression is None and not _config.is_set("MCRDL_COMPRESSION"):
        return None
    if _exact.active():  # mcrdl_core.exact(): no codec (a checkpoint, a state dict)
        return None
    t = _hooks.transform("compression")
    cz = t.resolve(compression, op, buf.dtype, reduce_op)
    return None if t.keeps_plain(cz, rt, g, op, buf, backend) else cz


_REDUCING = (Op.ALL_REDUCE, Op.REDUCE, Op.REDUCE_SCATTER)
_CODECS = (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL)


def explain(rt, op, buffer, group=None, backend=None, reduce_op=None, compression=None):
    """``Runtime.explain``: the backend, algorithm and codec a call would get and the
    rule that chose them, without sending anything: ``{"op", "group", "bytes",
    "backend", "algorithm", "codec", "rule", "table"}``, ``table`` being where the
    tuning table's lookup lands (``path``, ``entry``, ``range`` [lo, hi or None] in
    bytes, the ``name`` it gives there, whether it ``decides`` the call) or None.
    ``op``: an Op or its name; ``buffer``: what the call would be given (its dtype,
    device and size decide; all_gather's input, reduce_scatter's output, as selection
    sizes them); ``reduce_op`` defaults to SUM for reductions. Raises what the call
    would raise where the named backend cannot run it."""
    try:
        op = op if isinstance(op, Op) else Op(op)
    except ValueError:
        raise InvalidArgumentError(f"explain: unknown op {op!r}; one of "
                                   f"{[o.value for o in Op]}") from None
    buf = as_buffer(buffer)
    g = rt.group(group)
    if reduce_op is None and op in _REDUCING:
        reduce_op = ReduceOp.SUM
    red = None if reduce_op is None else ReduceOp.coerce(reduce_op)
    if red is not None:
        _v.reduce_op(red, buf.dtype)
    hier = str(backend).partition(":")[0] == "hier"
    request = (backend.partition(":")[2] or None) if hier else backend
    be, rule = rt.select(op, g, buf, request, red, why=True)
    out = {"op": op.value, "group": g.describe(), "bytes": buf.nbytes, "backend": be.name,
           "algorithm": None, "codec": None, "rule": rule, "table": None}
    if hier:
        out["algorithm"] = "hier"
        out["rule"] = (f"explicit: backend={backend!r} (the two-level algorithm; its steps "
                       f"choose their own backends: {rule})")
    name = algorithm(rt, op, g, buf, backend, reduce_op=red)
    if name is not None and op in (Op.ALL_REDUCE, Op.ALL_TO_ALL):
        out["algorithm"] = name
        out["rule"] = table_why(rt, op, g, buf.device, buf.dtype, buf.nbytes)[1] + \
            f": algorithm {name!r}"
    if rt.table is not None:
        where = table_range(rt.table, op.value, g.size, buf.device.kind,
                            dtype_class(buf.dtype), buf.nbytes,
                            rt.bootstrap.hosts_in(g.ranks))
        if where is not None:
            entry, lo, hi, tname = where
            out["table"] = {"path": rt.table.path, "entry": entry, "range": [lo, hi],
                            "name": tname, "decides": rt.table_decides(op, g, backend)}
    if op in _CODECS:
        cz = compression_for(compression, op, rt, g, backend, buf, red)
        if cz is not None:
            out["codec"] = str(cz)
            out["rule"] += (f"; codec {cz} by "
                            + ("compression=" if compression is not None
                               else "MCRDL_COMPRESSION"))
    return out


def is_algorithm(name: str) -> bool:
    """True for a table name that is an algorithm (``hier``, ``hier:mpi``)."""
    return name.partition(":")[0] in ALGORITHMS


def runnable(rt, name: str, op, device, dtype, reduce_op=None) -> bool:
    """Whether a name a tuning table gives can run the call here: a backend that is
    available and can do the op on these buffers; an algorithm (``hier``) whose steps
    choose their own backends; ``hier:NAME`` where NAME is such a backend. A table name
    that cannot is not used: the policy decides (a table tuned where a backend could run
    serves a job where it cannot, whatever the name). The same on every rank of a
    homogeneous job, as availability is."""
    head, colon, inner = name.partition(":")
    if head in ALGORITHMS:
        if not colon:
            return True
        name = inner
    return (rt.unavailable_reason(name) is None
            and rt.backend(name).unsupported_reason(op, device, dtype, reduce_op) is None)


def algorithm(rt, op, group, buf, backend, nbytes=-1, reduce_op=None) -> str | None:
    """The tuning table's choice for a call where it names an algorithm (``hier``)
    instead of a backend that can run it (``runnable``), else None: also where the call
    names a backend (argument, group default, MCRDL_BACKEND: ``Runtime.table_decides``)
    or there is no table. The api's all-reduce and even all-to-all then run that
    algorithm, whose steps select their own backends."""
    if rt.table is None or not rt.table_decides(op, group, backend):
        return None
    hit = rt.table.lookup(op.value, group.size, buf.device.kind, dtype_class(buf.dtype),
                          buf.nbytes if nbytes == -1 else nbytes,
                          rt.bootstrap.hosts_in(group.ranks))
    if hit is None or not is_algorithm(hit):
        return None
    return hit if runnable(rt, hit, op, buf.device, buf.dtype, reduce_op) else None


def capable(rt, op, device, dtype, reduce_op) -> list:
    """The available backends of the policy, in its order, that can run the call."""
    names = [n for n in POLICY.get(device.kind, ()) if rt.unavailable_reason(n) is None]
    return [n for n in names
            if rt.backend(n).unsupported_reason(op, device, dtype, reduce_op) is None]


def fmt_bytes(b) -> str:
    """4096 -> "4 KiB", 1000 -> "1000 B", None -> "inf" (a range's open end)."""
    if b is None:
        return "inf"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


#: the entries a send or a receive is looked up in, in this order, the same for both:
#: the two ends of one message must pick one backend whatever the table holds
#: (``mcrdl tune`` writes its "send" and "recv" entries alike; a hand-made table, or one
#: with a "send" entry for one dtype class only, may not, and ends that looked up their
#: own op used two libraries for one message and hung)
_P2P_KEYS = ("send", "recv")


def _either_class(index: dict, op, world_size, hosts, device, dtype_class):
    """``index``'s value for the key, else for the same key of the other dtype class (a
    table tuned for one class serves the other where it has no entry of its own). A
    send and a receive both take the first of ``_P2P_KEYS`` the table has."""
    other = "int" if dtype_class == "float" else "float"
    for name in (_P2P_KEYS if op in _P2P_KEYS else (op,)):
        for cls in (dtype_class, other):
            hit = index.get((name, world_size, hosts, device, cls))
            if hit is not None:
                return hit
    return None


def _range_of(bounds: list, nbytes: int) -> int:
    return bisect.bisect_left(bounds, nbytes)


def backend_at(ranges: list, nbytes: int) -> str | None:
    """The backend an entry's raw ``ranges`` name for ``nbytes`` (None past the last)."""
    bounds = [m if m is not None else float("inf") for m, _ in ranges]
    i = _range_of(bounds, nbytes)
    return ranges[i][1] if i < len(ranges) else None


def range_status(ranges: list, points: list, policy: str) -> list[str]:
    """Per range of an entry, what its verification ``points`` say: "unverified" (no
    point measured its backend there), "ok", "lost" (a point there found a single
    backend faster than the range's backend, and the policy's backend faster than it
    too, or not measured: the range is not used, the policy decides there) or "missed"
    (a faster backend exists, but the range's backend is the policy's, or measured
    faster than the policy's there: falling back to the policy would be slower, so the
    range stays). The second case is a loss to auto's own path (auto slower than the
    very backend it ran) or to a third backend: an H200 run tuned barrier on CUDA
    buffers to mpi (10 µs), lost by 2 µs to mpi itself, and the policy's nccl took
    89 µs."""
    bounds = [m if m is not None else float("inf") for m, _ in ranges]
    status = ["unverified"] * len(ranges)
    for p in points:
        j = _range_of(bounds, p["bytes"])
        b = ranges[j][1] if j < len(ranges) else None
        if b is None or p["auto"] != b:
            continue  # a point of an older decision there
        if p["verdict"] == "lost":
            single = p.get("single_s", {})
            slower = policy not in single or b not in single or single[policy] < single[b]
            status[j] = "lost" if b != policy and slower else "missed"
        elif status[j] == "unverified":
            status[j] = "ok"
    return status


class TuningTable:
    """A validated, indexed tuning table."""

    def __init__(self, data: dict, path: str = "<dict>", warn: bool = True):
        """Validate and index ``data``. ``warn``: log a warning for each range that its
        verification found slower than a single backend (the policy is used there)."""
        self.path = path
        self.data = data
        self.index: dict = {}
        self.compressed: dict = {}  # key -> (codecs, bounds, [[(backend, codec, algo)]])
        self.verified: dict = {}  # key -> (bounds, names, [verification points by bytes])
        self.lost: list[str] = []  # one line per range not used (verification lost)
        self._validate_and_index()
        if warn and self.lost:
            log.warning("tuning table %s: its verification found these ranges slower than a "
                        "single backend; the policy is used there instead: %s. Re-tune them "
                        "(mcrdl tune --ops OP --sizes SIZES, docs/tuning.md)", path,
                        "; ".join(self.lost))

    def _fail(self, reason: str):
        raise TableError(f"tuning table {self.path}: {reason}; rebuild it with the tuning "
                         "suite or remove it (MCRDL_TUNING_TABLE) to use the default policy")

    def _validate_and_index(self):
        d = self.data
        if not isinstance(d, dict):
            self._fail("top level must be a JSON object")
        if d.get("schema") not in (SCHEMA, SCHEMA_V1):
            self._fail(f"schema is {d.get('schema')!r}, expected {SCHEMA!r} (or the older "
                       f"{SCHEMA_V1!r})")
        v1 = d["schema"] == SCHEMA_V1
        entries = d.get("entries")
        if not isinstance(entries, list):
            self._fail("'entries' must be a list")
        for i, e in enumerate(entries):
            where = f"entry {i}"
            if not isinstance(e, dict):
                self._fail(f"{where} is not an object")
            for k, typ in (("op", str), ("world_size", int), ("device", str),
                           ("dtype_class", str), ("ranges", list)):
                if not isinstance(e.get(k), typ):
                    self._fail(f"{where}: field {k!r} missing or not a {typ.__name__}")
            hosts = 1 if v1 else e.get("hosts")
            if not isinstance(hosts, int) or not 1 <= hosts <= max(e["world_size"], 1):
                self._fail(f"{where}: field 'hosts' missing or not a host count between 1 "
                           f"and its world_size")
            maxes, names = [], []
            for j, r in enumerate(e["ranges"]):
                if (not isinstance(r, list) or len(r) != 2 or not isinstance(r[1], str)
                        or not (r[0] is None or isinstance(r[0], int))):
                    self._fail(f"{where} range {j}: expected [max_bytes or null, backend]")
                if maxes and (maxes[-1] is None or (r[0] is not None and r[0] <= maxes[-1])):
                    self._fail(f"{where} range {j}: max_bytes must increase, null only last")
                maxes.append(r[0])
                names.append(r[1])
            if not maxes:
                self._fail(f"{where}: no ranges")
            key = (e["op"], e["world_size"], hosts, e["device"], e["dtype_class"])
            bounds = [m if m is not None else float("inf") for m in maxes]
            if e.get("measured") is not None:
                self._measured(e["measured"], where)
            points = self._verification(e.get("verification"), where)
            used = list(names)
            status = range_status(e["ranges"], points, POLICY.get(e["device"], ("",))[0])
            lo = 0
            for j, st in enumerate(status):
                if st == "lost":
                    used[j] = None
                    p = next(p for p in points if p["verdict"] == "lost"
                             and _range_of(bounds, p["bytes"]) == j)
                    self.lost.append(f"{e['op']} n={e['world_size']} hosts={hosts} "
                                     f"{e['device']} {fmt_bytes(lo)}–{fmt_bytes(maxes[j])} on "
                                     f"{names[j]} (slower than {p['against']})")
                lo = (maxes[j] or 0) + 1
            self.index[key] = (bounds, used)
            if points:
                self.verified[key] = (bounds, names, sorted(points, key=lambda p: p["bytes"]))
            if "compressed" in e:
                self.compressed[key] = self._compressed(e["compressed"], where)

    def _measured(self, m, where: str) -> None:
        """Validate an entry's "measured" field (format: module docstring)."""
        if not isinstance(m, dict) or not isinstance(m.get("sizes"), list) or \
                not all(isinstance(x, int) for x in m["sizes"]) or \
                not isinstance(m.get("median_s", {}), dict):
            self._fail(f"{where}: 'measured' must hold 'sizes' (a list of byte counts) and "
                       "'median_s'")

    def _verification(self, v, where: str) -> list:
        """Validate an entry's "verification" field; its points (empty without it)."""
        if v is None:
            return []
        if not isinstance(v, dict) or not isinstance(v.get("points"), list):
            self._fail(f"{where}: 'verification' must be an object with a 'points' list")
        for j, p in enumerate(v["points"]):
            if (not isinstance(p, dict) or not isinstance(p.get("bytes"), int)
                    or not isinstance(p.get("auto"), str)
                    or not isinstance(p.get("auto_s"), (int, float))
                    or not isinstance(p.get("single_s"), dict)
                    or p.get("verdict") not in VERDICTS):
                self._fail(f"{where} verification point {j}: expected bytes, auto, auto_s, "
                           f"single_s and a verdict in {VERDICTS}")
            if p["verdict"] != "ok" and not isinstance(p.get("against"), str):
                self._fail(f"{where} verification point {j}: a {p['verdict']!r} verdict "
                           "names the backend it was against ('against')")
        return v["points"]

    def verified_figure(self, op: str, world_size: int, device: str, dtype_class: str,
                        nbytes: int, backend: str, hosts: int = 1):
        """The verification's figure (seconds) for ``backend`` at a message of ``nbytes``,
        and the bounds (lo, hi or None) of the range holding it; None when the range has
        no verified figure for it. Inside the range it is interpolated between the two
        verified sizes around ``nbytes`` (log-log), or taken from the nearest one when
        that is at most 2x away."""
        hit = _either_class(self.verified, op, world_size, hosts, device, dtype_class)
        if hit is None:
            return None
        bounds, _, points = hit
        j = _range_of(bounds, nbytes)
        if j >= len(bounds):
            return None
        pts = [(p["bytes"], p["single_s"][backend]) for p in points
               if _range_of(bounds, p["bytes"]) == j and backend in p["single_s"]]
        if not pts:
            return None
        lo = 0 if j == 0 else bounds[j - 1] + 1
        rng = (lo, None if bounds[j] == float("inf") else bounds[j])
        below = [q for q in pts if q[0] <= nbytes]
        above = [q for q in pts if q[0] >= nbytes]
        if below and above:
            (b0, t0), (b1, t1) = below[-1], above[0]
            if b0 == b1 or b0 <= 0 or t0 <= 0 or t1 <= 0:
                return t0, rng
            w = (math.log(max(nbytes, 1)) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))), rng
        b, t = (below[-1] if below else above[0])
        if max(b, 1) * 2 >= max(nbytes, 1) and max(nbytes, 1) * 2 >= max(b, 1):
            return t, rng
        return None

    def _compressed(self, c, where: str) -> tuple:
        """Validate and index one entry's "compressed" field (format: module docstring)."""
        if not isinstance(c, dict) or not isinstance(c.get("ranges"), list) or \
                not isinstance(c.get("codecs"), list) or \
                not all(isinstance(x, str) and x for x in c["codecs"]):
            self._fail(f"{where}: 'compressed' must hold 'codecs' (a list of codec names) and "
                       "'ranges'")
        maxes, lists = [], []
        for j, r in enumerate(c["ranges"]):
            if (not isinstance(r, list) or len(r) != 2 or not isinstance(r[1], list)
                    or not (r[0] is None or isinstance(r[0], int))):
                self._fail(f"{where} compressed range {j}: expected [max_bytes or null, "
                           "[variant, ...]]")
            if maxes and (maxes[-1] is None or (r[0] is not None and r[0] <= maxes[-1])):
                self._fail(f"{where} compressed range {j}: max_bytes must increase, null only "
                           "last")
            variants = []
            for v in r[1]:
                backend, _, rest = v.partition("+") if isinstance(v, str) else ("", "", "")
                codec, _, algo = rest.partition("@")
                if not (backend and codec and algo):
                    self._fail(f"{where} compressed range {j}: variant {v!r} is not "
                               "'BACKEND+CODEC@ALGORITHM'")
                variants.append((backend, codec, algo))
            maxes.append(r[0])
            lists.append(tuple(variants))
        if not maxes:
            self._fail(f"{where}: 'compressed' has no ranges")
        bounds = [m if m is not None else float("inf") for m in maxes]
        return tuple(c["codecs"]), bounds, lists

    @classmethod
    def load(cls, path: str) -> "TuningTable":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise TableError(f"tuning table {path}: cannot read it ({exc.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TableError(f"tuning table {path}: not valid JSON ({exc}); rebuild it with "
                             "the tuning suite") from None
        return cls(data, path)

    def lookup(self, op: str, world_size: int, device: str, dtype_class: str,
               nbytes: int | None, hosts: int = 1) -> str | None:
        """Backend name, or None on a miss, for ``world_size`` ranks on ``hosts`` hosts.
        ``nbytes=None`` takes the largest range. A table tuned for one dtype class serves
        the other when it has no entry of its own (moving bytes costs the same; barrier
        is keyed "int")."""
        hit = _either_class(self.index, op, world_size, hosts, device, dtype_class)
        if hit is None:
            return None
        bounds, names = hit
        if nbytes is None:
            return names[-1]
        i = bisect.bisect_left(bounds, nbytes)
        return names[i] if i < len(names) else None

    def bounds(self, op: str, world_size: int, device: str, dtype_class: str,
               hosts: int = 1) -> list | None:
        """The upper bounds (bytes, inclusive; inf last where the entry is open-ended) of
        the ranges ``lookup`` picks from for this key, or None where the table has no
        entry for it (then the policy decides, whatever the size). Two sizes with the
        same ``bisect_left`` index into them get the same answer from ``lookup``."""
        hit = _either_class(self.index, op, world_size, hosts, device, dtype_class)
        return None if hit is None else hit[0]

    def lookup_compressed(self, op: str, world_size: int, device: str, dtype_class: str,
                          nbytes: int | None, hosts: int = 1):
        """``(codecs measured, variants)`` for a message of ``nbytes`` (None: the largest
        range), variants as (backend, codec, algorithm) fastest first, only those that
        beat the plain backends there; None when the entry holds nothing about
        compression (no such entry, or tuned without ``--compression``). Exact dtype
        class only: the variants were measured on float32."""
        hit = self.compressed.get((op, world_size, hosts, device, dtype_class))
        if hit is None:
            return None
        codecs, bounds, lists = hit
        i = len(lists) - 1 if nbytes is None else bisect.bisect_left(bounds, nbytes)
        return (codecs, lists[i]) if i < len(lists) else None


def parse_override(text: str | None) -> dict:
    """MCRDL_BACKEND: 'mpi' (every op) or 'all_reduce=gloo,all_to_all=mpi'."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        op, eq, name = part.partition("=")
        if eq:
            out[op.strip()] = name.strip()
        else:
            out["*"] = part
    # one backend for both ends of a message: a send's choice is its receive's
    ends = {out[k] for k in _P2P_KEYS if k in out}
    if len(ends) > 1:
        raise TableError(f"MCRDL_BACKEND={text!r} names send={out['send']} and "
                         f"recv={out['recv']}: both ends of a message must use one backend; "
                         "name it once (send=NAME applies to receives too)")
    if ends:
        out["send"] = out["recv"] = ends.pop()
    return out


def table_from_env() -> TuningTable | None:
    """The table in force at start-up: MCRDL_TUNING_TABLE if set, else the default
    location if a file is there (``default_path``). A malformed file, or one
    measured on another machine, is warned about (naming the file) and not used: the
    run continues on the policy. ``MCRDL_TUNING_TABLE=none`` disables tables."""
    explicit = _config.get("MCRDL_TUNING_TABLE")
    if explicit and explicit.lower() == "none":
        return None
    path = default_path()
    if not explicit and not os.path.exists(path):
        return None
    try:
        table = TuningTable.load(path)
    except TableError as exc:
        log.warning("%s -- continuing with the default policy", exc)
        return None
    diff = machine_differences(table.data.get("machine", {}), fingerprint())
    if diff:
        log.warning("tuning table %s was measured on another machine (differs in %s); not "
                    "using it -- continuing with the default policy. Re-run the tuning suite "
                    "here (mcrdl tune).", path, ", ".join(diff))
        return None
    return table


# --- where a table belongs ----------------------------------------------------------------
def default_path() -> str:
    """$MCRDL_TUNING_TABLE, else $XDG_CACHE_HOME/mcrdl/tuning.json (~/.cache/...)."""
    if _config.get("MCRDL_TUNING_TABLE"):
        return _config.get("MCRDL_TUNING_TABLE")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mcrdl", "tuning.json")


def machine_name() -> str:
    """This machine's name: the host name, except on an emulated cluster, whose hosts
    are all the one real machine (``MCRDL_CLUSTER_MACHINE``, set by ``mcrdl cluster``)."""
    return _config.get("MCRDL_CLUSTER_MACHINE") or socket.gethostname()


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


def link_class() -> str | None:
    """What the links between hosts are, where the job can tell: the rate an emulated
    cluster gives its links (``MCRDL_CLUSTER_RATE``, e.g. "1gbit"); None otherwise (one
    host, or real hosts, whose links MCR-DL does not measure). Crossovers between
    backends move with it, so a table is only used under the links it was tuned on."""
    return _config.get("MCRDL_CLUSTER_RATE") if _config.get("MCRDL_CLUSTER") else None


def fingerprint(hosts=None) -> dict:
    """What makes a table valid: machine, CPU model, core count, library versions, the
    links' class (``link_class``); with ``hosts`` (the hosts of the job that measured
    it) also those, so that every node of a real multi-host job accepts the table its
    rank 0 wrote."""
    fp = {"host": machine_name(), "cpu": _cpu_model(), "cores": os.cpu_count(),
          "mpich": _version("mpich"), "mpi4py": _version("mpi4py"), "torch": _version("torch"),
          "link": link_class()}
    if hosts and list(hosts) != [fp["host"]]:
        fp["hosts"] = sorted(set(hosts))
    return fp


def machine_differences(table_machine: dict, here: dict) -> list[str]:
    """Fields of ``here`` (this machine's fingerprint) that do not fit the machine a
    table was measured on (empty if the table fits). The host fits when it is the
    table's host or one of the hosts of the job that measured it."""
    diff = [k for k in ("cpu", "cores", "mpich", "torch") if table_machine.get(k) != here.get(k)]
    if here.get("host") != table_machine.get("host") and \
            here.get("host") not in table_machine.get("hosts", ()):
        diff.insert(0, "host")
    if table_machine.get("link") != here.get("link"):
        diff.append(f"links: tuned on {table_machine.get('link') or 'one host / unknown links'}, "
                    f"this job has {here.get('link') or 'one host / unknown links'}")
    return diff
