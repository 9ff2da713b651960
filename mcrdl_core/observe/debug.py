"""Debug mode (MCRDL_DEBUG=1): compare a collective's arguments across ranks first.

Before each collective every member contributes a small int64 signature (op, backend,
dtype, device, reduce op, root, per-rank element count, the compression spec of a
compressed call (codec, block, algorithm, chunks), the algorithm that takes the call
over where one does (``hier``, asked for or the tuning table's; else the flat
collective) and, for all-to-all, its split counts, and, for calls traced under a JIT,
the array shape). The signatures are all-gathered on a control backend (MPI when available,
else Gloo) that does not depend on what the call chose, so every rank sees the same
table and raises the same MismatchError naming the ranks that differ, instead of
hanging or corrupting memory. Point-to-point calls are not checked (only two ranks
take part; a mismatch there is reported by the timeout).

The signature also carries the call's *role*: a label that frameworks set around the
calls they issue on the user's behalf (the JAX frontend: "backward of all_reduce"
inside a derivative rule; plain calls are "call"). Two ranks whose n-th collectives
are the same op but play different roles (one rank's backward call met by another
rank's next forward call, when only some ranks differentiate through a collective)
are reported instead of exchanging wrong data.
"""
from __future__ import annotations

import contextlib
import contextvars
import zlib

import numpy as np

from ..base import dtypes as _dt
from ..world.backend import REGISTRY
from ..memory.buffer import Buffer
from ..base.errors import MismatchError
from ..base.ops import Op, ReduceOp
from .observer import Observer

_OPS = list(Op)
_REDUCE = list(ReduceOp)
_FIELDS = ("op", "backend", "dtype", "device", "reduce op", "root", "elements per rank",
           "role", "compression", "algorithm")
_ROLE = contextvars.ContextVar("mcrdl_debug_role", default="call")
_ROLE_NAMES = {}  # code -> label, for messages


def declare_role(name: str) -> int:
    """Make a role's label known to this process (so that a message can name it even if
    only another rank used it); returns its code, the same on every rank."""
    code = zlib.crc32(name.encode())
    _ROLE_NAMES[code] = name
    return code


_role_code = declare_role
#: code -> name of the algorithms a call may run instead of the backend's collective
#: (the signature's ``algorithm``), for messages: the flat collective and the two-level
#: one are known to every rank, whichever it ran; others as they are seen
_ALGORITHM_NAMES = {zlib.crc32(n.encode()): n for n in ("flat", "hier", "takeover")}


def _algorithm_code(name: str) -> int:
    code = zlib.crc32(name.encode())
    _ALGORITHM_NAMES.setdefault(code, name)
    return code

_SPEC_WORDS = 4  # the spec's text travels too (32 bytes), so messages can quote it


def _spec_code(spec: str) -> int:
    """A code for a compressed call's spec (codec, block, algorithm, chunks), the same on
    every rank; "none" for a call that is not compressed."""
    return zlib.crc32(spec.encode())


def _spec_words(spec: str) -> list:
    raw = spec.encode()[:8 * _SPEC_WORDS].ljust(8 * _SPEC_WORDS, b"\0")
    return np.frombuffer(raw, dtype=np.int64).tolist()


def _spec_text(row) -> str:
    return np.asarray(row[-_SPEC_WORDS:], np.int64).tobytes().rstrip(b"\0").decode(errors="replace")


@contextlib.contextmanager
def role(name: str):
    """Label the collectives issued inside the block (``"backward of all_reduce"``);
    debug mode compares the label across ranks. Declare labels up front
    (``declare_role``) so that every rank's messages can name them."""
    token = _ROLE.set(name)
    try:
        yield
    finally:
        _ROLE.reset(token)


def current_role() -> str:
    return _ROLE.get()


def _backend_names():
    return sorted(REGISTRY)


_MAX_DIMS = 8  # shapes of up to this many dimensions are compared dimension by dimension


def _encode_shape(shape):
    if shape is None:
        return [-1] * (_MAX_DIMS + 1)
    dims = list(shape)[:_MAX_DIMS]
    return [len(shape)] + dims + [-1] * (_MAX_DIMS - len(dims))


def _decode_shape(part):
    ndim = int(part[0])
    return "unchecked" if ndim < 0 else str(tuple(int(d) for d in part[1:1 + min(ndim, _MAX_DIMS)]))


def _encode(op, backend, dtype, device, reduce_op, root, count, counts, n, shape=None,
            role_name="call", compression="none", algorithm="flat"):
    head = [_OPS.index(op), _backend_names().index(backend), _dt.ALL.index(dtype),
            0 if device.kind == "cpu" else 1, -1 if reduce_op is None else _REDUCE.index(reduce_op),
            -1 if root is None else root, -1 if count is None else count,
            _role_code(role_name), _spec_code(compression), _algorithm_code(algorithm)]
    tail = [0] * (2 * n)
    if counts is not None:
        out_counts, in_counts = counts
        tail = list(out_counts) + list(in_counts)
    return np.array(head + tail + _encode_shape(shape) + _spec_words(compression),
                    dtype=np.int64)


def _decode(row, field):
    i = _FIELDS.index(field)
    v = int(row[i])
    return {
        "op": lambda: _OPS[v].value,
        "backend": lambda: _backend_names()[v],
        "dtype": lambda: _dt.ALL[v].name,
        "device": lambda: ("cpu", "cuda")[v],
        "reduce op": lambda: "-" if v < 0 else _REDUCE[v].name,
        "role": lambda: repr(_ROLE_NAMES.get(v, f"#{v}")),
        "compression": lambda: repr(_spec_text(row)),
        "algorithm": lambda: repr(_ALGORITHM_NAMES.get(v, f"#{v}")),
    }.get(field, lambda: v)()


def check(rt, group, op, backend, buf, *, reduce_op=None, root=None, count=None, counts=None,
          shape=None, role_name=None, compression: str = "none", algorithm: str = "flat"):
    """``shape``: also compare the array shape (the JAX frontend passes it for traced
    calls, where a shape that differs between ranks would otherwise hang or corrupt).
    ``role_name``: the call's role (default: the innermost ``role()`` block's label).
    ``compression``: a compressed call's spec as text (codec with its block, algorithm,
    chunks), so that ranks that compress differently are reported too. ``algorithm``:
    what runs the call instead of the backend's collective ("hier": the two-level
    algorithm, asked for or the table's), "flat" for the collective itself; compared
    whatever the topology: where hosts make the call two-level, one rank's two-level
    steps and another's flat collective never match (a hang), and where they do not
    the same program would hang on a machine where they do."""
    n = group.size
    if n == 1:
        return
    mine = _encode(op, backend.name, buf.dtype, buf.device, reduce_op, root, count, counts, n,
                   shape, current_role() if role_name is None else role_name, compression,
                   algorithm)
    ctrl = rt.backend("mpi" if rt.unavailable_reason("mpi") is None else "gloo")
    inp = Buffer.from_numpy(mine)
    table = np.zeros((n, mine.size), dtype=np.int64)
    rt.engine.wait([ctrl.all_gather(group, Buffer.from_numpy(table), inp)])
    problems = []
    for r in range(1, n):
        for j, field in enumerate(_FIELDS):
            if table[r, j] != table[0, j]:
                problems.append(f"group rank {r} (global {group.ranks[r]}) has {field} "
                                f"{_decode(table[r], field)} where group rank 0 has "
                                f"{_decode(table[0], field)}")
    shapes = table[:, -(_MAX_DIMS + 1 + _SPEC_WORDS):-_SPEC_WORDS]
    for r in range(1, n):
        if (shapes[r] != shapes[0]).any():
            problems.append(f"group rank {r} (global {group.ranks[r]}) has shape "
                            f"{_decode_shape(shapes[r])} where group rank 0 has shape "
                            f"{_decode_shape(shapes[0])}")
    if counts is not None:
        h = len(_FIELDS)
        out_m, in_m = table[:, h:h + n], table[:, h + n:]
        for i in range(n):
            for j in range(n):
                if in_m[i, j] != out_m[j, i]:
                    problems.append(f"group rank {i} sends {in_m[i, j]} elements to group rank "
                                    f"{j}, which expects {out_m[j, i]}")
    if problems:
        hint = ""
        if (table[:, _FIELDS.index("role")] != table[0, _FIELDS.index("role")]).any():
            hint = (" The roles differ: one rank's backward call met another rank's next "
                    "call, which happens under jax.grad when only some ranks' objectives "
                    "depend on a collective's output (those ranks skip its backward call). "
                    "Make every rank's objective depend on the same collectives, e.g. add "
                    "0 * jnp.sum(y) for an output y that a rank does not use.")
        raise MismatchError(f"mcrdl debug: {op} on {group.describe()} called inconsistently: "
                            + "; ".join(problems[:8]) + ". Make every rank pass the same "
                            "shape, dtype, root and backend (and ask for hier on all or none)."
                            + hint)


class DebugChecks(Observer):
    """The debug checks as an observer: ``check`` before every collective."""

    def before(self, rt, group, op, backend, buf, **signature) -> None:
        check(rt, group, op, backend, buf, **signature)


#: what ``hooks.observer("debug")`` hands the runtime (MCRDL_DEBUG=1, ``rt.debug = True``)
OBSERVER = DebugChecks()
