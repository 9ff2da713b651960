"""A pipelined MLP in JAX over mcrdl_jax: one stage per process, GPipe or 1F1B.

    mpiexec -n 3 .venv/bin/python bench/apps/jax_pipeline.py --steps 300 [--schedule 1f1b]

The model's layers are split into contiguous stages, one per rank. Each training step
splits the batch into micro-batches; stage s receives each micro-batch's activations
from stage s-1, applies its layers and sends the result to stage s+1; the last stage
computes the loss. Two schedules:

- ``gpipe`` (default): the whole per-rank step is one ``jax.jit(jax.grad(...))``; the
  backward pass is JAX's own, and the cotangents travel back from stage to stage
  through the derivatives of ``mcrdl_jax.send``/``recv`` (all forward micro-batches,
  then all backward ones in reverse). Two rules of those derivatives show here:
  ``send``'s token is added to the stage's objective, and ``recv``'s ``like`` is an
  argument that is differentiated (``carrier``), so that the cotangent is sent back.
- ``1f1b``: one forward, one backward (PipeDream-flush, as in Megatron-LM): after a
  warm-up of S-s-1 forwards, stage s alternates forward and backward micro-batches, so
  at most S-s activations are kept. Stage computations are jitted; activations and
  gradients move eagerly with ``mcrdl_jax.sendrecv`` (send one way, receive the other,
  both posted before either is waited on), paired so that no rank waits on another.
  The backward recomputes the stage's forward from its saved input. ``--comm
  nonblocking``: every send is started with ``async_op=True`` and waited at the end of
  the step, and each direction's next receive is posted before the compute that
  precedes its use, so transfers overlap the stage's compute.

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
        self._fwd = jax.jit(lambda p, h: apply_layers(p, h, len(dims) - 2, self.mine))
        self._bwd = jax.jit(lambda p, h, ct: jax.vjp(self._fwd, p, h)[1](ct))
        self._last = jax.jit(jax.value_and_grad(
            lambda p, h, y: jnp.mean((self._fwd(p, h) - y) ** 2) / micro, argnums=(0, 1)))

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

    def step(self, i: int, schedule: str = "gpipe", comm: str = "blocking"):
        x, y = batch(i, self.batch_size, self.dims)
        xs = x.reshape(self.micro, self.mb, -1)
        ys = y.reshape(self.micro, self.mb, -1)
        if schedule == "1f1b":
            if comm == "nonblocking":
                return self._step_1f1b_nonblocking(xs, ys)
            return self._step_1f1b(xs, ys)
        self.params, value = self._step(self.params, self.carrier, xs, ys)
        return value  # the loss on the last stage, 0 elsewhere

    # --- 1F1B -------------------------------------------------------------------------------
    def _1f1b_setup(self):
        """(stage, stages, micro-batches, backend, previous and next stage, templates of
        an output activation and of an input) for either 1F1B step."""
        s, S, M = self.rank, self.size, self.micro
        if M < S:
            raise SystemExit(f"1f1b needs at least as many micro-batches ({M}) as stages ({S})")
        act_like = jnp.zeros((self.mb, self.dims[self.mine[-1] + 1]), jnp.float32)
        return s, S, M, self.backend, s - 1, s + 1, act_like, self.carrier[0]

    def _step_1f1b(self, xs, ys):
        s, S, M, be, prev, nxt, act_like, in_like = self._1f1b_setup()
        inputs, outputs = [], []  # saved inputs (for the backward) and pending outputs
        done = [0]  # forwards so far (the micro-batch index of the next one)
        grads = jax.tree_util.tree_map(jnp.zeros_like, self.params)
        loss = jnp.zeros((), jnp.float32)

        def forward(h):
            nonlocal loss
            inputs.append(h)
            done[0] += 1
            if self.last:
                value, g = self._last(self.params, h, ys[done[0] - 1])
                loss = loss + value
                outputs.append(g)  # the last stage's backward is already done
                return None
            return self._fwd(self.params, h)

        def backward(ct):
            """This micro-batch's parameter gradients; returns the input's cotangent."""
            nonlocal grads
            h = inputs.pop(0)
            if self.last:
                gp, gh = outputs.pop(0)
            else:
                gp, gh = self._bwd(self.params, h, ct)
            grads = jax.tree_util.tree_map(jnp.add, grads, gp)
            return gh

        def receive_input(m):
            return xs[m] if self.first else mj.recv(in_like, prev, backend=be)

        warmup = S - s - 1
        for m in range(warmup):  # forwards only
            mj.send(forward(receive_input(m)), nxt, backend=be)
        h = receive_input(warmup)
        steady = M - warmup
        for i in range(steady):
            out = forward(h)
            # send this forward's output, receive the oldest pending backward's cotangent
            ct = None if self.last else mj.sendrecv(out, act_like, nxt, nxt, backend=be)
            gh = backward(ct)
            if i == steady - 1:
                if not self.first:
                    mj.send(gh, prev, backend=be)
            elif self.first:
                h = xs[warmup + i + 1]
            else:  # send the input cotangent back, receive the next micro-batch's input
                h = mj.sendrecv(gh, in_like, prev, prev, backend=be)
        for _ in range(warmup):  # backwards only
            gh = backward(mj.recv(act_like, nxt, backend=be))
            if not self.first:
                mj.send(gh, prev, backend=be)
        self.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g, self.params, grads)
        return loss


    def _step_1f1b_nonblocking(self, xs, ys):
        """1F1B with non-blocking sends and receives posted ahead (see the module
        docstring): the same micro-batch order as ``_step_1f1b``, so the same result."""
        s, S, M, be, prev, nxt, act_like, in_like = self._1f1b_setup()
        sends = []

        def send(x, peer):
            sends.append(mj.send(x, peer, backend=be, async_op=True))

        def stream(like, peer, count):
            """The next received array of ``count`` from ``peer``, the one after it
            already posted."""
            posted = [mj.recv(like, peer, backend=be, async_op=True)] if count else []
            for k in range(count):
                if k + 1 < count:
                    posted.append(mj.recv(like, peer, backend=be, async_op=True))
                yield mj.wait(posted.pop(0))

        inputs = iter(xs) if self.first else stream(in_like, prev, M)
        cts = None if self.last else stream(act_like, nxt, M)
        saved, pending = [], []
        grads = jax.tree_util.tree_map(jnp.zeros_like, self.params)
        loss = jnp.zeros((), jnp.float32)

        def forward(m):
            nonlocal loss
            h = next(inputs)
            saved.append(h)
            if self.last:
                value, g = self._last(self.params, h, ys[m])
                loss = loss + value
                pending.append(g)
            else:
                send(self._fwd(self.params, h), nxt)

        def backward():
            nonlocal grads
            h = saved.pop(0)
            gp, gh = pending.pop(0) if self.last else self._bwd(self.params, h, next(cts))
            grads = jax.tree_util.tree_map(jnp.add, grads, gp)
            if not self.first:
                send(gh, prev)

        warmup = S - s - 1
        for m in range(warmup):
            forward(m)
        for m in range(warmup, M):
            forward(m)
            backward()
        for _ in range(warmup):
            backward()
        mj.wait(sends)
        self.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g, self.params, grads)
        return loss


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


def train(dims, steps, micro, batch_size, lr, backend=None, log_every=0, schedule="gpipe",
          comm="blocking"):
    stage = Stage(dims, micro, batch_size, lr, backend)
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        value = stage.step(i, schedule, comm)
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
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    ap.add_argument("--comm", choices=["blocking", "nonblocking"], default="blocking",
                    help="1f1b: sends and receives non-blocking, overlapping compute")
    ap.add_argument("--check", action="store_true",
                    help="compare the parameters with a single-process run")
    ap.add_argument("--log-every", type=int, default=50)
    a = ap.parse_args(argv)
    dims = [16] + [a.width] * (a.layers - 1) + [4]
    stage, losses, secs = train(dims, a.steps, a.micro, a.batch, a.lr, a.backend, a.log_every,
                                a.schedule, a.comm)
    if stage.rank == 0:
        print(f"{a.schedule} ({a.comm}): {stage.size} stages {stage.split}, {a.micro} micro-batches of "
              f"{stage.mb}: "
              f"{a.steps} steps in {secs:.1f} s ({secs / a.steps * 1e3:.1f} ms/step); loss "
              f"{losses[0][1]:.4f} -> {losses[-1][1]:.4f}")
    if a.check:
        diff = max_param_difference(stage, a.steps, a.batch, a.lr)
        if stage.rank == 0:
            print(f"largest parameter difference from the single-process run: {diff:.2e}")


if __name__ == "__main__":
    main()
