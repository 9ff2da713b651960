"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``, expert parallelism over
all_to_all) trained on whatever torch.distributed backend is named: the client code
is DeepSpeed's, unchanged.

    pip install deepspeed     # 0.19.8 installs on torch 2.13 CPU without replacing it
    mpiexec -n 2 .venv/bin/python bench/apps/ds_moe.py --backend gloo  --json g.json
    mpiexec -n 2 .venv/bin/python bench/apps/ds_moe.py --backend mcrdl --json m.json
    .venv/bin/python bench/apps/ds_moe.py --compare g.json m.json

``deepspeed.init_distributed(dist_backend=...)`` starts torch.distributed (its MPI
discovery sets RANK etc. under mpiexec); ``MoE(..., ep_size=n)`` makes DeepSpeed's
expert- and data-parallel groups (``new_group``) and moves tokens with
``all_to_all_single`` inside its ``_AllToAll``; its gate all-reduces expert counts. The
data-parallel gate weights are all-reduced here after backward. Each step prints the
global loss; ``--compare`` checks two runs' losses agree (same seeds: only the order of
reductions may differ).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def train(a) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from deepspeed.moe.layer import MoE

    # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce (used only
    # by inference_all_reduce, not on this path): skip the build, the comm path is unchanged
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=a.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(a.hidden, a.ffn), nn.GELU(), nn.Linear(a.ffn, a.hidden))
    moe = MoE(hidden_size=a.hidden, expert=expert, num_experts=n * a.experts_per_rank,
              ep_size=n, k=1, capacity_factor=2.0, min_capacity=4, drop_tokens=True)
    dense = [p for name, p in moe.named_parameters() if "experts" not in name]
    opt = torch.optim.SGD(moe.parameters(), lr=a.lr)
    losses = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(a.tokens, a.hidden, generator=g)
        target = torch.randn(a.tokens, a.hidden, generator=g)
        torch.manual_seed(step)  # the gate's random token selection, the same everywhere
        opt.zero_grad()
        out, l_aux, _ = moe(x)
        loss = (nn.functional.mse_loss(out, target) + 0.01 * l_aux) / n
        loss.backward()
        for p in dense:
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    elapsed = time.perf_counter() - t0
    result = {"backend": a.backend, "ranks": n, "steps": a.steps, "losses": losses,
              "samples_per_s": a.tokens * n * a.steps / elapsed}
    if rank == 0:
        print(json.dumps(result), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()
    return result


def compare(paths) -> None:
    runs = [json.load(open(p)) for p in paths]
    base = runs[0]["losses"]
    for r in runs[1:]:
        worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(r["losses"], base))
        print(f"{r['backend']} vs {runs[0]['backend']}: {len(base)} losses, "
              f"largest relative difference {worst:.1e}")
        if worst > 1e-4:
            raise SystemExit("the losses differ")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="mcrdl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--json", default=None)
    p.add_argument("--compare", nargs="+", default=None, help="result files to compare")
    a = p.parse_args()
    if a.compare:
        compare(a.compare)
    else:
        train(a)


if __name__ == "__main__":
    main()
