"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``, expert parallelism over
all_to_all) trained on whatever torch.distributed backend is named: the client code
is DeepSpeed's, unchanged.

    pip install deepspeed     # 0.19.8 installs on torch 2.13 CPU without replacing it
    mpiexec -n 2 .venv/bin/python bench/apps/ds_moe.py --backend gloo  --json g.json
    mpiexec -n 2 .venv/bin/python bench/apps/ds_moe.py --backend mcrdl [--pg-options mpi] --json m.json
    .venv/bin/python bench/apps/ds_moe.py --compare g.json m.json

The process group is started as the other apps start theirs (``torch_common.init``:
``init_process_group(backend, pg_options=...)``), then
``deepspeed.init_distributed(dist_backend=...)`` adopts it; ``MoE(..., ep_size=n)``
makes DeepSpeed's expert- and data-parallel groups (``new_group``) and moves tokens
with ``all_to_all_single`` inside its ``_AllToAll``, through ``deepspeed.comm``. With
``--capacity-factor`` (default 1.25, as the apps table's ``comm-cap`` MoE) every expert
takes that many tokens per rank and drops the rest, so both all-to-alls are even. The
data-parallel gate weights are all-reduced here after backward. The result line is
the other apps' (``torch_common.run``: samples/s, communication share, losses), so
``bench/apps/table.py --apps ds_moe`` times it beside them. For the communication share
the benchmark wraps ``torch.distributed.all_to_all_single``, which DeepSpeed's Torch
backend looks up at every call, in the same timer as its own calls; DeepSpeed's code
is not changed. ``--compare`` checks two runs' losses agree (same seeds: only the
order of reductions may differ).
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from torch_common import CLOCK, init, parser, run  # noqa: E402


def timed(fn):
    """``fn`` timed by the apps' communication clock."""
    def call(*args, **kwargs):
        with CLOCK("all_to_all"):
            return fn(*args, **kwargs)
    return call


def train(a) -> dict:
    import deepspeed
    from deepspeed.moe.layer import MoE

    # DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce (used only
    # by inference_all_reduce, not on this path): skip the build, the comm path is unchanged
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank, n = init(a)
    deepspeed.init_distributed(dist_backend=a.backend)  # adopts the group started above
    dist.all_to_all_single = timed(dist.all_to_all_single)
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(a.hidden, a.ffn), nn.GELU(), nn.Linear(a.ffn, a.hidden))
    moe = MoE(hidden_size=a.hidden, expert=expert, num_experts=n * a.experts_per_rank,
              ep_size=n, k=1, capacity_factor=a.capacity_factor, min_capacity=4,
              drop_tokens=True)
    dense = [p for name, p in moe.named_parameters() if "experts" not in name]
    opt = torch.optim.SGD(moe.parameters(), lr=a.lr)
    steps = [0]

    def step() -> float:
        s = steps[0]
        steps[0] += 1
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(a.tokens, a.hidden, generator=g)
        target = torch.randn(a.tokens, a.hidden, generator=g)
        torch.manual_seed(s)  # the gate's random token selection, the same everywhere
        opt.zero_grad()
        out, l_aux, _ = moe(x)
        loss = (nn.functional.mse_loss(out, target) + 0.01 * l_aux) / n
        loss.backward()
        with CLOCK("all_reduce"):
            for p in dense:
                dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        with CLOCK("all_reduce"):
            dist.all_reduce(total)
        return total.item()

    return run(a, step, samples_per_step=a.tokens * n, name="ds_moe")


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
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compare", nargs="+", default=None, help="result files to compare")
    a = p.parse_args()
    if a.compare:
        compare(a.compare)
    else:
        train(a)


if __name__ == "__main__":
    main()
