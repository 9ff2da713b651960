"""A two-stage JAX pipeline whose stages live on different meshes, joined by reshard.

    mpiexec -n 4 .venv/bin/python bench/apps/jax_mesh_pipeline.py --steps 50 --check
        [--method broadcast|send_recv|send_recv_allgather] [--backend mpi|gloo]

Model: y = tanh(x @ W0) @ W1, loss = mean((y - t)^2), trained by SGD on micro-batches
(GPipe: all forwards, then all backwards, gradients summed over the step).

- Stage 0 runs on the ranks of ``--stage0`` (default: the first half of the world),
  data parallel: each holds W0 and a slice of every micro-batch's rows; its W0
  gradient is all-reduced over the stage's group.
- Stage 1 runs on ``--stage1`` (default: the rest; with one rank both stages are rank
  0), tensor parallel on the hidden dimension: each holds a block of W1's rows, computes
  a partial product and all-reduces it over the stage's group.
- Between them the activations h (micro-batch x hidden) are resharded from "rows on
  stage 0's mesh" to "columns on stage 1's mesh", and their gradients back the other
  way, by ``mcrdl_jax.reshard``; stage computations are jitted.

``--check`` trains the same model in one process with NumPy-fed JAX and prints the
largest difference of each rank's parameters from the reference.
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


def train(args) -> dict:
    rank, size = mc.get_rank(), mc.get_world_size()
    d, h, o = args.dim, args.hidden, args.out
    s0, s1 = stages(size, args.stage0, args.stage1)
    g0, g1 = mj.new_group(s0), mj.new_group(s1)  # every rank creates both, in this order
    act_src = Layout(Mesh(s0, ("dp",)), ["dp", None])  # rows on stage 0
    act_dst = Layout(Mesh(s1, ("tp",)), [None, "tp"])  # hidden columns on stage 1
    shape = (args.batch, h)
    kw = dict(method=args.method, backend=args.backend, dtype=np.float32)
    w0_full, w1_full = init(args.seed, d, h, o)
    rows = act_src.tile(shape, rank)  # this rank's rows of a micro-batch (stage 0)
    cols = act_dst.tile(shape, rank)  # this rank's hidden columns (stage 1)
    w0 = jnp.asarray(w0_full) if rows else None
    w1 = jnp.asarray(w1_full[slice(*cols[1])]) if cols else None
    n = args.batch * args.micro
    scale = 1.0 / (n * o)
    t_start = time.perf_counter()
    for step in range(args.steps):
        batches = [data(args.seed, step, m, args.batch, d, o) for m in range(args.micro)]
        acts, hs, ys = [], [], []
        for x, t in batches:  # forwards
            xr = jnp.asarray(x[slice(*rows[0])]) if rows else None
            a = stage0_fwd(w0, xr) if rows else None
            acts.append(xr)
            hb = reshard(a, act_src, act_dst, shape, **kw)
            hs.append(hb)
            if cols:
                part = stage1_partial(w1, hb)
                ys.append(mj.all_reduce(part, group=g1, backend=args.backend)
                          if len(s1) > 1 else part)
        gw1 = jnp.zeros_like(w1) if cols else None
        gw0 = jnp.zeros_like(w0) if rows else None
        for m, (x, t) in enumerate(batches):  # backwards
            dh = None
            if cols:
                gw, dh = stage1_bwd(w1, hs[m], ys[m], jnp.asarray(t), scale)
                gw1 = gw1 + gw
            dh_rows = reshard(dh, act_dst, act_src, shape, **kw)
            if rows:
                gw0 = gw0 + stage0_bwd(w0, acts[m], dh_rows)
        if rows:
            if len(s0) > 1:
                gw0 = mj.all_reduce(gw0, group=g0, backend=args.backend)
            w0 = w0 - args.lr * gw0
        if cols:
            w1 = w1 - args.lr * gw1
    elapsed = time.perf_counter() - t_start
    out = {"rank": rank, "stage0": s0, "stage1": s1, "seconds": elapsed}
    if args.check:
        r0, r1 = reference(args, d, h, o)
        if rows:
            out["w0_max_diff"] = float(np.max(np.abs(np.asarray(w0) - r0)))
        if cols:
            out["w1_max_diff"] = float(np.max(np.abs(np.asarray(w1) - r1[slice(*cols[1])])))
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
