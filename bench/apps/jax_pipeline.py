"""A pipelined MLP in JAX over mcrdl_jax: one stage per process, GPipe schedule.

    mpiexec -n 3 .venv/bin/python bench/apps/jax_pipeline.py --steps 300

The model's layers are split into contiguous stages, one per rank. Each training step
splits the batch into micro-batches; stage s receives each micro-batch's activations
from stage s-1, applies its layers and sends the result to stage s+1; the last stage
computes the loss. The whole per-rank step is one ``jax.jit(jax.grad(...))``: the
backward pass is JAX's own, and the cotangents travel back from stage to stage through
the derivatives of ``mcrdl_jax.send``/``recv`` (all forward micro-batches, then all
backward ones in reverse: GPipe). Two rules of those derivatives show here:
``send``'s token is added to the stage's objective, and ``recv``'s ``like`` is an
argument that is differentiated (``carrier``), so that the cotangent is sent back.

``--check`` trains the same model in one process (every rank can, it is small) and
reports the largest difference between the stage's parameters and the reference's.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import mcrdl_jax as mj


def layer_split(n_layers: int, stages: int) -> list[list[int]]:
    if stages > n_layers:
        raise SystemExit(f"{stages} stages need at least {stages} layers; pass --layers")
    return [[int(i) for i in p] for p in np.array_split(np.arange(n_layers), stages)]


def init_model(key, dims):
    keys = jax.random.split(key, len(dims) - 1)
    return [(jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a), jnp.zeros(b, jnp.float32))
            for k, a, b in zip(keys, dims[:-1], dims[1:])]


def apply_layers(layers, h, last_index: int, indices):
    for (w, b), i in zip(layers, indices):
        h = h @ w + b
        if i != last_index:
            h = jnp.tanh(h)
    return h


def batch(step: int, n: int, dims):
    """The synthetic task: y = sin(x A) for a fixed teacher A; a fresh batch per step,
    the same on every rank."""
    kx = jax.random.fold_in(jax.random.PRNGKey(1), step)
    teacher = jax.random.normal(jax.random.PRNGKey(2), (dims[0], dims[-1])) / np.sqrt(dims[0])
    x = jax.random.normal(kx, (n, dims[0]), jnp.float32)
    return x, jnp.sin(x @ teacher)


class Stage:
    """This rank's part of the pipeline."""

    def __init__(self, dims, micro: int, batch_size: int, lr: float, backend=None):
        self.rank, self.size = mj.get_rank(), mj.get_world_size()
        self.dims, self.micro, self.lr, self.backend = dims, micro, lr, backend
        if batch_size % micro:
            raise SystemExit(f"--batch {batch_size} is not a multiple of --micro {micro}")
        self.mb = batch_size // micro
        self.batch_size = batch_size
        self.split = layer_split(len(dims) - 1, self.size)
        self.mine = self.split[self.rank]
        full = init_model(jax.random.PRNGKey(0), dims)
        self.params = [full[i] for i in self.mine]
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        width_in = dims[self.mine[0]]
        # recv's template: differentiated, so that the cotangents go back upstream
        self.carrier = jnp.zeros((micro, self.mb, width_in), jnp.float32)
        self._step = jax.jit(self._train_step)

    def objective(self, params, carrier, xs, ys):
        """This stage's share of the loss: the loss itself on the last stage, the sum of
        the send tokens (zeros that carry the cotangents back) on the others."""
        total = jnp.zeros((), jnp.float32)
        last_layer = len(self.dims) - 2
        for m in range(self.micro):
            h = xs[m] if self.first else mj.recv(carrier[m], self.rank - 1, tag=m,
                                                 backend=self.backend)
            out = apply_layers(params, h, last_layer, self.mine)
            if self.last:
                total = total + jnp.mean((out - ys[m]) ** 2) / self.micro
            else:
                total = total + mj.send(out, self.rank + 1, tag=m, backend=self.backend)
        return total

    def _train_step(self, params, carrier, xs, ys):
        value, (grads, _) = jax.value_and_grad(self.objective, argnums=(0, 1))(
            params, carrier, xs, ys)
        new = jax.tree_util.tree_map(lambda p, g: p - self.lr * g, params, grads)
        return new, value

    def step(self, i: int):
        x, y = batch(i, self.batch_size, self.dims)
        xs = x.reshape(self.micro, self.mb, -1)
        ys = y.reshape(self.micro, self.mb, -1)
        self.params, value = self._step(self.params, self.carrier, xs, ys)
        return value  # the loss on the last stage, 0 elsewhere


def reference(dims, steps: int, batch_size: int, lr: float):
    """The same model and data, trained in one process."""
    params = init_model(jax.random.PRNGKey(0), dims)
    last = len(dims) - 2

    def loss(p, x, y):
        return jnp.mean((apply_layers(p, x, last, range(len(p))) - y) ** 2)

    @jax.jit
    def step(p, x, y):
        g = jax.grad(loss)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)

    for i in range(steps):
        params = step(params, *batch(i, batch_size, dims))
    return params


def train(dims, steps, micro, batch_size, lr, backend=None, log_every=0):
    stage = Stage(dims, micro, batch_size, lr, backend)
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        value = stage.step(i)
        if log_every and (i % log_every == 0 or i == steps - 1):
            # the loss lives on the last stage: broadcast it for rank 0 to print
            loss = float(mj.broadcast(value, src=stage.size - 1))
            losses.append((i, loss))
            if stage.rank == 0:
                print(f"step {i:4d}  loss {loss:.5f}", flush=True)
    jax.block_until_ready(stage.params)
    return stage, losses, time.perf_counter() - t0


def max_param_difference(stage, steps, batch_size, lr) -> float:
    ref = reference(stage.dims, steps, batch_size, lr)
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for i, mine in zip(stage.mine, stage.params)
               for a, b in zip(mine, ref[i]))
    return float(mj.all_reduce(jnp.float32(diff), "max", backend="mpi"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default=None, help="mpi, gloo, or unset for auto")
    ap.add_argument("--check", action="store_true",
                    help="compare the parameters with a single-process run")
    ap.add_argument("--log-every", type=int, default=50)
    a = ap.parse_args(argv)
    dims = [16] + [a.width] * (a.layers - 1) + [4]
    stage, losses, secs = train(dims, a.steps, a.micro, a.batch, a.lr, a.backend, a.log_every)
    if stage.rank == 0:
        print(f"{stage.size} stages {stage.split}, {a.micro} micro-batches of {stage.mb}: "
              f"{a.steps} steps in {secs:.1f} s ({secs / a.steps * 1e3:.1f} ms/step); loss "
              f"{losses[0][1]:.4f} -> {losses[-1][1]:.4f}")
    if a.check:
        diff = max_param_difference(stage, a.steps, a.batch, a.lr)
        if stage.rank == 0:
            print(f"largest parameter difference from the single-process run: {diff:.2e}")


if __name__ == "__main__":
    main()
