"""``compression="auto:fp16+int8"``: compression allowed, used only where it pays.

The choice is made from measurements, the same on every rank of the group:

- *link*: the time of the backend's own all-gather of ``CAL_BYTES`` per rank (best of
  3), giving the bandwidth each rank's data moves at, bytes/s;
- *codecs*: encode and decode time of ``CAL_BYTES`` of N(0,1) float32 per allowed codec
  (best of 3), and the time of that codec's ring all-gather of ``CAL_BYTES`` per rank
  (best of 3): where the model below predicts less than that, its predictions for the
  codec are scaled up to match (never down), so the model cannot be more optimistic
  than what was measured on this machine.

Both are measured once per (group, backend) at the first auto call (a few collectives:
every rank makes that call, so they line up) and reduced with MAX over the group, so
that every rank holds the same figures and makes the same choice (a rank choosing
another algorithm than its peers would hang). Then, for each call, ``model`` predicts
the time of the plain collective and of each (codec, ring / a2a) variant, with no
overlap credited, and compression is used only when it is predicted at least
``MARGIN`` times faster: on a fast link or one host the plain collective is kept.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..ops import Op
from .spec import Compression, make_codec

log = logging.getLogger("mcrdl.compress")

CAL_BYTES = 2 << 20
MARGIN = 1.25
STEP_S = 100e-6  # per message step of the Python rings (issue, poll, finish)
_CALIBRATION: dict = {}


@dataclass(frozen=True)
class Auto:
    """The codecs auto selection may use (nothing else is ever chosen)."""

    codecs: tuple

    def __str__(self) -> str:
        return "auto:" + "+".join(self.codecs)


@dataclass(frozen=True)
class Calibration:
    """Seconds for CAL_BYTES per rank: the plain all-gather, and per codec (encode,
    decode); worst rank's."""

    group_size: int
    allgather_s: float
    codec_s: dict
    ring_s: dict = None  # codec -> its ring all-gather of CAL_BYTES per rank

    @property
    def bandwidth(self) -> float:
        """Bytes/s each rank's data crosses a link at (plain all-gather, P-1 hops)."""
        return (self.group_size - 1) * CAL_BYTES / self.allgather_s


def _best(fn, reps: int = 3) -> float:
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

    n = CAL_BYTES // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = np.empty(group.size * n, np.float32)
    def plain():  # "off", not None: MCRDL_COMPRESSION must not apply here
        api.all_gather_into_tensor(out, x, group=group, backend=backend, compression="off")

    plain()
    figures = [_best(plain)]
    for name in codecs:
        codec = make_codec(name)
        enc = np.empty(codec.encoded_nbytes(n), np.uint8)
        dec = np.empty(n, np.float32)
        figures += [_best(lambda: codec.encode(x, enc)), _best(lambda: codec.decode(enc, dec))]
    for name in codecs:
        cz = Compression(name, "ring")
        figures.append(_best(lambda: api.all_gather_into_tensor(out, x, group=group,
                                                                backend=backend, compression=cz)))
    agreed = np.array(figures, np.float64)
    api.all_reduce(agreed, op="max", group=group, backend=backend, compression="off")
    k = len(codecs)
    cal = Calibration(group.size, float(agreed[0]),
                      {c: (float(agreed[1 + 2 * i]), float(agreed[2 + 2 * i]))
                       for i, c in enumerate(codecs)},
                      {c: float(agreed[1 + 2 * k + i]) for i, c in enumerate(codecs)})
    _CALIBRATION[key] = cal
    log.info("auto compression calibration on %s via %s: %.2f GB/s per link, codecs %s",
             group.describe(), backend, cal.bandwidth / 1e9, cal.codec_s)
    return cal


def model(cal: Calibration, op: Op, count: int, itemsize: int = 4) -> dict:
    """Predicted seconds per variant for blocks of ``count`` elements: 'plain' and
    'CODEC@ring' / 'CODEC@a2a' for each calibrated codec."""
    P, B = cal.group_size, cal.bandwidth
    raw = count * itemsize
    phases = (Op.REDUCE_SCATTER, Op.ALL_GATHER) if op is Op.ALL_REDUCE else (op,)
    plain = sum((P - 1) * raw / B for _ in phases)
    times = {"plain": plain}
    for name in cal.codec_s:
        for algo, t in _codec_model(cal, name, phases, count).items():
            times[f"{name}@{algo}"] = t * _correction(cal, name)
    return times


def _correction(cal: Calibration, name: str) -> float:
    """measured / modelled time of the codec's ring all-gather at CAL_BYTES, at least 1."""
    if not cal.ring_s:
        return 1.0
    modelled = _codec_model(cal, name, (Op.ALL_GATHER,), CAL_BYTES // 4)["ring"]
    return max(1.0, cal.ring_s[name] / modelled)


def _codec_model(cal: Calibration, name: str, phases, count: int) -> dict:
    """Modelled seconds of the codec's 'ring' and 'a2a' variants (no overlap credited)."""
    P, B = cal.group_size, cal.bandwidth
    t_enc, t_dec = cal.codec_s[name]
    e = d = count * 4 / CAL_BYTES  # codec times were measured on CAL_BYTES of float32
    e, d = e * t_enc, d * t_dec
    wire = (P - 1) * make_codec(name).encoded_nbytes(count) / B
    times = {}
    for algo in ("ring", "a2a"):
        t = 0.0
        for ph in phases:
            if ph is Op.ALL_GATHER:  # encode once, decode every block
                t += wire + e + P * d + (P - 1) * STEP_S
            else:  # (P-1) blocks encoded and decoded, per hop (ring) or at once (a2a)
                t += wire + (P - 1) * (e + d) + (P - 1 if algo == "ring" else 1) * STEP_S
        times[algo] = t
    return times


def decide(cal: Calibration, op: Op, count: int, itemsize: int = 4) -> Compression | None:
    """Pure: the variant ``model`` predicts fastest, if at least MARGIN x faster than the
    plain collective; else None."""
    times = model(cal, op, count, itemsize)
    best = min((k for k in times if k != "plain"), key=times.get)
    if times[best] * MARGIN > times["plain"]:
        return None
    codec, _, algo = best.partition("@")
    return Compression(codec, algo)


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
