"""A two-stage JAX pipeline whose stages live on different meshes, joined by reshard.

    mpiexec -n 4 .venv/bin/python bench/apps/jax_mesh_pipeline.py --steps 50 --check
        [--schedule gpipe|1f1b|eager1f1b] [--comm blocking|nonblocking]
        [--method broadcast|send_recv|send_recv_allgather] [--tp rows|cols]
        [--backend mpi|gloo]

Model: y = tanh(x @ W0) @ W1, loss = mean((y - t)^2), trained by SGD on micro-batches
(gradients summed over the step's micro-batches).

- Stage 0 runs on the ranks of ``--stage0`` (default: the first half of the world),
  data parallel: each holds W0 and a slice of every micro-batch's rows; its W0
  gradient is all-reduced over the stage's group at the end of the step.
- Stage 1 runs on ``--stage1`` (default: the rest; with one rank both stages are rank
  0), tensor parallel. ``--tp rows`` (default): each holds a block of W1's rows and
  the matching hidden columns of h, and all-reduces its partial product over the
  stage's group. ``--tp cols``: each holds a block of W1's columns and all of h
  (replicated on the stage: the activations' reshard sends each stage-0 tile to every
  stage-1 rank, the case where a broadcast beats send/recv), and the cotangent of h,
  a partial sum on each rank, is reduce-scattered by rows over the stage before it goes
  back.
- Between them the activations h and their cotangents are resharded by
  ``mcrdl_jax.reshard`` (``--method``); stage computations are jitted.

Schedules (stage 0's order; stage 1 runs each micro-batch's forward and backward as
soon as its activations are there): ``gpipe`` (all forwards, then all backwards),
``1f1b`` (one forward ahead, then one backward, one forward: at most 2 micro-batches'
activations kept), ``eager1f1b`` (the overlapping-friendly schedule of the cross-mesh
resharding paper: two forwards ahead, so a micro-batch's reshard to stage 1 runs while
stage 0 computes another one). ``--comm blocking``: each stage waits for every reshard
where it is posted (a sending and a receiving one posted together, as a sendrecv, so
neither side waits on the other); ``nonblocking``: reshards are started with
``async_op=True`` as early as the schedule allows (a stage's next receive before its
compute) and waited where the data is needed (sends at the end of the step).

``--check`` trains the same model in one process with NumPy-fed JAX and prints the
largest difference of each rank's parameters from the reference. Each rank prints its
seconds, samples/s, the share of the time spent in communication calls and the peak
bytes of activations it kept.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_core as mc
import mcrdl_jax as mj
from mcrdl_core.reshard import Layout, Mesh
from mcrdl_jax.resharding import reshard  # also mcrdl_jax.reshard


def init(seed: int, d: int, h: int, o: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((d, h)).astype(np.float32) / np.sqrt(d),
            rng.standard_normal((h, o)).astype(np.float32) / np.sqrt(h))


def data(seed: int, step: int, m: int, batch: int, d: int, o: int):
    rng = np.random.default_rng((seed, step, m))
    x = rng.standard_normal((batch, d)).astype(np.float32)
    return x, np.sin(x[:, :o] * 2.0).astype(np.float32)


@jax.jit
def stage0_fwd(w0, x):
    return jnp.tanh(x @ w0)


@jax.jit
def stage0_bwd(w0, x, dh):
    h = jnp.tanh(x @ w0)
    return x.T @ (dh * (1 - h * h))


@jax.jit
def stage1_partial(w1_block, h_block):
    return h_block @ w1_block


@jax.jit
def stage1_bwd(w1_block, h_block, y, t, scale):
    dy = 2.0 * (y - t) * scale
    return h_block.T @ dy, dy @ w1_block.T


def reference(args, d, h, o):
    w0, w1 = (jnp.asarray(w) for w in init(args.seed, d, h, o))

    def loss(w0, w1, x, t):
        return jnp.sum((jnp.tanh(x @ w0) @ w1 - t) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    n = args.batch * args.micro
    for step in range(args.steps):
        g0, g1 = jnp.zeros_like(w0), jnp.zeros_like(w1)
        for m in range(args.micro):
            x, t = data(args.seed, step, m, args.batch, d, o)
            a, b = grad(w0, w1, x, t)
            g0, g1 = g0 + a, g1 + b
        w0, w1 = w0 - args.lr * g0 / (n * o), w1 - args.lr * g1 / (n * o)
    return np.asarray(w0), np.asarray(w1)


def stages(size: int, s0: str | None, s1: str | None):
    if s0 or s1:
        return [int(r) for r in s0.split(",")], [int(r) for r in s1.split(",")]
    if size == 1:
        return [0], [0]
    half = size // 2
    return list(range(half)), list(range(half, size))


@jax.jit
def stage1_cols(w1_cols, h, t_cols, scale):
    """--tp cols: this rank's output columns; returns (W1 block gradient, partial dh)."""
    y = h @ w1_cols
    dy = 2.0 * (y - t_cols) * scale
    return h.T @ dy, dy @ w1_cols.T


def stage0_order(schedule: str, m_count: int) -> list:
    """Stage 0's ops in order: ("F", m) and ("B", m)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(m_count)] + [("B", m) for m in range(m_count)]
    ahead = min(m_count, 1 if schedule == "1f1b" else 2)
    ops = [("F", m) for m in range(ahead)]
    for m in range(m_count):
        if m + ahead < m_count:
            ops.append(("F", m + ahead))
        ops.append(("B", m))
    return ops


class Meter:
    """Seconds spent in communication calls and the peak bytes of kept activations."""

    def __init__(self):
        self.comm = 0.0
        self.live = {}
        self.peak = 0

    def call(self, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.comm += time.perf_counter() - t0

    def keep(self, key, arr):
        self.live[key] = 0 if arr is None else int(np.prod(arr.shape)) * arr.dtype.itemsize
        self.peak = max(self.peak, sum(self.live.values()))

    def drop(self, key):
        self.live.pop(key, None)


def train(args) -> dict:
    rank, size = mc.get_rank(), mc.get_world_size()
    d, h, o = args.dim, args.hidden, args.out
    s0, s1 = stages(size, args.stage0, args.stage1)
    g0, g1 = mj.new_group(s0), mj.new_group(s1)  # every rank creates both, in this order
    cols_tp = args.tp == "cols"
    act_src = Layout(Mesh(s0, ("dp",)), ["dp", None])  # rows on stage 0
    act_dst = Layout(Mesh(s1, ("tp",)), [None, None] if cols_tp else [None, "tp"])
    grad_src = Layout(Mesh(s1, ("tp",)), ["tp", None]) if cols_tp else act_dst
    shape = (args.batch, h)
    kw = dict(method=args.method, backend=args.backend, dtype=np.float32)
    w0_full, w1_full = init(args.seed, d, h, o)
    rows = act_src.tile(shape, rank)  # this rank's rows of a micro-batch (stage 0)
    tile1 = act_dst.tile(shape, rank)  # this rank's part of h (stage 1)
    w0 = jnp.asarray(w0_full) if rows else None
    if tile1 is None:
        w1, ocols = None, None
    elif cols_tp:
        ocols = Layout(Mesh(s1, ("tp",)), [None, "tp"]).tile((h, o), rank)[1]
        w1 = jnp.asarray(w1_full[:, slice(*ocols)])
    else:
        ocols = None
        w1 = jnp.asarray(w1_full[slice(*tile1[1])])
    n = args.batch * args.micro
    scale = 1.0 / (n * o)
    nonblocking = args.comm == "nonblocking"
    meter = Meter()

    def rf(a, async_op=True):  # activations: stage 0 -> stage 1
        return meter.call(reshard, a, act_src, act_dst, shape, async_op=async_op, **kw)

    def rb(dh, async_op=True):  # their cotangents: stage 1 -> stage 0
        return meter.call(reshard, dh, grad_src, act_src, shape, async_op=async_op, **kw)

    def wait(hs):
        return meter.call(mj.wait, hs)

    # both plans' first use (their cross-rank check and sub-communicators), in one order
    rf(jnp.zeros((rows[0][1] - rows[0][0], h), jnp.float32) if rows else None, False)
    rb(jnp.zeros(tuple(b - a for a, b in grad_src.tile(shape, rank)), jnp.float32)
       if tile1 else None, False)
    both = bool(rows) and bool(tile1)  # one rank holds both stages (a 1-rank run)
    order = stage0_order(args.schedule, args.micro)
    t_start = time.perf_counter()
    for step in range(args.steps):
        if step == 1:  # the first step compiles: not timed
            t_start, meter.comm = time.perf_counter(), 0.0
        batches = [data(args.seed, step, m, args.batch, d, o) for m in range(args.micro)]
        gw0 = jnp.zeros_like(w0) if rows else None
        gw1 = jnp.zeros_like(w1) if tile1 else None

        def stage1(hb, m):
            """Stage 1's forward and backward of micro-batch m: (W1 grad, dh to send)."""
            t = batches[m][1]
            if cols_tp:
                gw, dh_part = stage1_cols(w1, hb, jnp.asarray(t[:, slice(*ocols)]), scale)
                dh = meter.call(mj.reduce_scatter, dh_part, group=g1, backend=args.backend) \
                    if len(s1) > 1 else dh_part
                return gw, dh
            part = stage1_partial(w1, hb)
            y = meter.call(mj.all_reduce, part, group=g1, backend=args.backend) \
                if len(s1) > 1 else part
            return stage1_bwd(w1, hb, y, jnp.asarray(t), scale)

        if both:  # one rank: the micro-batches one after the other
            for m, (x, t) in enumerate(batches):
                xr = jnp.asarray(x)
                hb = wait(rf(stage0_fwd(w0, xr)))
                gw, dh = stage1(hb, m)
                gw1 = gw1 + gw
                gw0 = gw0 + stage0_bwd(w0, xr, wait(rb(dh)))
        elif rows:  # stage 0
            saved, sends, recvs, got = {}, [], {}, {}

            def post_recv(m):
                if m not in recvs:
                    recvs[m] = rb(None)

            for i, (kind, m) in enumerate(order):
                if nonblocking and kind == "F":
                    # the next backward's cotangent, posted before this forward's compute
                    # (every earlier backward has run, so the posts stay in order)
                    nxt = next((mm for k2, mm in order[i:] if k2 == "B"), None)
                    if nxt is not None:
                        post_recv(nxt)
                if kind == "F":
                    xr = jnp.asarray(batches[m][0][slice(*rows[0])])
                    saved[m] = xr
                    meter.keep(("x", m), xr)
                    hf = rf(stage0_fwd(w0, xr))
                    nb_next = order[i + 1] if i + 1 < len(order) else None
                    if nonblocking:
                        sends.append(hf)
                    elif nb_next is not None and nb_next[0] == "B":
                        post_recv(nb_next[1])  # a sendrecv: both posted, then both waited
                        _, got[nb_next[1]] = wait([hf, recvs.pop(nb_next[1])])
                    else:
                        wait(hf)
                else:
                    if m not in got:
                        post_recv(m)
                    dh = got.pop(m) if m in got else wait(recvs.pop(m))
                    gw0 = gw0 + stage0_bwd(w0, saved.pop(m), dh)
                    meter.drop(("x", m))
            wait(sends)
        else:  # stage 1
            sends, got = [], {}
            incoming = {0: rf(None)}
            for m in range(args.micro):
                if nonblocking and m + 1 < args.micro:
                    incoming[m + 1] = rf(None)  # the next micro-batch's activations
                hb = got.pop(m) if m in got else wait(incoming.pop(m))
                meter.keep(("h", m), hb)
                gw, dh = stage1(hb, m)
                meter.drop(("h", m))
                gw1 = gw1 + gw
                if args.schedule == "gpipe":
                    meter.keep(("dh", m), dh)  # sent once stage 0 is in its backwards
                    sends.append(dh)
                    if not nonblocking and m + 1 < args.micro:
                        incoming[m + 1] = rf(None)
                    continue
                hs = rb(dh)
                if nonblocking:
                    sends.append(hs)
                elif m + 1 < args.micro:  # a sendrecv: this cotangent, the next input
                    _, got[m + 1] = wait([hs, rf(None)])
                else:
                    wait(hs)
            if args.schedule == "gpipe":
                hs = [rb(dh) for dh in sends]
                if not nonblocking:
                    wait(hs)
                    hs = []
                sends = hs
                for m in range(args.micro):
                    meter.drop(("dh", m))
            wait(sends)
        if rows:
            if len(s0) > 1:
                gw0 = meter.call(mj.all_reduce, gw0, group=g0, backend=args.backend)
            w0 = w0 - args.lr * gw0
        if tile1:
            w1 = w1 - args.lr * gw1
    jax.block_until_ready((w0, w1))
    elapsed = time.perf_counter() - t_start
    timed = max(args.steps - 1, 1)
    out = {"rank": rank, "stage0": s0, "stage1": s1, "seconds": elapsed,
           "samples_per_s": timed * n / elapsed, "comm_share": meter.comm / elapsed,
           "peak_activation_bytes": meter.peak}
    if args.check:
        r0, r1 = reference(args, d, h, o)
        if rows:
            out["w0_max_diff"] = float(np.max(np.abs(np.asarray(w0) - r0)))
        if tile1:
            ref1 = r1[:, slice(*ocols)] if cols_tp else r1[slice(*tile1[1])]
            out["w1_max_diff"] = float(np.max(np.abs(np.asarray(w1) - ref1)))
    return out


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", default="broadcast")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "eager1f1b"], default="gpipe")
    ap.add_argument("--comm", choices=["blocking", "nonblocking"], default="blocking")
    ap.add_argument("--tp", choices=["rows", "cols"], default="rows")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--stage0", default=None, help="ranks of stage 0, e.g. 0,1")
    ap.add_argument("--stage1", default=None, help="ranks of stage 1, e.g. 2,3")
    ap.add_argument("--check", action="store_true")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    res = train(args)
    print(" ".join(f"{k}={v}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
