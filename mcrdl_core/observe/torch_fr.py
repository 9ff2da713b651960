"""The flight recorder's dump also in torch's flight-recorder format, for ``torchfrtrace``.

``write(data, json_path)`` (called by ``recorder.dump`` once ``rank-N.json`` is written)
turns this rank's snapshot into the dict that torch's own flight recorder pickles
(``FlightRecorder::dump``, format version ``2.10``, what torch 2.13's
``torch.distributed.flight_recorder`` analyzer reads) and writes it, pickled, beside the
JSON as ``nccl_trace_rank_N``: the name torch's dumps take by default
(``TORCH_FR_DUMP_TEMP_FILE=/tmp/nccl_trace_rank_``), whatever the backend, so that

    torchfrtrace DIR --prefix nccl_trace_rank_

reads the job's dumps (without ``--prefix`` it infers the common prefix of the files whose
names end in digits, these ones: ``rank-N.json`` does not end in one). Written to a temporary
name without that prefix and renamed, like the JSON; plain dicts, lists, strings and
numbers only (no torch here: the core stays framework-free). Never raises: an error is one
line on stderr and None.

How MCR-DL's fields become torch's:

- a group is a process group: its MCR-DL key is the pg name, its name the pg desc, its
  global ranks the pg's ranks (``pg_config``); ``pg_id`` is its place in the dump;
- ``collective_seq_id`` is the group's collective sequence number (the same on every
  member, as torch's), ``p2p_seq_id`` a point-to-point call's own count;
  ``record_id`` the entry's place in this rank's ring (0 = the oldest kept);
- ``profiling_name`` is ``BACKEND:OP`` with torch's op names (``all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``reduce``,
  ``gather``, ``scatter``, ``barrier``; ``send 0->1``, ``recv 1<-0`` in group ranks).
  The analyzer accepts only the prefixes of torch's backends: ``nccl`` and ``gloo`` are
  kept, MCR-DL's ``mpi`` and any other backend are written as ``gloo`` (torch's host
  backend; the real name is in ``rank-N.json``);
- sizes are one tensor's shape per list, as torch records a flat tensor: ``[[count]]``;
  all_gather's output ``[[count * group size]]``, reduce_scatter's input likewise;
  gather's output at its root only; an all-to-all's input and output are the sums of its
  split counts (``[[sum]]``: the analyzer checks that the group's totals agree);
  dtypes by torch's names (``Float``, ``Half``, ``BFloat16``, ``Long``...);
- states: ``completed`` stays ``completed``; ``issued`` (handed to the backend, not yet
  done) is ``started``; ``timed out`` and ``failed`` are ``started`` too: the call began
  and never completed, which is where torch's own entry stays when its watchdog gives
  up (the error's text is in ``rank-N.json``). ``lowered`` JAX calls (no sequence number,
  run by XLA, not by MCR-DL) are left out;
- ``time_created_ns`` and ``time_discovered_started_ns`` are the call's issue time,
  ``time_discovered_completed_ns`` its end where known (wall clock, ns); ``retired`` is
  ``completed``; ``timeout_ms`` is ``MCRDL_TIMEOUT``; ``frames`` the caller's frame.

What torch's analyzer cannot see: a ring that has wrapped (the dump holds
``MCRDL_TRACE_ENTRIES`` calls) starts at a different call on each rank, and the analyzer
aligns ranks by ``record_id``, which is per process in torch too, so it may report the
oldest calls as missing; ``mcrdl trace`` aligns by sequence number. Point-to-point calls
are left out (``convert(..., p2p=True)`` keeps them): torchfrtrace pairs a send with its
receive only inside a coalesced group (``batch_isend_irecv``), and takes a lone send that
shares its collective_seq_id with the collective before it for the end of such a group;
given a send after an all_reduce on a group of 3 ranks, torch 2.13's analyzer stops with
``AssertionError: can't get dst of non-p2p op``. ``mcrdl trace`` reports them.
"""
from __future__ import annotations

import os
import pickle
import sys

from ..base import config as _config

#: torch's default dump file prefix (TORCH_FR_DUMP_TEMP_FILE's last part)
PREFIX = "nccl_trace_rank_"
#: FlightRecorder.hpp's version_val in torch 2.13
VERSION = "2.10"
#: backends whose names torch's analyzer accepts as a profiling name's prefix
_TORCH_BACKENDS = {"nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl"}
#: MCR-DL dtype name -> c10::toString(ScalarType)
DTYPES = {"float16": "Half", "bfloat16": "BFloat16", "float32": "Float", "float64": "Double",
          "int8": "Char", "int16": "Short", "int32": "Int", "int64": "Long", "uint8": "Byte",
          "bool": "Bool", "complex64": "ComplexFloat", "complex128": "ComplexDouble"}
_STATES = {"completed": "completed", "issued": "started", "timed out": "started",
           "failed": "started"}


def path_of(json_path: str, rank: int) -> str:
    """Where the torch-format dump of ``rank`` goes, beside ``json_path``."""
    return os.path.join(os.path.dirname(os.path.abspath(json_path)), f"{PREFIX}{rank}")


def write(data: dict, json_path: str) -> str | None:
    """Write ``data`` (``recorder.snapshot``'s dict) beside ``json_path`` in torch's
    format; return the path written, or None. Never raises."""
    tmp = None
    try:
        out = convert(data)
        path = path_of(json_path, int(data["rank"]))
        tmp = os.path.join(os.path.dirname(path), f".torch-fr.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(out, f, protocol=4)
        os.replace(tmp, path)
        return path
    except Exception as exc:  # the dump must not hide the fault it records
        print(f"mcrdl: rank {data.get('rank', '?') if isinstance(data, dict) else '?'}: "
              f"could not write the torch-format flight-recorder dump "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return None


def _ns(t) -> int | None:
    return None if t is None else int(round(t * 1e9))


def _frames(frame) -> list:
    """"file:line in function" -> torch's [{name, filename, line}]."""
    if not frame:
        return []
    where, _, name = frame.partition(" in ")
    filename, _, line = where.rpartition(":")
    try:
        return [{"name": name, "filename": filename, "line": int(line)}]
    except ValueError:
        return [{"name": name, "filename": where, "line": 0}]


def _sizes(e: dict, size: int, group_rank: int) -> tuple:
    """(input sizes, output sizes) of one entry, torch's way."""
    op, count = e["op"], e.get("count")
    if count is None:
        count = 0
    if op == "all_gather":
        return [[count]], [[count * size]]
    if op == "reduce_scatter":
        return [[count * size]], [[count]]
    if op == "gather":
        return [[count]], ([[count * size]] if e.get("root") == group_rank else [])
    if op == "scatter":
        return ([[count * size]] if e.get("root") == group_rank else []), [[count]]
    if op == "all_to_all":
        counts = e.get("counts") or e.get("splits")
        if counts and len(counts) == 2 and counts[0] is not None and counts[1] is not None:
            return [[sum(counts[1])]], [[sum(counts[0])]]  # (output counts, input counts)
        return [[count]], [[count]]
    if op == "send":
        return [[count]], []
    if op == "recv":
        return [], [[count]]
    return [[count]], [[count]]


def convert(data: dict, p2p: bool = False) -> dict:
    """``data`` as torch's flight recorder dumps it (the dict before pickling)."""
    rank = int(data["rank"])
    groups = data.get("groups") or {}
    pg_ids = {key: i for i, key in enumerate(groups)}
    timeout_ms = int(_config.get("MCRDL_TIMEOUT") * 1000)
    pg_config, pg_status = {}, {}
    for key, g in groups.items():
        desc = str(g.get("name") or key)
        pg_config[key] = {"name": key, "desc": desc,
                          "ranks": "[" + ", ".join(str(int(r)) for r in g["ranks"]) + "]"}
    entries, op_ids = [], {}
    last = {key: [0, 0] for key in groups}  # last started, last completed collective
    for e in data.get("entries") or ():
        key = e.get("group")
        if e.get("seq") is None or key not in groups:
            continue  # a lowered JAX call; a group this rank no longer knows
        is_p2p = bool(e.get("p2p"))
        if is_p2p and not p2p:
            continue
        state = _STATES.get(e.get("state"), "scheduled")
        g = groups[key]
        ranks = list(g["ranks"])
        me = ranks.index(rank) if rank in ranks else 0
        backend = str(e.get("backend") or "")
        prefix = backend if backend in _TORCH_BACKENDS else "gloo"
        name = e["op"]
        if is_p2p:
            peer = e.get("peer")
            peer = -1 if peer is None else int(peer)
            name = f"send {me}->{peer}" if e["op"] == "send" else f"recv {me}<-{peer}"
        ins, outs = _sizes(e, len(ranks), me)
        dtype = DTYPES.get(e.get("dtype"), str(e.get("dtype")))
        dtypes = [] if e.get("dtype") is None else [dtype]
        op_ids[key] = op_ids.get(key, 0) + 1
        seq = int(e["seq"])
        if not is_p2p:
            if state != "scheduled":
                last[key][0] = max(last[key][0], seq)
            if state == "completed":
                last[key][1] = max(last[key][1], seq)
        t_issue, t_end = e.get("t_issue"), e.get("t_end")
        entry = {
            "record_id": len(entries), "pg_id": pg_ids[key],
            "process_group": (key, str(g.get("name") or key)),
            "collective_seq_id": last[key][0] if is_p2p else seq,
            "p2p_seq_id": seq if is_p2p else 0, "op_id": op_ids[key],
            "profiling_name": f"{prefix}:{name}",
            "time_created_ns": _ns(t_issue) or 0,
            "input_sizes": ins, "input_dtypes": dtypes if ins else [],
            "output_sizes": outs, "output_dtypes": dtypes if outs else [],
            "state": state,
            "time_discovered_started_ns": None if state == "scheduled" else _ns(t_issue),
            "time_discovered_completed_ns": _ns(t_end) if state == "completed" else None,
            "retired": state == "completed", "timeout_ms": timeout_ms, "is_p2p": is_p2p,
            "frames": _frames(e.get("frame")),
        }
        if t_issue is not None and t_end is not None:
            entry["duration_ms"] = float(max(0.0, (t_end - t_issue) * 1e3))
        entries.append(entry)
    for key, g in groups.items():
        pg_status[str(pg_ids[key])] = {"last_enqueued_collective": int(g.get("calls") or 0),
                                       "last_started_collective": last[key][0],
                                       "last_completed_collective": last[key][1]}
    return {"version": VERSION, "pg_config": pg_config, "pg_status": pg_status,
            "comm_lib_version": "mcrdl", "entries": entries,
            "mcrdl": {"job": data.get("job"), "rank": rank, "reason": data.get("reason")}}
