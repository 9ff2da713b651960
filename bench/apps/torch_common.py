"""What bench/apps/dlrm.py and moe.py share: start-up through
``torch.distributed.init_process_group(backend)`` (the programs never import MCR-DL:
"mcrdl" is a registered torch backend), an all-to-all that autograd can differentiate,
a timer of the time spent in communication calls, the data-parallel gradient
all-reduce, and the result line the apps table reads.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


class CommClock:
    """Seconds spent inside communication calls (they are synchronous here, so this is
    the time the step waits for communication, imbalance included), in all and by op:
    ``with CLOCK("all_to_all"):``."""

    def __init__(self):
        self.seconds = 0.0
        self.by_op: dict = {}
        self._op = "other"

    def __call__(self, op: str):
        self._op = op
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self.by_op[self._op] = self.by_op.get(self._op, 0.0) + dt
        self._op = "other"


CLOCK = CommClock()
#: ``--split-wait``: a timed barrier before each all-to-all (see ``parser``)
SPLIT_WAIT = False


def _wait_apart() -> None:
    """Under ``--split-wait``, wait for every rank before an all-to-all, on the clock
    as "wait": what remains under "all_to_all" is the exchange once all ranks are in."""
    if SPLIT_WAIT:
        with CLOCK("wait"):
            dist.barrier()


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with (uneven) splits, or even (both None: every rank sends
    each rank the same number of rows, as DeepSpeed's capacity-padded MoE does); its
    derivative is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        _wait_apart()
        with CLOCK("all_to_all"):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        rows = grad.shape[0] if in_splits is None else sum(in_splits)
        back = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        _wait_apart()
        with CLOCK("all_to_all"):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


def all_to_all(x, out_splits=None, in_splits=None):
    """Differentiable ``all_to_all_single``: by split sizes, or even (no splits)."""
    if out_splits is None and in_splits is None:
        return AllToAll.apply(x, None, None)
    return AllToAll.apply(x, list(out_splits), list(in_splits))


def all_reduce_grads(params) -> None:
    """Sum the gradients of data-parallel parameters over ranks in one flat buffer (what
    a DDP bucket does); each rank's loss is already divided by the world size."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with CLOCK("all_reduce"):
        dist.all_reduce(flat)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def train_step(loss, dense_params, opt) -> float:
    """Backward, the data-parallel all-reduce, the optimizer step; returns the global
    loss (the sum over ranks of ``loss``)."""
    loss.backward()
    all_reduce_grads(dense_params)
    opt.step()
    total = loss.detach().clone()
    with CLOCK("all_reduce"):
        dist.all_reduce(total)
    return total.item()


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend: gloo or mcrdl")
    p.add_argument("--pg-options", default=None,
                   help="mcrdl only: 'mpi', 'gloo' or per op 'all_to_all=mpi,all_reduce=gloo'")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--check", action="store_true",
                   help="also train in one process and compare the losses")
    p.add_argument("--json", default=None, help="write the result line here (rank 0)")
    p.add_argument("--split-wait", action="store_true",
                   help="diagnostic: a barrier before each all-to-all, timed apart "
                        "(comm_share_by_op 'wait': how long ranks wait for the slowest "
                        "one to arrive; 'all_to_all' is then the exchange alone)")
    return p


def init(args) -> tuple[int, int]:
    global SPLIT_WAIT
    SPLIT_WAIT = getattr(args, "split_wait", False)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("MPI_LOCALNRANKS") or 1)
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        # what torchrun does for several processes per node, here under mpiexec too: a
        # share of the cores each, not a thread per core in every rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    kw = {}
    if args.backend == "mcrdl" and args.pg_options:
        kw["pg_options"] = args.pg_options
    dist.init_process_group(args.backend, **kw)
    return dist.get_rank(), dist.get_world_size()


def run(args, step, reference=None, samples_per_step: int = 0, name: str = "",
        clocked: bool = True, tolerance: float = 1e-4) -> dict:
    """Warm up, time ``args.steps`` calls of ``step()`` (each returns the global loss),
    print and return the result; ``--check`` compares with ``reference(steps)``.
    ``clocked=False``: the program's communication is not on ``CLOCK`` (FSDP issues its
    own), so the result's communication share is None rather than a false 0;
    ``tolerance``: the largest relative difference ``--check`` accepts."""
    rank, n = dist.get_rank(), dist.get_world_size()
    losses = [step() for _ in range(args.warmup)]
    dist.barrier()
    log = None
    if args.backend == "mcrdl":  # which library (and codec) ran each op, for the table
        from mcrdl_core.observe.logger import logger

        log = logger()
        log.clear()
        log.enable()
    CLOCK.seconds = 0.0
    CLOCK.by_op = {}
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step())
    elapsed = time.perf_counter() - t0
    ran = {}
    if log is not None:
        log.disable()
        for rec in log.records:
            ran.setdefault(rec[0], set()).add(rec[2])
    ops = sorted(CLOCK.by_op)
    comm = torch.tensor([CLOCK.seconds, elapsed] + [CLOCK.by_op[o] for o in ops],
                        dtype=torch.float64)
    dist.all_reduce(comm, op=dist.ReduceOp.MAX)  # the same ops on every rank
    result = {"app": name, "backend": args.backend, "pg_options": args.pg_options, "ranks": n,
              "steps": args.steps, "samples_per_s": samples_per_step * args.steps / comm[1].item(),
              "comm_share": comm[0].item() / comm[1].item() if clocked else None,
              "comm_share_by_op": {o: comm[2 + i].item() / comm[1].item()
                                   for i, o in enumerate(ops)} if clocked else {},
              "losses": losses,
              "ran": {op: sorted(names) for op, names in ran.items()}}
    if args.check and reference is not None:
        ref = reference(args.warmup + args.steps)
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref))
        result["check_max_rel_diff"] = worst
        if worst > tolerance:
            raise SystemExit(f"{name}: losses differ from the one-process reference by {worst:.2e}")
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()
    return result
