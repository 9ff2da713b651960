"""Latency sweeps over ops, message sizes and backends (used by ``mcrdl tune`` and
``mcrdl bench``).

For one (op, size) every backend is measured in *paired rounds*. In a round every
column runs one *block*: a barrier, a few untimed calls, then a run of timed calls back
to back (``block_plan``, ``timed_blocks``); the column's figure in that round is the
median over the block's slices of their time per call, the slowest rank's (max over
ranks). The blocks of a round follow an order that rotates from round to round, whole
cycles of a Williams design (``round_order``, ``whole_cycles``, the same on every rank),
so every column is first, last and right after every other one equally often, and the
tuner compares columns round by round (tuning.py's ``compare``); ``measure_rounds``
returns the figures per round, ``measure_point`` their medians.

Why blocks (bench/column_bias.py measures it; docs/tuning.md): one call timed after a
barrier is not the call's cost. At 8 B on 2 ranks the steady mpi all-reduce takes 3.1
µs, but the first call after a barrier 3.5 µs, after a 0.2 ms sleep 7 µs, after a 2 ms
sleep 15 µs (the ranks leave the barrier apart, caches and the core went cold), and the
first three after a Gloo call 16-30, 5-10 and 4 µs (Gloo's threads and the GIL they
take back). A column's place relative to Gloo's calls then moved it by 10-20% although
positions were balanced, since the longer path of ``auto`` pays more for cold caches.
The untimed calls of a block absorb all of that (``DISCARD_S``), the blocks make a
figure the steady cost of a call (as nccl-tests and the OSU benchmarks report), the
slices' median keeps one preemption out of it, and whatever is left is spread evenly by
the design. The collector is off while timing (as in timeit).

Buffers are NumPy arrays (float32, or int32 for the int class), allocated once per
point; with ``device="cuda"`` they are CuPy arrays on the current device, and each
timed call ends with a synchronize of CuPy's current stream (NCCL calls return once
enqueued, and the caller's stream is made to wait on them), so a call's time includes
the GPU's part. Sizes are bytes per rank (the selection size, see selection.py).

``LoadWatch`` and ``load_report`` record what else ran on the hosts during a tuning run
(``mcrdl tune`` stores it in the table's machine block; docs/tuning.md).

Compressed variants (``mcrdl tune --compression``) are more columns of the same point,
named ``BACKEND+CODEC@ALGORITHM`` (``compressed_columns``): each allowed codec's ring
over each backend for all_gather, reduce_scatter and all_reduce, and its all-to-all
variant for reduce_scatter. They run on N(0, 1) data (the same on every rank; codec
speed can depend on values, and constant data would flatter it), shared by all the
compressed columns of a point; their all_reduce averages (AVG) so the values stay
put from call to call instead of doubling into Inf, which int8/int4 would carry on a
slower path.
"""
from __future__ import annotations

import gc
import math
import os
import time

import numpy as np

from ..base import config as _config
from ..dispatch import api
from ..dispatch.runtime import get_runtime
from ..dispatch.selection import is_algorithm
from ..memory.cuda import cupy


def trials_for(nbytes: int, scale: float = 1.0) -> int:
    """Rounds of a point: 24 up to 1 MiB per rank, fewer for larger messages (12 from 4
    MiB on), times ``scale``, at least 12; ``measure_rounds`` rounds up to whole cycles
    of the design. Each round's figure is already a mean over a block of calls."""
    return max(12, int(min(24, (512 << 20) // max(nbytes, 1) // 16) * scale))


def element_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the buffer the selection sees for a sweep point of ``nbytes``: the
    per-rank payload, except all-to-all, whose whole input (n equal blocks) is it."""
    count = max(nbytes // itemsize, 1)
    return max(count // n, 1) * n if op == "all_to_all" else count


def array_module(device: str):
    """numpy for "cpu", cupy for "cuda" (imported only then)."""
    if device == "cpu":
        return np
    if device != "cuda":
        raise ValueError(f"unknown device {device!r}; use 'cpu' or 'cuda'")
    return cupy()


#: the compressed algorithms measured per op (all_gather's a2a, one backend all-gather
#: of the encoded bytes, is left out: it is the ring's wire volume in one call);
#: all_to_all has one: each destination's block encoded once and sent to it
COMPRESSED_ALGORITHMS = {"all_gather": ("ring",), "reduce_scatter": ("ring", "a2a"),
                         "all_reduce": ("ring",), "all_to_all": ("a2a",)}


#: the ops with a two-level algorithm (``mcrdl_core.algorithms.hier``), measured as the
#: lossless column "hier" where the group's ranks share hosts (``hier.applies``)
HIER_OPS = ("all_reduce", "all_to_all")


def algorithm_columns(op: str, hierarchical: bool) -> list[str]:
    """The algorithms measured for ``op`` beside the backends: ``hier`` for the ops of
    HIER_OPS when ``hierarchical``; a plain (lossless) column that the table may choose
    like a backend."""
    return ["hier"] if hierarchical and op in HIER_OPS else []


def compressed_columns(op: str, backends, codecs) -> list[str]:
    """The compressed variants measured for ``op``: ``BACKEND+CODEC@ALGORITHM`` for each
    codec, algorithm and (plain, not control) backend; none for other ops."""
    return [f"{b}+{c}@{a}" for c in codecs for a in COMPRESSED_ALGORITHMS.get(op, ())
            for b in backends if "@" not in b and "+" not in b]


def split_column(label: str) -> tuple[str, str | None]:
    """(backend, compression spec or None) of a sweep column: ``mpi`` and the A/A
    control ``mpi@2`` are plain mpi; ``mpi+int8@ring`` is mpi carrying int8@ring."""
    backend, plus, spec = label.partition("+")
    return (backend, spec) if plus else (label.split("@")[0], None)


def make_call(op: str, nbytes: int, backend: str, dtype=np.float32, group=None,
              device: str = "cpu", compression: str | None = None, pool: dict | None = None):
    """A zero-argument function doing one ``op`` of ``nbytes`` per rank on ``backend``,
    on host memory or (``device="cuda"``) on the current GPU, synchronized per call.
    ``compression``: a spec (``"int8@ring"``) for all_gather, reduce_scatter and
    all_reduce; ``pool``: a dict in which the calls of one point share their buffers."""
    fn = _make_call(op, nbytes, backend, dtype, group, array_module(device), compression,
                    {} if pool is None else pool)
    if device == "cpu":
        return fn
    sync = array_module(device).cuda.get_current_stream().synchronize

    def on_gpu():
        fn()
        sync()  # blocking calls only: nothing of another library is in flight here
    return on_gpu


def _buffers(xp, dtype, count: int, n: int, pool: dict, gaussian: bool):
    """(x, big): ``count`` and ``n * count`` elements: ones, fresh for each plain column;
    N(0, 1) for the compressed columns, made once per point and shared through ``pool``
    (ten or more columns of 64 MiB buffers would not fit otherwise)."""
    if not gaussian:
        return xp.ones(count, dtype=dtype), xp.ones(count * n, dtype=dtype)
    key = (count, n)
    if key not in pool:
        big = xp.asarray(np.random.default_rng(0).standard_normal(count * n).astype(dtype))
        pool[key] = (xp.array(big[:count]), big)
    return pool[key]


def _make_call(op, nbytes, backend, dtype, group, xp, compression=None, pool=None):
    rt = get_runtime()
    g = rt.group(group)
    n, me = g.size, g.rank
    count = max(nbytes // np.dtype(dtype).itemsize, 1)
    if compression is not None and op not in COMPRESSED_ALGORITHMS:
        raise ValueError(f"{op} has no compressed variant; only {sorted(COMPRESSED_ALGORITHMS)}")
    x, big = _buffers(xp, dtype, count, n, {} if pool is None else pool,
                      compression is not None)
    kw = {"group": group, "backend": backend}
    if compression is not None:
        kw["compression"] = compression
        if op == "all_reduce":
            return lambda: api.all_reduce(x, "avg", **kw)
    elif (op in COMPRESSED_ALGORITHMS and _config.get("MCRDL_COMPRESSION")
          and not is_algorithm(backend)):  # (hier takes no compression at all)
        kw["compression"] = "off"  # a plain column is the backend's own collective
    root = g.ranks[0]
    if op == "all_reduce":
        return lambda: api.all_reduce(x, **kw)
    if op == "broadcast":
        return lambda: api.broadcast(x, root, **kw)
    if op == "reduce":
        return lambda: api.reduce(x, root, **kw)
    if op == "all_gather":
        return lambda: api.all_gather_into_tensor(big, x, **kw)
    if op == "reduce_scatter":
        return lambda: api.reduce_scatter_tensor(x, big, **kw)
    if op == "all_to_all":  # the selection size of all-to-all is the whole input
        per_peer = element_count(op, nbytes, n, x.itemsize) // n
        _, inp = _buffers(xp, dtype, per_peer, n, pool, compression is not None)
        out = xp.empty_like(inp)
        return lambda: api.all_to_all_single(out, inp, **kw)
    if op == "gather":
        outs = [xp.empty(count, dtype=dtype) for _ in range(n)] if me == 0 else None
        return lambda: api.gather(x, outs, root, **kw)
    if op == "scatter":
        ins = [xp.ones(count, dtype=dtype) for _ in range(n)] if me == 0 else None
        return lambda: api.scatter(x, ins, root, **kw)
    if op == "send_recv":  # ping-pong between group ranks 0 and 1; others idle
        if n < 2 or me > 1:
            return lambda: None
        peer = g.ranks[1 - me]

        def pingpong():
            if me == 0:
                api.send(x, peer, **kw)
                api.recv(x, peer, **kw)
            else:
                api.recv(x, peer, **kw)
                api.send(x, peer, **kw)
        return pingpong
    if op == "barrier":
        return lambda: api.barrier(group, backend=backend)
    raise ValueError(f"unknown op {op!r}")


def measure_rounds(op: str, nbytes: int, columns, rounds: int, warmup: int = 3,
                   dtype=np.float32, group=None, device: str = "cpu") -> dict:
    """{column: array of seconds per round} for one (op, size), at least ``rounds``
    rounds (rounded up to whole cycles of ``round_order``): per round, each column's
    block of back-to-back calls (``block_plan``, ``timed_blocks``), the columns' blocks
    in the round's order; a column's figure in a round is the slowest rank's mean time
    per timed call of its block. A column is a backend (``"auto"``: through the tuning
    table in force), the A/A control ``mpi@2`` (mpi measured again) or a compressed
    variant ``mpi+int8@ring``. send_recv reports one-way latency (half the round trip).
    Every rank returns the same figures."""
    rt = get_runtime()
    sync_backend = "mpi" if rt.unavailable_reason("mpi") is None else "gloo"
    pool: dict = {}
    calls = {}
    for b in columns:
        name, spec = split_column(b)
        calls[b] = make_call(op, nbytes, name, dtype, group, device, spec, pool)
    fns = list(calls.values())

    def barrier():
        api.barrier(group, backend=sync_backend)

    def slowest(a):
        api.all_reduce(a, "max", group=group, backend=sync_backend)

    with collector_off():
        plan = block_plan(fns, warmup, barrier, slowest)
        times = timed_blocks(fns, round_order(len(fns), whole_cycles(len(fns), rounds)),
                             plan, barrier)
    slowest(times)
    if op == "send_recv":
        times *= 0.5
    return {b: times[i] for i, b in enumerate(calls)}


def measure_point(op: str, nbytes: int, backends, trials: int, warmup: int = 3,
                  dtype=np.float32, group=None, device: str = "cpu") -> dict:
    """{column: median seconds} over ``trials`` paired rounds (``measure_rounds``)."""
    got = measure_rounds(op, nbytes, backends, trials, warmup, dtype, group, device)
    return {b: float(np.median(t)) for b, t in got.items()}


def round_order(k: int, rounds: int) -> list[list[int]]:
    """The order of the ``k`` columns in each of ``rounds`` rounds: the rows of a
    Williams design (a balanced Latin square; for odd k, with its mirror image),
    repeated. Over a full cycle (``whole_cycles``) every column takes every position
    equally often and directly follows every other column equally often inside a round,
    so whatever a block leaves behind for the next one that its discarded calls do not
    absorb, and whatever the position in a round costs, falls on every column alike."""
    if k <= 1:
        return [[0] * k for _ in range(rounds)]
    first, lo, hi = [0], 1, k - 1
    while len(first) < k:
        first.append(lo)
        lo += 1
        if len(first) < k:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % k for x in first] for i in range(k)]
    if k % 2:
        rows += [row[::-1] for row in rows]
    return [rows[r % len(rows)] for r in range(rounds)]


def whole_cycles(k: int, rounds: int) -> int:
    """``rounds`` rounded up to whole cycles of ``round_order`` for ``k`` columns (k
    rounds for even k, 2k for odd k), at least one cycle."""
    period = 1 if k <= 1 else (k if k % 2 == 0 else 2 * k)
    return period * -(-max(rounds, 1) // period)


# --- one column's block of calls ------------------------------------------------------
#: the calls a block runs before its timed ones, untimed, last at least this long. What
#: they absorb (measured at 8 B on 2 ranks, bench/column_bias.py): the first call after
#: the barrier pays for the ranks leaving it at different times and for cold caches
#: (3.5-15 µs where the steady call takes 3.1), the first three after a Gloo call for
#: Gloo's threads and the GIL they take back (16-30, 5-10, 4 µs)
DISCARD_S = 100e-6
#: ... at most this many calls
MAX_DISCARD = 100
#: a call at least this long needs no discarded call in front of it (what the previous
#: column leaves behind costs microseconds)
LONG_CALL_S = 10e-3
#: the timed calls of a block last about this long (1 call at least, MAX_CALLS at most):
#: long enough for the timer and short enough that few blocks meet a preemption
BLOCK_S = 1e-3
MAX_CALLS = 1000
#: the timed calls of a block are cut into this many slices, each timed (``timed_blocks``)
SLICES = 5


def discards_for(call_s: float) -> int:
    """Untimed calls in front of a block's timed ones, for calls of ``call_s`` seconds:
    enough to last ``DISCARD_S``, at least one; none for calls of ``LONG_CALL_S`` or more."""
    if call_s >= LONG_CALL_S:
        return 0
    return int(min(MAX_DISCARD, max(1, math.ceil(DISCARD_S / max(call_s, 1e-9)))))


def calls_for(call_s: float, block_s: float = BLOCK_S) -> int:
    """Timed calls of a block, for calls of ``call_s`` seconds: about ``block_s`` of them."""
    return int(min(MAX_CALLS, max(1, round(block_s / max(call_s, 1e-9)))))


#: calls timed one by one per function and pass of ``block_plan``
PROBES = 2


def block_plan(fns, warmup: int, barrier, slowest) -> list[tuple[int, int]]:
    """[(discarded, timed) calls] of each function's block, the same on every rank,
    from an estimate of each function's steady time per call: in two passes over the
    functions, in their order and then in reverse, each runs ``warmup`` calls and then
    ``PROBES`` calls timed one by one (a ``barrier()`` before each function); its
    estimate is the shortest of its timed calls, then the slowest rank's (``slowest``
    reduces an array in place with MAX over ranks), which gives ``discards_for`` and
    ``calls_for``. Why the shortest over two passes in opposite orders: a function
    estimated right after a slow library's calls can pay for them (the first calls
    after a Gloo call take 5-10x the steady time, bench/column_bias.py), and an
    estimate too long gives it blocks of a few calls that its discarded ones no longer
    shield from what the previous block leaves behind."""
    est = np.full(len(fns), np.inf)
    clock = time.perf_counter
    for order in (range(len(fns)), range(len(fns) - 1, -1, -1)):
        for i in order:
            fn = fns[i]
            barrier()
            for _ in range(warmup):
                fn()
            for _ in range(PROBES):
                t0 = clock()
                fn()
                est[i] = min(est[i], clock() - t0)
    slowest(est)
    return [(discards_for(t), calls_for(t)) for t in est]


def slices_of(calls: int, slices: int = SLICES) -> list[int]:
    """The timed calls of a block cut into ``min(slices, calls)`` consecutive slices of
    nearly equal length (their sizes)."""
    m = max(1, min(slices, calls))
    cuts = [round(j * calls / m) for j in range(m + 1)]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def timed_blocks(fns, order, plan, barrier) -> np.ndarray:
    """This rank's seconds per call, shape (len(fns), len(order)): in round r the
    functions run in the order ``order[r]``, function i as one block: ``barrier()``,
    ``plan[i][0]`` untimed calls, then ``plan[i][1]`` timed back to back in
    ``slices_of`` slices; the figure is the median over the slices of their time per
    call (a preemption that lands in one slice moves the mean of the block, not the
    median). Every rank must run the same ``order`` and ``plan``."""
    out = np.zeros((len(fns), len(order)))
    clock = time.perf_counter
    cuts = [slices_of(k) for _, k in plan]
    for r, row in enumerate(order):
        for i in row:
            fn, skip, sizes = fns[i], plan[i][0], cuts[i]
            barrier()
            for _ in range(skip):
                fn()
            per = []
            t0 = clock()
            for n in sizes:
                for _ in range(n):
                    fn()
                t1 = clock()
                per.append((t1 - t0) / n)
                t0 = t1
            per.sort()
            m = len(per)
            out[i, r] = per[m // 2] if m % 2 else (per[m // 2 - 1] + per[m // 2]) / 2
    return out


class collector_off:
    """A context in which the garbage collector is off (collected first), as timeit
    does: a collector pause would land in whichever block is running."""

    def __enter__(self):
        gc.collect()
        self.was_on = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self.was_on:
            gc.enable()
        return False


def algbw_bytes(op: str, nbytes: int, n: int) -> int:
    """S of the nccl-tests formulas for a sweep point of ``nbytes`` per rank."""
    return nbytes * n if op in ("all_gather", "reduce_scatter", "gather", "scatter") else nbytes


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` bytes (both rounded to powers of two)."""
    out, s = [], 1 << max(int(lo) - 1, 0).bit_length()
    while s <= hi:
        out.append(s)
        s <<= 1
    return out


def sweep_rounds(ops, sizes, backends, *, trials_scale: float = 1.0, dtype=np.float32,
                 group=None, on_point=None, device: str = "cpu", compression=(),
                 hierarchical: bool = False) -> dict:
    """{op: {size: {column: array of per-round seconds}}}, a column per backend plus,
    with ``hierarchical``, the two-level algorithms (``algorithm_columns``) and, with
    ``compression`` (codec names), the compressed variants of ``compressed_columns``;
    ``trials_for(size)`` rounds per point. ``on_point(op, size)`` after each point (a
    progress bar). Barrier is measured once (size 0)."""
    results = {}
    for op in ops:
        pts = [0] if op == "barrier" else sizes
        cols = (list(backends) + algorithm_columns(op, hierarchical)
                + compressed_columns(op, backends, compression))
        results[op] = {}
        for size in pts:
            results[op][size] = measure_rounds(op, size, cols, trials_for(size, trials_scale),
                                               dtype=dtype, group=group, device=device)
            if on_point:
                on_point(op, size)
    return results


def sweep(ops, sizes, backends, *, trials_scale: float = 1.0, dtype=np.float32, group=None,
          on_point=None, device: str = "cpu", compression=()) -> dict:
    """{op: {size: {column: median seconds}}} of ``sweep_rounds``."""
    return medians(sweep_rounds(ops, sizes, backends, trials_scale=trials_scale, dtype=dtype,
                                group=group, on_point=on_point, device=device,
                                compression=compression))


def medians(results: dict) -> dict:
    """{op: {size: {column: per-round seconds}}} -> the same with each column's median."""
    return {op: {s: {c: float(np.median(t)) for c, t in by.items()} for s, by in pts.items()}
            for op, pts in results.items()}


def round_spread(results: dict) -> float:
    """How much the rounds of a sweep disagree: the median, over every point and
    column, of the interquartile range of its rounds over their median (0 for figures
    without rounds). A quiet machine keeps it small; past ``SPREAD_WARN`` the timings
    say more about the machine than about the backends."""
    spreads = []
    for pts in results.values():
        for by in pts.values():
            for t in by.values():
                t = np.asarray(t, dtype=np.float64)
                if t.size >= 4 and np.median(t) > 0:
                    q1, q2, q3 = np.percentile(t, (25, 50, 75))
                    spreads.append((q3 - q1) / q2)
    return float(np.median(spreads)) if spreads else 0.0


# --- what else runs on the machine -----------------------------------------------------
#: thresholds of ``load_warnings``: a load average above the cores this job leaves free
#: by this much; other processes' CPU use during the run above the free cores by this
#: many cores; CPU steal above this fraction; round spread above this
LOAD_MARGIN = 0.75
OTHERS_MARGIN = 0.25
STEAL_WARN = 0.05
SPREAD_WARN = 0.5


def _proc_stat() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies of all CPUs since boot, from /proc/stat (None where
    there is no such file)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    steal = fields[7] if len(fields) > 7 else 0
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, steal, total


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class LoadWatch:
    """What else ran on the hosts while a sweep measured (``mcrdl tune``): made on every
    rank before the sweep, ``sample()`` now and then (cheap), ``finish()`` collectively
    at the end. Per host: cores, this job's ranks there, the 1-minute load average
    before the run and the highest seen during it, the CPU time other processes used
    during the run (the host's busy time from /proc/stat minus this job's ranks' own
    CPU time, in cores) and CPU steal (a virtual machine's CPU taken by its
    hypervisor)."""

    def __init__(self, rt):
        self.rt = rt
        self.t0 = time.monotonic()
        self.load_before = _loadavg()
        self.load_max = self.load_before
        self.stat0 = _proc_stat()
        self.cpu0 = _own_cpu_s()

    def sample(self) -> None:
        now = _loadavg()
        if now is not None and (self.load_max is None or now > self.load_max):
            self.load_max = now

    def finish(self, spread: float = 0.0, window_s: float = 0.5) -> dict:
        """Collective (every rank): the report of ``load_report`` for the whole job. A
        watch younger than ``window_s`` first sleeps until it is that old, so that a
        report taken as a run starts sees a short quiet window of this job."""
        if time.monotonic() - self.t0 < window_s:
            time.sleep(window_s - (time.monotonic() - self.t0))
        self.sample()
        stat1, wall = _proc_stat(), time.monotonic() - self.t0
        bs = self.rt.bootstrap
        mine = {"host": bs.host_of[self.rt.rank] if bs.host_of else bs.hostname(),
                "cores": os.cpu_count() or 1, "ranks": bs.local_size,
                "own_cpu_s": _own_cpu_s() - self.cpu0, "wall_s": wall,
                "load_before": self.load_before, "load_max": self.load_max,
                "stat": None if self.stat0 is None or stat1 is None
                else [b - a for a, b in zip(self.stat0, stat1)]}
        return load_report(bs.allgather(mine), spread)


def load_report(per_rank: list, spread: float = 0.0) -> dict:
    """The machine block's ``"load"``: per host (from every rank's ``LoadWatch``
    figures) cores, ranks, load averages, other processes' CPU use (cores) and steal
    (fraction); the round spread; and ``warnings``, one sentence each
    (``load_warnings``)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    hosts: dict = {}
    for r in per_rank:
        h = hosts.setdefault(r["host"], {"host": r["host"], "cores": r["cores"],
                                         "ranks": r["ranks"], "own_cpu_s": 0.0,
                                         "load_before": r["load_before"],
                                         "load_max": r["load_max"], "stat": r["stat"],
                                         "wall_s": r["wall_s"]})
        h["own_cpu_s"] += r["own_cpu_s"]
        if r["load_max"] is not None and (h["load_max"] is None or r["load_max"] > h["load_max"]):
            h["load_max"] = r["load_max"]
    out = []
    for h in hosts.values():
        busy_s = steal = None
        if h["stat"] is not None and h["stat"][2] > 0:
            busy_s = h["stat"][0] / tick
            steal = h["stat"][1] / h["stat"][2]
        others = None
        if busy_s is not None and h["wall_s"] > 0:
            others = max(busy_s - h["own_cpu_s"], 0.0) / h["wall_s"]
        out.append({"host": h["host"], "cores": h["cores"], "ranks": h["ranks"],
                    "load_before": _round(h["load_before"]), "load_max": _round(h["load_max"]),
                    "others_cores": _round(others), "steal": _round(steal, 4)})
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "hosts": out,
              "round_spread": round(spread, 4)}
    report["warnings"] = load_warnings(report)
    return report


def _round(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def load_warnings(report: dict) -> list[str]:
    """One sentence per condition that makes timings say more about the machine than
    about the backends: more ranks on a host than cores; a load average before the run
    or other processes' CPU use during it beyond the cores this job leaves free; CPU
    steal; rounds that disagree (``round_spread``). The load average counts only where
    other processes were busy during the run too, or where that was not measured (no
    /proc/stat): it is a one-minute average that still holds processes that have
    exited, such as the step before this one in ``make demo`` (its two ranks read as a
    load of 2 on a quiet 2-core machine)."""
    warn = []
    for h in report.get("hosts", ()):
        free = max(h["cores"] - h["ranks"], 0)
        where = f"host {h['host']} ({h['cores']} cores, {h['ranks']} ranks of this job)"
        if h["ranks"] > h["cores"]:
            warn.append(f"{where}: more ranks than cores, so ranks preempt each other")
        others_busy = (h.get("others_cores") is None
                       or h["others_cores"] > free + OTHERS_MARGIN)
        if (h.get("load_before") is not None and h["load_before"] > free + LOAD_MARGIN
                and others_busy):
            warn.append(f"{where}: load average {h['load_before']:.2f} before the run")
        if h.get("others_cores") is not None and h["others_cores"] > free + OTHERS_MARGIN:
            warn.append(f"{where}: other processes used {h['others_cores']:.2f} cores during "
                        "the run")
        if h.get("steal") is not None and h["steal"] > STEAL_WARN:
            warn.append(f"{where}: {h['steal'] * 100:.0f}% of CPU time stolen by the hypervisor")
    if report.get("round_spread", 0) > SPREAD_WARN:
        warn.append("rounds disagree: median interquartile range "
                    f"{report['round_spread'] * 100:.0f}% of the median")
    return warn
