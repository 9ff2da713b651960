"""Latency sweeps over ops, message sizes and backends (used by ``mcrdl tune`` and
``mcrdl bench``).

For one (op, size) every backend is measured in the same run, interleaved call by
call, each call after a barrier, in an order where every backend follows every other
equally often (``balanced_order``, the same on every rank), so machine noise and the
previous call's after-effects fall on all alike. The collector is off while timing
(as in timeit). A call's time is the slowest rank's (max over ranks); a point's figure
is the median over its calls. Buffers are NumPy arrays (float32, or
int32 for the int class), allocated once per point; with ``device="cuda"`` they are CuPy
arrays on the current device, and each timed call ends with a synchronize of CuPy's
current stream (NCCL calls return once enqueued, and the caller's stream is made to wait
on them), so a call's time includes the GPU's part. Sizes are bytes per rank (the
selection size, see selection.py).

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
import os
import statistics
import time

import numpy as np

from . import api
from .runtime import get_runtime


def trials_for(nbytes: int, scale: float = 1.0) -> int:
    """More trials for small messages (cheap, noisier), fewer for large ones."""
    return max(12, int(min(200, (512 << 20) // max(nbytes, 1) // 16) * scale))


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
    from .cuda import cupy

    return cupy()


#: the compressed algorithms measured per op (all_gather's a2a, one backend all-gather
#: of the encoded bytes, is left out: it is the ring's wire volume in one call)
COMPRESSED_ALGORITHMS = {"all_gather": ("ring",), "reduce_scatter": ("ring", "a2a"),
                         "all_reduce": ("ring",)}


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
    elif op in COMPRESSED_ALGORITHMS and os.environ.get("MCRDL_COMPRESSION"):
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
        inp = xp.ones(element_count(op, nbytes, n, x.itemsize), dtype=dtype)
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


def measure_point(op: str, nbytes: int, backends, trials: int, warmup: int = 3,
                  dtype=np.float32, group=None, settle_s: float = 2e-4,
                  device: str = "cpu") -> dict:
    """{backend: median seconds} for one (op, size), backends interleaved per trial.
    send_recv reports one-way latency (half the round trip)."""
    rt = get_runtime()
    sync_backend = "mpi" if rt.unavailable_reason("mpi") is None else "gloo"
    # "mpi@2" measures mpi a second time: an A/A control that shows the noise floor;
    # "mpi+int8@ring" is a compressed variant over mpi (compressed_columns)
    pool: dict = {}
    calls = {}
    for b in backends:
        name, spec = split_column(b)
        calls[b] = make_call(op, nbytes, name, dtype, group, device, spec, pool)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    fns = list(calls.values())
    order = balanced_order(len(fns), trials)
    times = np.zeros((len(fns), order.count(0)))
    gc.collect()
    gc_was_on = gc.isenabled()
    gc.disable()  # as timeit does: collector pauses would land on whichever call is next
    try:
        _timed_calls(fns, order, times, group, sync_backend, settle_s)
    finally:
        if gc_was_on:
            gc.enable()
    worst = times.copy()
    api.all_reduce(worst, "max", group=group, backend=sync_backend)
    half = 0.5 if op == "send_recv" else 1.0
    return {b: float(statistics.median(worst[i])) * half for i, b in enumerate(calls)}


def balanced_order(k: int, trials: int) -> list[int]:
    """A call order in which each of ``k`` backends runs at least ``trials`` times and
    every backend directly follows every other one equally often: an Eulerian circuit
    of the complete directed graph on k nodes (Hierholzer), repeated. A call right
    after another library's call can pay for it (Gloo's threads winding down on a busy
    machine); this spreads that cost evenly over the columns."""
    if k == 1:
        return [0] * trials
    unused = {v: [u for u in range(k) if u != v] for v in range(k)}
    stack, circuit = [0], []
    while stack:
        v = stack[-1]
        if unused[v]:
            stack.append(unused[v].pop())
        else:
            circuit.append(stack.pop())
    cycle = circuit[::-1][:-1]  # k(k-1) calls, each backend k-1 times
    return cycle * -(-trials // (k - 1))


def _timed_calls(fns, order, times, group, sync_backend, settle_s):
    count = [0] * len(fns)
    for i in order:
        time.sleep(settle_s)  # let the previous call's library threads go idle
        api.barrier(group, backend=sync_backend)
        t0 = time.perf_counter()
        fns[i]()
        times[i, count[i]] = time.perf_counter() - t0
        count[i] += 1


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


def sweep(ops, sizes, backends, *, trials_scale: float = 1.0, dtype=np.float32, group=None,
          on_point=None, device: str = "cpu", compression=()) -> dict:
    """{op: {size: {column: median seconds}}}, a column per backend plus, with
    ``compression`` (codec names), the compressed variants of ``compressed_columns``.
    ``on_point(op, size)`` after each point (a progress bar). Barrier is measured once
    (it has no size)."""
    results = {}
    for op in ops:
        pts = [0] if op == "barrier" else sizes
        cols = list(backends) + compressed_columns(op, backends, compression)
        results[op] = {}
        for size in pts:
            results[op][size] = measure_point(op, size, cols,
                                              trials_for(size, trials_scale), dtype=dtype,
                                              group=group, device=device)
            if on_point:
                on_point(op, size)
    return results
