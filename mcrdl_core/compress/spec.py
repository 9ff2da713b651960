"""What the user allowed (``compression=`` or ``MCRDL_COMPRESSION``) and the plan of one
compressed call: pure data, printable and testable without any communication.

Spelling of a compression spec (keyword argument or environment variable):

- ``"int8"``, ``"int8:512"`` (block size), ``"int4"``, ``"int4:64"``, ``"fp16"``,
  ``"fp16:4096"``, ``"bf16"``, ``"fp8"``, ``"fp8:256"`` (float8 e4m3 with block scales),
  ``"zfp:16"`` (zfp fixed rate, bits per value), ``"none"`` (the uncompressed ring, to
  compare against);
- optionally ``@ALGORITHM``: ``ring`` (default: the seed paper's collective
  compression), ``p2p`` (its baseline: encode and decode at every hop) or ``a2a`` (one
  backend call on the encoded bytes: all-to-all for reduce-scatter, ZeRO++ qgZ style;
  all-gather for all-gather, qwZ style);
- ``"auto:fp16+int8"``: these codecs where they pay (auto.py: from the tuning table's
  measurements when it has them, else a calibration at the first call); ``"table"``:
  the codecs ``mcrdl tune --compression`` measured, where the table says they win (and
  the backend's own collective wherever it holds no such measurement);
- or a :class:`Compression` object (``chunks=`` sets the pipeline depth).

``MCRDL_COMPRESSION`` gives the process default, for all three reducing/gathering ops
(``int8``) or per op (``all_gather=int8,reduce_scatter=fp16@a2a``; keys all_gather,
reduce_scatter, all_reduce, all_to_all). All-to-all is compressed only where named
(``all_to_all=fp8`` or the keyword): it carries activations and tokens (MoE dispatch,
DLRM embeddings), not the weights and gradients a job allows a bare spec for, so
a job that set ``MCRDL_COMPRESSION=int8`` for FSDP does not start compressing them.
All-to-all has one algorithm, ``a2a``: each destination's block encoded once and
decoded once by its receiver, moved by one tagged send per peer on host backends or one
backend all-to-all of the encoded bytes on NCCL (the default ``ring`` spelling means it
too, ``p2p`` is refused).
``MCRDL_COMPRESSION_CHUNKS`` sets the default pipeline depth. Off unless set: lossy
compression is never used unless allowed here or by the keyword.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..base import dtypes as _dt
from ..base import config as _config
from ..base.errors import DtypeError, InvalidArgumentError, UnsupportedError
from ..base.ops import Op, ReduceOp
from ..dispatch.fastpath import env_key, env_value
from . import codecs as _c

ALGORITHMS = ("ring", "p2p", "a2a")
OPS = {"all_gather": Op.ALL_GATHER, "reduce_scatter": Op.REDUCE_SCATTER,
       "all_reduce": Op.ALL_REDUCE, "all_to_all": Op.ALL_TO_ALL}
#: the ops a bare MCRDL_COMPRESSION spec (no ``op=`` key) applies to
BARE_OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE)
#: encoded bytes per chunk above which a block is split into pipelined chunks
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 8


@dataclass(frozen=True)
class Compression:
    """An allowed codec and the algorithm that uses it. ``chunks``: pieces per block,
    each encoded, sent and decoded on its own so that the codec of one overlaps the
    transfer of another (None: ring only; one piece below 2 MiB of
    encoded data, then one per MiB of it, at most 8)."""

    codec: str
    algorithm: str = "ring"
    chunks: int | None = None

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise InvalidArgumentError(f"compression algorithm {self.algorithm!r} is unknown; "
                                       f"use one of {list(ALGORITHMS)}")
        if self.chunks is not None and (not isinstance(self.chunks, int) or self.chunks < 1):
            raise InvalidArgumentError(f"compression chunks={self.chunks!r} must be a positive "
                                       "integer")
        make_codec(self.codec, "float32")  # fails early on an unknown codec or a missing zfpy

    def __str__(self) -> str:
        return f"{self.codec}@{self.algorithm}" + (f"*{self.chunks}" if self.chunks else "")


@dataclass(frozen=True)
class Auto:
    """The codecs auto selection may use (``compress.auto`` chooses among them) (nothing else is ever chosen); none named
    (``compression="table"``): those the tuning table measured."""

    codecs: tuple

    def __str__(self) -> str:
        return "auto:" + "+".join(self.codecs) if self.codecs else "table"



def parse(spec):
    """A Compression (or an auto.Auto) from a spec string or object; None for None, '',
    'off'."""
    if spec is None or isinstance(spec, Compression) or isinstance(spec, Auto):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"compression must be a string such as 'int8' or "
                                   f"'fp16@a2a', or a Compression, got {type(spec).__name__}")
    return _parse_text(spec, _config.get("MCRDL_COMPRESSION_CHUNKS"))


@functools.lru_cache(maxsize=256)
def _parse_text(spec: str, _chunks_env):
    """parse() of a string, memoized (per value of MCRDL_COMPRESSION_CHUNKS)."""
    text = spec.strip().lower()
    if text in ("", "off", "0", "false"):
        return None
    if text == "table":  # the codecs `mcrdl tune --compression` measured, where they won
        return Auto(())
    if text.startswith("auto"):
        codecs = tuple(c for c in text[5:].split("+") if c)
        if text[4:5] != ":" or not codecs:
            raise InvalidArgumentError(f"compression {spec!r}: name the codecs auto may use, "
                                       "e.g. 'auto:fp16+int8' (lossy codecs are never chosen "
                                       "unless named), or 'table' for those the tuning table "
                                       "recorded (mcrdl tune --compression)")
        for c in codecs:
            make_codec(c, "float32")
        return Auto(codecs)
    codec, _, algo = text.partition("@")
    return Compression(codec, algo or "ring", _env_chunks())


def _env_chunks() -> int | None:
    return _config.get("MCRDL_COMPRESSION_CHUNKS")


@functools.lru_cache(maxsize=8)
def _env_table(raw: str) -> dict:
    table = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        if not eq:
            table["*"] = parse(key)
            continue
        if key.strip() not in OPS:
            raise InvalidArgumentError(f"MCRDL_COMPRESSION: unknown op {key.strip()!r}; use "
                                       f"{sorted(OPS)} (or one spec for all of them)")
        table[key.strip()] = parse(value)
    return table


def env_default(op: Op) -> Compression | None:
    """The process default for ``op`` from MCRDL_COMPRESSION (None when unset)."""
    raw = _config.get("MCRDL_COMPRESSION")
    if not raw:
        return None
    table = _env_table(raw)
    return table.get(op.value, table.get("*") if op in BARE_OPS else None)


def resolve(compression, op: Op, dtype: _dt.DType, reduce_op: ReduceOp | None = None):
    """The Compression for one call (keyword first, then the environment), checked
    against the call's dtype and reduce op; None: no compression. Raises before anything
    is sent. Memoized per (spec, op, dtype, reduce op) when the spec is a string."""
    if compression is None or isinstance(compression, str):
        key = (compression, env_value(_SPEC), env_value(_CHUNKS), op, dtype, reduce_op)
        hit = _RESOLVED.get(key)
        if hit is None:
            if len(_RESOLVED) > 1024:
                _RESOLVED.clear()
            hit = _RESOLVED[key] = (_resolve(compression, op, dtype, reduce_op),)
        return hit[0]
    return _resolve(compression, op, dtype, reduce_op)


_RESOLVED: dict = {}
_SPEC, _CHUNKS = env_key("MCRDL_COMPRESSION"), env_key("MCRDL_COMPRESSION_CHUNKS")


def _resolve(compression, op: Op, dtype: _dt.DType, reduce_op):
    """An explicit codec refuses what it cannot compress; a process-wide setting (the
    environment: a whole FSDP/DDP job) and the "only where it pays" specs (``auto:``,
    ``table``) leave those calls plain instead, as users of one switch for a whole
    program expect (a MAX all-reduce of a gradient norm, an integer counter)."""
    cz = parse(compression) if compression is not None else env_default(op)
    if cz is None:
        return None
    lenient = compression is None or hasattr(cz, "codecs")
    for name in cz.codecs if hasattr(cz, "codecs") else (cz.codec,):
        if make_codec(name, dtype.name).lossy and not dtype.is_floating:
            if lenient:
                return None
            raise DtypeError(f"compression {name!r} is lossy and refuses {dtype.name} data; "
                             "pass compression=None (or 'none') for integer tensors")
    if op is Op.ALL_TO_ALL and getattr(cz, "algorithm", None) == "p2p":
        raise UnsupportedError(f"compressed all_to_all has one algorithm (a2a: each block "
                               f"encoded once for its destination), not {cz.algorithm!r}; "
                               f"pass compression={cz.codec!r}")
    if reduce_op is not None and reduce_op not in (ReduceOp.SUM, ReduceOp.AVG):
        if lenient:
            return None
        raise UnsupportedError(f"compressed {op} supports ReduceOp SUM and AVG, not "
                               f"{reduce_op.name}; pass compression=None for it")
    return cz


def work_dtype(dtype: _dt.DType) -> np.dtype:
    """The dtype arithmetic and codecs run in: float64 stays, other floats use float32,
    integers (uncompressed ring only) their own type."""
    if dtype is _dt.float64 or not dtype.is_floating:
        return dtype.np_dtype
    return np.dtype(np.float32)


@functools.lru_cache(maxsize=64)
def make_codec(name: str, dtype_name: str = "float32") -> _c.Codec:
    """The codec called ``name`` (see the module docstring) for data of ``dtype_name``."""
    kind, _, arg = name.partition(":")
    number = int(arg) if arg.isdigit() else None
    if kind == "none" and not arg:
        return _c.Identity(_dt.lookup(dtype_name).np_dtype)
    if kind == "bf16" and not arg:
        return _c.BF16()
    if kind in ("fp16", "int8", "int4", "fp8") and (number is not None or not arg):
        cls = {"fp16": _c.FP16, "int8": _c.Int8, "int4": _c.Int4, "fp8": _c.FP8}[kind]
        return cls(number) if arg else cls()
    if kind == "zfp" and number is not None:
        return _c.ZFP(number)
    raise InvalidArgumentError(f"unknown codec {name!r}; use int8[:BLOCK], int4[:BLOCK], "
                               "fp16[:BLOCK], fp8[:BLOCK], bf16, zfp:RATE or none")


#: ops whose compressed schedules carry partial sums between ranks
_REDUCING = (Op.REDUCE_SCATTER, Op.ALL_REDUCE)


def call_codec(name: str, op: Op, dtype: _dt.DType | str) -> _c.Codec:
    """The codec a compressed ``op`` on ``dtype`` data runs: ``make_codec(name)``, except
    that ``none`` carries the work dtype where partial sums travel (reduce-scatter,
    all-reduce): a 16-bit float's sums then accumulate in float32 and are rounded once,
    as the flat path's are (carried in float16, a partial sum of 40000 + 40000 was inf
    where the whole sum fits). The lossy codecs encode from the work dtype anyway."""
    dtype = _dt.lookup(dtype)
    if name == "none" and op in _REDUCING:
        return make_codec(name, work_dtype(dtype).name)
    return make_codec(name, dtype.name)


def align(codec: _c.Codec) -> int:
    """Chunk boundaries fall on multiples of this many elements, so that a chunked
    encoding holds the same bytes as an unchunked one."""
    return getattr(codec, "block", 4 if isinstance(codec, _c.ZFP) else 1)


@dataclass(frozen=True)
class Plan:
    """How one compressed call runs. ``count``: elements per rank's block; bytes are
    per rank's block; ``wire_bytes``: what each rank sends in all."""

    op: str
    algorithm: str
    codec: str
    group_size: int
    count: int
    dtype: str
    chunks: int
    chunk_counts: tuple
    raw_bytes: int
    encoded_bytes: int
    wire_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    def __str__(self) -> str:
        return (f"{self.op} {self.algorithm} codec={self.codec} P={self.group_size} "
                f"block={self.count} {self.dtype} ({self.raw_bytes} B -> {self.encoded_bytes} B, "
                f"ratio {self.ratio:.2f}) chunks={self.chunks} wire={self.wire_bytes} B/rank")


def plan(op: Op, cz: Compression, group_size: int, count: int,
         dtype: _dt.DType | str = "float32") -> Plan:
    """The plan of a compressed ``op`` of ``count`` elements per rank block (pure); for
    all-to-all, ``count`` is the block for each peer of an even call (uneven ones:
    ``plan_all_to_all``)."""
    dtype = _dt.lookup(dtype)
    codec = call_codec(cz.codec, op, dtype)
    enc = codec.encoded_nbytes(count)
    algorithm = "a2a" if op is Op.ALL_TO_ALL else cz.algorithm
    chunks = cz.chunks
    if chunks is None:
        chunks = 1 if algorithm != "ring" else max(1, min(MAX_CHUNKS, enc // CHUNK_BYTES))
    if algorithm == "a2a":
        chunks = 1
    step = -(-count // chunks) if chunks else count
    a = align(codec)
    step = max(a, -(-step // a) * a)
    counts = tuple(min(step, count - o) for o in range(0, count, step)) or (0,)
    enc_chunks = sum(codec.encoded_nbytes(c) for c in counts)
    hops = {Op.ALL_GATHER: group_size - 1, Op.REDUCE_SCATTER: group_size - 1,
            Op.ALL_REDUCE: 2 * (group_size - 1), Op.ALL_TO_ALL: group_size - 1}[op]
    return Plan(op.value, algorithm, codec.name, group_size, count, dtype.name, len(counts),
                counts, count * dtype.itemsize, enc_chunks, hops * enc_chunks)


@dataclass(frozen=True)
class A2APlan:
    """How one rank runs a compressed all-to-all (even or uneven): the element counts
    it sends to and receives from each group rank (the call's splits), and the bytes of
    their encodings that the backend's all-to-all moves. A codec's encoded size depends
    on the element count alone, so every rank computes its byte counts from the splits
    it already has and no sizes are exchanged. The own block is encoded and decoded
    locally (0 bytes on the wire), so it is the same round trip as every other block.
    ``exact``: where the group spans several hosts, True for the ranks on this rank's
    host (itself included): those blocks move as their raw bytes, since a codec only
    pays where bytes cross the network (empty: every block is encoded).
    ``raw_bytes``/``wire_bytes``: what this rank sends to the others, before and after
    encoding."""

    codec: str
    group_size: int
    rank: int
    dtype: str
    in_counts: tuple
    out_counts: tuple
    send_bytes: tuple
    recv_bytes: tuple
    raw_bytes: int
    exact: tuple = ()

    @property
    def wire_bytes(self) -> int:
        return sum(self.send_bytes)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def __str__(self) -> str:
        return (f"all_to_all a2a codec={self.codec} P={self.group_size} rank={self.rank} "
                f"{self.dtype} sends {sum(self.in_counts)} receives {sum(self.out_counts)} "
                f"elements ({self.raw_bytes} B -> {self.wire_bytes} B to the others, ratio "
                f"{self.ratio:.2f}; {sum(self.recv_bytes)} B in"
                + (f"; {sum(self.exact) - 1} same-host peer(s) exact)" if self.exact else ")"))


def plan_all_to_all(cz: Compression, group_size: int, rank: int, out_counts, in_counts,
                    dtype: _dt.DType | str = "float32", exact=()) -> A2APlan:
    """The plan of a compressed all-to-all on group rank ``rank`` (pure): ``in_counts[k]``
    elements go to rank k, ``out_counts[k]`` come from it; ``exact[k]``: rank k's block
    moves raw, in the work dtype (every rank passes the same host map, so sender and
    receiver agree on each block's size)."""
    dtype = _dt.lookup(dtype)
    codec = make_codec(cz.codec, dtype.name)
    ins, outs = tuple(int(c) for c in in_counts), tuple(int(c) for c in out_counts)
    exact = tuple(bool(e) for e in exact)
    if len(ins) != group_size or len(outs) != group_size:
        raise InvalidArgumentError(f"all_to_all plan: {len(ins)} input and {len(outs)} output "
                                   f"counts for a group of {group_size}; give one per rank")
    if len(exact) not in (0, group_size):
        raise InvalidArgumentError(f"all_to_all plan: {len(exact)} same-host flags for a group "
                                   f"of {group_size}; give one per rank, or none")
    wsize = work_dtype(dtype).itemsize

    def wire(k, c):
        return 0 if k == rank else c * wsize if exact and exact[k] else codec.encoded_nbytes(c)

    send = tuple(wire(k, c) for k, c in enumerate(ins))
    recv = tuple(wire(k, c) for k, c in enumerate(outs))
    return A2APlan(codec.name, group_size, rank, dtype.name, ins, outs, send, recv,
                   (sum(ins) - ins[rank]) * dtype.itemsize, exact)
