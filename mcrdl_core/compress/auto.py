"""``compression="auto:fp16+int8"``: compression allowed, used only where it pays.

The choice is made from measurements, the same on every rank of the group.

From the tuning table first. When the table in force (``MCRDL_TUNING_TABLE``) holds
compressed measurements for the call's key (op, ranks, hosts, device, float) -- written
by ``mcrdl tune --compression CODECS`` -- and those cover every codec the call allows,
the call takes the first variant listed for its size (fastest first, each already
faster than every plain backend) whose codec it allows and whose backend can run here
(an explicit ``backend=``, the group's default or ``MCRDL_BACKEND`` restricts the
variants to that backend); none: the plain collective. Every rank reads the same file,
so every rank makes the same choice; nothing is calibrated. ``compression="table"``
(an Auto naming no codec) allows exactly the codecs the table measured, and without
such measurements is the plain collective.

Otherwise a calibration. At the first auto call on a (group, backend), every rank times (best of 3) the backend's own
all-gather and reduce-scatter and the ring variant of each allowed codec, at two sizes
per rank (``CAL_SIZES``: 64 KiB and 2 MiB of float32). The figures are reduced with MAX
over the group, so every rank holds the same ones and makes the same choice (a rank
choosing another algorithm than its peers would hang), and fitted per (op, variant) as
``t(bytes) = alpha + beta * bytes``: alpha is the fixed cost (latency, Python
scheduling), beta the inverse of the rate (link and codec together). A call of at least
``MIN_BYTES`` per rank's block then uses
the codec predicted fastest for its size only if it is predicted at least ``MARGIN``
times faster than the plain collective, *and* if the codec's own throughput allows
that gain at all: each codec's encode + decode of 2 MiB is timed locally too (``kappa``,
s/byte), and with the plain collective's measured cost per byte ``beta`` and the
codec's ratio ``c``, even perfect overlap gains at most ``beta / max(beta / c, kappa)``
(the issue's min(c, T/B) bound); that must reach MARGIN as well. This second rule keeps
a noisy calibration (a load spike during the plain collective's timing) from choosing
compression where the link is faster than the codec, as on one host. All-reduce is
predicted as reduce-scatter plus all-gather. The calibration costs a few dozen
collectives, once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..base.dtypes import dtype_class, float32
from ..base.ops import Op
from ..dispatch import api
from ..dispatch.runtime import get_runtime
from .spec import ALGORITHMS, Auto, Compression, make_codec, parse

log = logging.getLogger("mcrdl.compress")

CAL_SIZES = (64 << 10, 2 << 20)  # bytes per rank's block
MARGIN = 1.25
#: blocks smaller than this are never compressed: there the fixed costs (a few message
#: steps of the Python ring) dominate, and on a busy host the small-size calibration
#: point is too noisy to trust (it once picked fp16 for 64 KiB at 10 Gbit/s: 0.5x)
MIN_BYTES = 256 << 10
_CALIBRATION = "compress.calibration"  # Runtime.cache names: per runtime, dropped by
_DECIDED = "compress.decided"  # destroy() (their keys hold group ids)
_OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER)


@dataclass(frozen=True)
class Calibration:
    """Fits per (op, variant), variant 'plain' or a codec name: (alpha s, beta s/byte),
    with bytes the size of one rank's block."""

    group_size: int
    fits: dict
    kappa: dict = None  # codec -> encode + decode seconds per byte (None: not measured)

    @classmethod
    def from_times(cls, group_size: int, times: dict, codec_s: dict | None = None):
        """``times[(op, variant)] = (t at CAL_SIZES[0], t at CAL_SIZES[1])`` in seconds;
        ``codec_s[codec]``: encode + decode seconds of CAL_SIZES[1] bytes."""
        (s0, s1), fits = CAL_SIZES, {}
        for key, (t0, t1) in times.items():
            beta = max(t1 - t0, 0.0) / (s1 - s0)
            fits[key] = (max(t0 - beta * s0, 0.0), beta)
        kappa = {c: t / s1 for c, t in codec_s.items()} if codec_s else None
        return cls(group_size, fits, kappa)

    def bound(self, op: Op, codec: str) -> float:
        """The most compression can gain here with perfect overlap: wire time / max(wire
        time / ratio, codec time), per byte; inf when the codec was not timed."""
        if not self.kappa:
            return float("inf")
        beta = min(self.fits[(o.value, "plain")][1]
                   for o in (_OPS if op is Op.ALL_REDUCE else (op,)))
        ratio = make_codec(codec).ratio(CAL_SIZES[1] // 4)
        return beta / max(beta / ratio, self.kappa[codec], 1e-30)

    def predict(self, op: Op, variant: str, nbytes: int) -> float:
        """Seconds for a block of ``nbytes`` per rank (all-reduce: RS + AG)."""
        ops = _OPS if op is Op.ALL_REDUCE else (op,)
        return sum(self.fits[(o.value, variant)][0] + self.fits[(o.value, variant)][1] * nbytes
                   for o in ops)

    @property
    def codecs(self) -> list:
        return sorted({v for _, v in self.fits if v != "plain"})


def _best(fn, reps: int = 3) -> float:
    fn()  # warm: buffers, communicators, codec caches
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_interleaved(calls, reps: int = 5) -> list:
    """Best of ``reps`` seconds per call, the calls taking turns round by round, so that
    a burst of load on the host falls on all of them alike."""
    for fn in calls:
        fn()  # warm
    best = [float("inf")] * len(calls)
    for _ in range(reps):
        for i, fn in enumerate(calls):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def calibrate(rt, group, backend: str | None, codecs) -> Calibration:
    """Measure (once per group, backend and codec set) and agree across the group."""
    key = (group.id, backend, tuple(codecs))
    cache = rt.cache(_CALIBRATION)
    cal = cache.get(key)
    if cal is not None:
        return cal
    P = group.size
    variants = ["off"] + [Compression(c, "ring") for c in codecs]
    keys, figures = [], []
    for nbytes in CAL_SIZES:
        n = nbytes // 4
        x = np.random.default_rng(0).standard_normal(P * n).astype(np.float32)
        out = np.empty(P * n, np.float32)
        calls = []
        for cz in variants:  # "off", not None: MCRDL_COMPRESSION must not apply here
            calls.append(lambda cz=cz: api.all_gather_into_tensor(
                out, x[:n], group=group, backend=backend, compression=cz))
            calls.append(lambda cz=cz: api.reduce_scatter_tensor(
                out[:n], x, group=group, backend=backend, compression=cz))
            name = "plain" if cz == "off" else cz.codec
            keys += [(Op.ALL_GATHER.value, name), (Op.REDUCE_SCATTER.value, name)]
        figures += _best_interleaved(calls)
    n = CAL_SIZES[1] // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    for name in codecs:  # the codec alone, on this rank: no communication
        codec = make_codec(name)
        enc, dec = np.empty(codec.encoded_nbytes(n), np.uint8), np.empty(n, np.float32)
        figures.append(_best(lambda: (codec.encode(x, enc), codec.decode(enc, dec))))
    agreed = np.array(figures, np.float64)
    api.all_reduce(agreed, op="max", group=group, backend=backend, compression="off")
    half = len(keys) // 2
    times = {k: (float(agreed[i]), float(agreed[half + i])) for i, k in enumerate(keys[:half])}
    codec_s = {c: float(agreed[len(keys) + i]) for i, c in enumerate(codecs)}
    cal = cache[key] = Calibration.from_times(P, times, codec_s)
    log.info("auto compression calibration on %s via %s (s at %s B per rank): %s; codecs "
             "alone (s per %d B): %s", group.describe(), backend, CAL_SIZES, times,
             CAL_SIZES[1], codec_s)
    return cal


def decide(cal: Calibration, op: Op, count: int, itemsize: int = 4) -> Compression | None:
    """Pure: the codec predicted fastest for blocks of ``count`` elements, if at least
    MARGIN x faster than the plain collective; else None."""
    nbytes = count * itemsize
    if nbytes < MIN_BYTES:
        return None
    plain = cal.predict(op, "plain", nbytes)
    best = min(cal.codecs, key=lambda c: cal.predict(op, c, nbytes))
    if cal.predict(op, best, nbytes) * MARGIN > plain or cal.bound(op, best) < MARGIN:
        return None
    return Compression(best, "ring")


def choose(auto: Auto, rt, group, op: Op, count: int, dtype, backend: str | None,
           nbytes: int | None = None, device: str = "cpu"):
    """``(Compression or None, backend)`` for this call: None for the plain collective
    (``backend`` returned as given); a tuning-table choice also names the backend its
    variant was measured on. ``count``: elements per rank's block; ``nbytes``: the
    selection size (selection.py: the per-rank payload; all-reduce's whole buffer),
    from ``count`` if None. ``device``: the buffers' device kind."""
    if group.size == 1 or count == 0:
        return None, backend
    if nbytes is None:  # all-reduce: the buffer is P blocks
        nbytes = count * dtype.itemsize * (group.size if op is Op.ALL_REDUCE else 1)
    table = getattr(rt, "table", None)
    override = getattr(rt, "override", None)
    key = (group.id, backend, auto.codecs, op, count, dtype, nbytes, device, table,
           frozenset(override.items()) if override else None)
    decided = rt.cache(_DECIDED)
    hit = decided.get(key)
    if hit is None:
        if len(decided) > 4096:
            decided.clear()
        hit = from_table(auto, rt, group, op, nbytes, device, dtype, backend)
        if hit is MISS:
            if not auto.codecs:  # "table": only what the table measured
                hit = (None, backend)
            else:
                cal = calibrate(rt, group, backend, auto.codecs)
                hit = (decide(cal, op, count, dtype.itemsize), backend)
        decided[key] = hit
    return hit



def keeps_plain(cz, rt, group, op: Op, buf, backend) -> bool:
    """True when ``cz`` is an auto spec that keeps this call on the backend's own
    collective (the usual answer on fast links): the api then takes its ordinary path
    at once instead of entering the compressed entry to learn the same. ``buf``: the
    per-rank block (all-gather's input, reduce-scatter's output) or all-reduce's buffer.
    The decision is ``choose``'s, memoized, so the entry's own call agrees."""
    if not isinstance(cz, Auto) or op is Op.ALL_TO_ALL:
        return False  # all-to-all decides in the entry, where its splits are known
    count = -(-buf.numel // group.size) if op is Op.ALL_REDUCE else buf.numel
    return choose(cz, rt, group, op, count, buf.dtype, backend, buf.nbytes,
                  buf.device.kind)[0] is None
def choose_all_to_all(auto: Auto, rt, group, dtype, backend: str | None,
                      nbytes: int | None, device: str = "cpu"):
    """``(Compression or None, backend)`` for an all-to-all allowed ``auto``: from the
    tuning table's compressed measurements of all_to_all only (no calibration measures
    all-to-all yet), else the plain all-to-all. ``nbytes``: the plain call's selection
    size, the same on every rank (None for uneven splits: the table's largest range,
    as backends are selected), never a rank's own total, which differs between ranks
    of an uneven call and would split them between plain and compressed."""
    if group.size == 1:
        return None, backend
    hit = from_table(auto, rt, group, Op.ALL_TO_ALL, nbytes, device, dtype, backend)
    if hit is MISS:
        noted = rt.cache("compress.a2a_noted")
        if group.id not in noted:
            noted[group.id] = True
            log.info("compression %s on all_to_all of %s: the tuning table holds no "
                     "compressed all_to_all measurements for it (mcrdl tune --compression), "
                     "so the plain all-to-all runs; name a codec to compress regardless",
                     auto, group.describe())
        return None, backend
    return hit



#: from_table's answer when the table has nothing to say about this call
MISS = object()


def _canonical(codec: str) -> str:
    try:
        return make_codec(codec).name  # "int8" and "int8:256" are one codec
    except Exception:  # noqa: BLE001 -- a name this build cannot make is never chosen
        return "?" + codec


def from_table(auto: Auto, rt, group, op: Op, nbytes: int, device: str, dtype,
               backend: str | None):
    """Pure apart from reading ``rt``: ``MISS`` when the table holds no compressed
    measurements for this call (or not for every codec ``auto`` allows), else
    ``(Compression, backend)`` of the fastest listed variant the call may use, or
    ``(None, backend)``: plain."""
    table = getattr(rt, "table", None)
    if table is None or not hasattr(table, "lookup_compressed"):
        return MISS
    hosts = rt.bootstrap.hosts_in(group.ranks)
    hit = table.lookup_compressed(op.value, group.size, device, dtype_class(dtype), nbytes,
                                  hosts)
    if hit is None:
        return MISS
    measured, variants = hit
    measured = {_canonical(c) for c in measured}
    allowed = {_canonical(c) for c in auto.codecs} if auto.codecs else measured
    if not allowed <= measured:
        return MISS  # a codec the table never measured: calibrate them all alike
    forced = rt.named_backend(op, group, backend)
    for be, codec, algo in variants:
        name = _canonical(codec)
        if name not in allowed or name.startswith("?") or algo not in ALGORITHMS or \
                (forced is not None and be != forced):
            continue  # not allowed, not known to this build, or not the forced backend
        if rt.unavailable_reason(be) is not None:
            continue
        if make_codec(codec).lossy and not dtype.is_floating:
            continue
        return Compression(codec, algo), be
    return None, backend


def describe(spec: str, op: str, group_size: int, count: int, backend: str | None = None) -> str:
    """What auto chooses for ``op`` (name) on the world (for benchmarks): 'plain' or a
    Compression's spec (``int8@ring``, plus `` on mpi`` when the tuning table's variant
    runs on another backend than ``backend``). Calibrates on first use (collective)."""
    rt = get_runtime()
    cz, be = choose(parse(spec), rt, rt.world, Op(op), count, float32, backend)
    if cz is None:
        return "plain"
    return str(cz) if be == backend else f"{cz} on {be}"
