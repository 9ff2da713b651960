"""Every ``MCRDL_*`` environment variable, declared once: name, type, default, help.

Modules read their settings through :func:`get` (or :func:`flag`), never from
``os.environ`` directly, so every variable is parsed one way: a value that does not
parse raises :class:`~mcrdl_core.base.errors.InvalidArgumentError` naming the variable and
the values it accepts (``MCRDL_COMM_LOG=on`` used to be ignored silently while
``MCRDL_DEBUG=on`` worked). The README's configuration table is generated from these
declarations (``python -m mcrdl_core.base.config``) and a test checks that the two agree.

Values are read from the environment at each call, so a test or a launcher that sets a
variable later is honoured; the callers that sit on a hot path keep their own memo of
the raw text (``fastpath.env_value``) and parse only when it changes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from .errors import InvalidArgumentError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"one of {', '.join(_TRUE + _FALSE)}")


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number") from None
    if value < 0:
        raise ValueError("a number >= 0")
    return value


def _at_least(minimum: int) -> Callable[[str], int]:
    """An integer parser that accepts ``minimum`` and above."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("an integer") from None
        if value < minimum:
            raise ValueError(f"an integer >= {minimum}")
        return value
    return parse


_int = _at_least(1)
_count = _at_least(0)


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in names:
            raise ValueError(f"one of {', '.join(names)}")
        return low
    return parse


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class Var:
    """One variable: ``parse`` turns its text into a value or raises ValueError with
    what it accepts; ``default`` is the value when unset (None: "not set")."""

    name: str
    kind: str  # as the README's table says it
    default: object
    shown_default: str
    help: str
    parse: Callable[[str], object] = _text


VARS: dict[str, Var] = {v.name: v for v in (
    Var("MCRDL_BACKEND", "backend name, or `op=backend,...`", None, "unset",
        "backend of calls that name none and whose group has no default (`send=` also "
        "applies to receives: both ends of a message use one backend)"),
    Var("MCRDL_TUNING_TABLE", "path, or `none`", None,
        "`$XDG_CACHE_HOME/mcrdl/tuning.json` (`~/.cache/...`)",
        "tuning table read at start-up and written by `mcrdl tune`; `none` disables tables; "
        "a bad or foreign file warns and is ignored"),
    Var("MCRDL_TIMEOUT", "float, seconds", 300.0, "`300`",
        "longest any wait for peers may take before `CommTimeoutError` (an explicit "
        "timeout of the call or group wins)", _float),
    Var("MCRDL_DEBUG", "bool", False, "off",
        "compare shapes, dtypes, roots, splits, compression and backend across ranks before "
        "each collective; name the rank that differs", _bool),
    Var("MCRDL_BOOTSTRAP", "`auto`, `mpi` or `env`", "auto", "`auto`",
        "how ranks find each other: MPI, or torchrun's variables; `auto` looks at the "
        "launcher's environment", _choice("auto", "mpi", "env")),
    Var("MCRDL_RANKS_PER_HOST", "int >= 1", None, "unset (the real hosts)",
        "pretend that every k consecutive ranks share a host (which ranks the hierarchical "
        "algorithms group): to test them on one machine", _int),
    Var("MCRDL_SPIN_US", "float, µs", 100.0, "`100`",
        "how long a wait spins before it yields the CPU (and the fast path polls)", _float),
    Var("MCRDL_MPI_FAST", "bool", True, "on",
        "small MPI calls issue and poll through the compiled module "
        "(`python -m mcrdl_backends.build`, run by `make install`) where it is built; off: "
        "through mpi4py", _bool),
    Var("MCRDL_CODEC_KERNELS", "bool", True, "on",
        "the int8, fp8 and fp16 codecs encode and decode float32 host arrays through the "
        "compiled kernels (`python -m mcrdl_core.tools.build_codecs`, run by `make "
        "install`) where they are built; off: through NumPy/torch (the same bytes)", _bool),
    Var("MCRDL_COMM_LOG", "bool", False, "off",
        "turn the comm logger on ([docs/logger.md](docs/logger.md))", _bool),
    Var("MCRDL_MPI_CUDA_AWARE", "bool", None, "asked of the library",
        "whether the MPI library takes device pointers", _bool),
    Var("MCRDL_NCCL_PRECONNECT", "bool", None, "on for groups of up to 16 ranks",
        "open NCCL's point-to-point connections when a communicator is made", _bool),
    Var("MCRDL_COMPRESSION", "codec spec, or `op=spec,...`", None, "unset (off)",
        "allow a lossy codec on all-gather, reduce-scatter and all-reduce "
        "([docs/compression.md](docs/compression.md))"),
    Var("MCRDL_COMPRESSION_CHUNKS", "int >= 1", None, "by size (at most 8)",
        "pipeline depth of the compressed algorithms", _int),
    Var("MCRDL_RESHARD_LINK", "path (JSON)", None, "built-in link model",
        "link model the resharding planner predicts with (written by `bench/resharding.py`)"),
    Var("MCRDL_RESHARD_SEGMENT", "int, bytes", None, "n/8 in [64 KiB, 1 MiB]",
        "segment size of resharding's chain broadcasts", _int),
    Var("MCRDL_JAX_MPI4JAX", "bool", True, "on",
        "under `jax.jit`, MPI calls lower to mpi4jax's primitives, which block inside MPI "
        "with no timeout; off: they run in MCR-DL's host callback, under `MCRDL_TIMEOUT` "
        "with its diagnostics", _bool),
    Var("MCRDL_TRACE_ENTRIES", "int >= 0", 4096, "`4096`",
        "calls the flight recorder keeps per process (a ring; `0` turns it off) and dumps "
        "on a fault ([docs/reliability.md](docs/reliability.md))", _count),
    Var("MCRDL_TRACE_DIR", "path", None, "`$TMPDIR/mcrdl-trace-JOB`",
        "where each rank writes its flight-recorder dump (`rank-N.json`), read by "
        "`mcrdl trace DIR`"),
    Var("MCRDL_TRACE_STACK", "bool", False, "off",
        "the flight recorder also keeps the calling Python frame of each call (a few µs "
        "more a call)", _bool),
    Var("MCRDL_EXIT_GUARD", "bool", True, "on",
        "after a fault, leave by `os._exit` instead of a normal exit that can hang in "
        "`MPI_Finalize`", _bool),
    Var("MCRDL_FAULT_GRACE_S", "float, seconds", 5.0, "`5`",
        "time helper threads of timed-out work get before the exit guard acts", _float),
    Var("MCRDL_CLUSTER", "string", None, "set by `mcrdl cluster run`",
        "name of the emulated cluster the program runs on"),
    Var("MCRDL_CLUSTER_HOST", "string", None, "set by `mcrdl cluster run`",
        "this rank's emulated host"),
    Var("MCRDL_CLUSTER_HOSTS", "comma-separated list", None, "set by `mcrdl cluster run`",
        "all emulated hosts"),
    Var("MCRDL_CLUSTER_RANKS_PER_HOST", "int", None, "set by `mcrdl cluster run`",
        "ranks per emulated host"),
    Var("MCRDL_CLUSTER_RATE", "tc rate (`1gbit`)", None, "set by `mcrdl cluster run`",
        "link rate of the emulated hosts"),
    Var("MCRDL_CLUSTER_DELAY", "duration", None, "set by `mcrdl cluster run`",
        "one-way link delay of the emulated hosts"),
    Var("MCRDL_CLUSTER_MACHINE", "string", None,
        "set by `mcrdl cluster run`; else the host name",
        "the real machine, which tuning tables record as where they were measured"),
    Var("MCRDL_CLUSTER_STATE", "path", "/run/mcrdl/cluster", "`/run/mcrdl/cluster`",
        "where `mcrdl cluster` keeps the state of running clusters"),
)}


def declared(name: str) -> Var:
    var = VARS.get(name)
    if var is None:
        raise KeyError(f"{name} is not declared in mcrdl_core.base.config.VARS")
    return var


def get(name: str, default=None):
    """The parsed value of ``name`` (its declared default when unset or empty, or
    ``default`` when given). Raises InvalidArgumentError for a value that does not
    parse, naming the variable and what it accepts."""
    var = declared(name)
    text = os.environ.get(name)
    if text is None or not text.strip():
        return var.default if default is None else default
    try:
        return var.parse(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"{name}={text!r} is not valid: use {exc} "
                                   f"({var.help.split(';')[0]})") from None


def is_set(name: str) -> bool:
    """Whether ``name`` is set to something (its value is parsed, so a bad one raises)."""
    declared(name)
    if not (os.environ.get(name) or "").strip():
        return False
    get(name)
    return True


def flag(name: str) -> bool | None:
    """A bool variable: True/False when set, its default (maybe None) when not."""
    return get(name)


def markdown_table() -> str:
    """The README's configuration table (between its config-table markers)."""
    rows = ["| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
    for v in VARS.values():
        kind = v.kind if v.parse is not _bool else "bool (`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`)"
        rows.append(f"| `{v.name}` | {kind} | {v.shown_default} | {v.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
