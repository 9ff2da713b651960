"""``compression="auto:fp16+int8"``: compression allowed, used only where it pays.

The choice is made from measurements, the same on every rank of the group. At the
first auto call on a (group, backend), every rank times (best of 3) the backend's own
all-gather and reduce-scatter and the ring variant of each allowed codec, at two sizes
per rank (``CAL_SIZES``: 64 KiB and 2 MiB of float32). The figures are reduced with MAX
over the group, so every rank holds the same ones and makes the same choice (a rank
choosing another algorithm than its peers would hang), and fitted per (op, variant) as
``t(bytes) = alpha + beta * bytes``: alpha is the fixed cost (latency, Python
scheduling), beta the inverse of the rate (link and codec together). A call of at least
``MIN_BYTES`` per rank's block then uses
the codec predicted fastest for its size only if it is predicted at least ``MARGIN``
times faster than the plain collective: on a fast link, on one host, or for small
messages the plain collective is kept. All-reduce is predicted as reduce-scatter plus
all-gather. The calibration costs a few dozen collectives, once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..ops import Op
from .spec import Compression

log = logging.getLogger("mcrdl.compress")

CAL_SIZES = (64 << 10, 2 << 20)  # bytes per rank's block
MARGIN = 1.25
#: blocks smaller than this are never compressed: there the fixed costs (a few message
#: steps of the Python ring) dominate, and on a busy host the small-size calibration
#: point is too noisy to trust (it once picked fp16 for 64 KiB at 10 Gbit/s: 0.5x)
MIN_BYTES = 256 << 10
_CALIBRATION: dict = {}
_OPS = (Op.ALL_GATHER, Op.REDUCE_SCATTER)


@dataclass(frozen=True)
class Auto:
    """The codecs auto selection may use (nothing else is ever chosen)."""

    codecs: tuple

    def __str__(self) -> str:
        return "auto:" + "+".join(self.codecs)


@dataclass(frozen=True)
class Calibration:
    """Fits per (op, variant), variant 'plain' or a codec name: (alpha s, beta s/byte),
    with bytes the size of one rank's block."""

    group_size: int
    fits: dict

    @classmethod
    def from_times(cls, group_size: int, times: dict) -> "Calibration":
        """``times[(op, variant)] = (t at CAL_SIZES[0], t at CAL_SIZES[1])`` in seconds."""
        (s0, s1), fits = CAL_SIZES, {}
        for key, (t0, t1) in times.items():
            beta = max(t1 - t0, 0.0) / (s1 - s0)
            fits[key] = (max(t0 - beta * s0, 0.0), beta)
        return cls(group_size, fits)

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


def calibrate(rt, group, backend: str | None, codecs) -> Calibration:
    """Measure (once per group, backend and codec set) and agree across the group."""
    key = (group.id, backend, tuple(codecs))
    cal = _CALIBRATION.get(key)
    if cal is not None:
        return cal
    from .. import api

    P = group.size
    variants = ["off"] + [Compression(c, "ring") for c in codecs]
    keys, figures = [], []
    for nbytes in CAL_SIZES:
        n = nbytes // 4
        x = np.random.default_rng(0).standard_normal(P * n).astype(np.float32)
        out = np.empty(P * n, np.float32)
        for cz in variants:  # "off", not None: MCRDL_COMPRESSION must not apply here
            figures.append(_best(lambda: api.all_gather_into_tensor(
                out, x[:n], group=group, backend=backend, compression=cz)))
            figures.append(_best(lambda: api.reduce_scatter_tensor(
                out[:n], x, group=group, backend=backend, compression=cz)))
            name = "plain" if cz == "off" else cz.codec
            keys += [(Op.ALL_GATHER.value, name), (Op.REDUCE_SCATTER.value, name)]
    agreed = np.array(figures, np.float64)
    api.all_reduce(agreed, op="max", group=group, backend=backend, compression="off")
    half = len(keys) // 2
    times = {k: (float(agreed[i]), float(agreed[half + i])) for i, k in enumerate(keys[:half])}
    cal = _CALIBRATION[key] = Calibration.from_times(P, times)
    log.info("auto compression calibration on %s via %s (s at %s B per rank): %s",
             group.describe(), backend, CAL_SIZES, times)
    return cal


def decide(cal: Calibration, op: Op, count: int, itemsize: int = 4) -> Compression | None:
    """Pure: the codec predicted fastest for blocks of ``count`` elements, if at least
    MARGIN x faster than the plain collective; else None."""
    nbytes = count * itemsize
    if nbytes < MIN_BYTES:
        return None
    plain = cal.predict(op, "plain", nbytes)
    best = min(cal.codecs, key=lambda c: cal.predict(op, c, nbytes))
    if cal.predict(op, best, nbytes) * MARGIN > plain:
        return None
    return Compression(best, "ring")


def choose(auto: Auto, rt, group, op: Op, count: int, dtype, backend: str | None):
    """The Compression to use for this call, or None for the plain collective."""
    if group.size == 1 or count == 0:
        return None
    key = (group.id, backend, auto.codecs, op, count, dtype.itemsize)
    hit = _DECIDED.get(key)
    if hit is None:
        if len(_DECIDED) > 4096:
            _DECIDED.clear()
        cal = calibrate(rt, group, backend, auto.codecs)
        hit = _DECIDED[key] = (decide(cal, op, count, dtype.itemsize),)
    return hit[0]


_DECIDED: dict = {}


def describe(spec: str, op: str, group_size: int, count: int, backend: str | None = None) -> str:
    """What auto chooses for ``op`` (name) on the world (for benchmarks): 'plain' or a
    Compression's spec. Calibrates on first use (collective)."""
    from ..runtime import get_runtime
    from .spec import parse

    rt = get_runtime()
    cz = choose(parse(spec), rt, rt.world, Op(op), count, _F32, backend)
    return "plain" if cz is None else str(cz)


class _F32:
    itemsize = 4
