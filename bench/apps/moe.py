"""A mixture-of-experts transformer block trained over torch.distributed.

    mpiexec -n 2 .venv/bin/python bench/apps/moe.py --backend mcrdl [--pg-options mpi] [--check]
    mpiexec -n 2 .venv/bin/python bench/apps/moe.py --backend gloo

Only ``torch.distributed`` is called, so the same code runs on Gloo and on MCR-DL. The
block (as in GShard / Switch / DeepSpeed-MoE, top-1 routing without a capacity limit):

    h = x + attention-free mixing (a data-parallel linear layer)
    y = h + gate_prob * expert_{argmax gate(h)}(h)      (the MoE layer)
    out = y + FFN(y)                                    (data parallel)

Expert parallelism: ``--experts-per-rank`` experts live on each rank. Each step every
rank routes its tokens, sorts them by expert, tells every rank how many it will get
(an all-to-all of counts), sends them with an uneven ``all_to_all_single``, runs its
experts on what arrived and sends the results back the same way (autograd sends the
gradients along the reverse routes). The gate, mixing and FFN weights are data
parallel: one flat ``all_reduce`` of their gradients per step.

With ``--capacity-factor F`` the layer works as DeepSpeed's ``MOELayer`` and GShard do
instead: every expert takes at most ``C = ceil(F * tokens / experts)`` tokens from each
rank (the first ones in token order; the others are dropped: their MoE output is 0 and
only the residual carries them), each rank sends every expert exactly ``C`` rows (zeros
fill the free slots), so both all-to-alls are even and need no exchange of counts, and
every expert computes on ``n * C`` rows whatever the routing. No rank waits for the
one the gate sent the most tokens, at the price of padding and dropped tokens.

``--check`` trains the same block in one process on every rank's tokens and compares
the losses (each rank's loss is its local mean divided by n: the sum is the mean).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_common import CLOCK, all_to_all, init, parser, run, train_step


class Block:
    def __init__(self, a, n, my_experts):
        torch.manual_seed(0)
        d = a.hidden
        self.mix = nn.Linear(d, d)
        self.gate = nn.Linear(d, a.experts_per_rank * n)
        self.ffn = nn.Sequential(nn.Linear(d, a.ffn), nn.GELU(), nn.Linear(a.ffn, d))
        self.experts = {}
        for e in range(a.experts_per_rank * n):
            torch.manual_seed(1000 + e)
            expert = nn.Sequential(nn.Linear(d, a.ffn), nn.GELU(), nn.Linear(a.ffn, d))
            if e in my_experts:
                self.experts[e] = expert

    def dense_params(self):
        return [p for m in (self.mix, self.gate, self.ffn) for p in m.parameters()]

    def expert_params(self):
        return [p for m in self.experts.values() for p in m.parameters()]

    def route(self, x):
        h = x + self.mix(x)
        probs = torch.softmax(self.gate(h), dim=-1)
        weight, expert = probs.max(dim=-1)
        order = torch.argsort(expert, stable=True)
        return h, weight, expert, order

    def finish(self, h, weight, moe_out):
        y = h + weight.unsqueeze(1) * moe_out
        return y + self.ffn(y)


def capacity_slots(expert, n_experts: int, cap: int):
    """Capacity routing (``--capacity-factor``): ``(slot, kept)`` where ``kept`` are the
    indices of the tokens each expert takes (its first ``cap`` in token order) and
    ``slot`` their rows in the ``n_experts * cap`` dispatch buffer (expert-major)."""
    onehot = nn.functional.one_hot(expert, n_experts)
    pos = (onehot.cumsum(0) - 1).gather(1, expert.unsqueeze(1)).squeeze(1)
    kept = (pos < cap).nonzero().squeeze(1)
    return expert[kept] * cap + pos[kept], kept


_TEACHERS: dict = {}


def tokens(a, step, rank):
    """Random tokens (seeded by step and rank) and their targets: a fixed map of the
    tokens (``tanh(x W)``, W the same on every rank and step), which the model can
    learn, so that the loss falls (random targets would keep it at their variance)."""
    g = torch.Generator().manual_seed(104729 * step + rank)
    x = torch.randn(a.tokens, a.hidden, generator=g)
    if a.hidden not in _TEACHERS:
        gt = torch.Generator().manual_seed(424242)
        _TEACHERS[a.hidden] = torch.randn(a.hidden, a.hidden, generator=gt) / a.hidden ** 0.5
    return x, torch.tanh(x @ _TEACHERS[a.hidden])


def main():
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="fixed expert capacity, as DeepSpeed/GShard (even all-to-alls; "
                        "default: none, uneven all-to-alls of exactly the routed tokens)")
    a = p.parse_args()
    rank, n = init(a)
    epr = a.experts_per_rank
    if a.capacity_factor is not None and a.capacity_factor <= 0:
        p.error("--capacity-factor must be > 0")
    cap = (None if a.capacity_factor is None
           else max(1, math.ceil(a.capacity_factor * a.tokens / (epr * n))))
    mine = list(range(rank * epr, (rank + 1) * epr))
    block = Block(a, n, mine)
    opt = torch.optim.SGD(block.dense_params() + block.expert_params(), lr=a.lr)
    state = {"step": 0}

    def capacity_layer(h, expert):
        """The MoE layer with fixed capacity: even all-to-alls of ``n * epr * cap`` rows."""
        slot, kept = capacity_slots(expert, epr * n, cap)
        d = h.shape[1]
        send = h.new_zeros(epr * n * cap, d).index_copy(0, slot, h[kept])
        arrived = all_to_all(send).view(n, epr, cap, d).transpose(0, 1).reshape(epr, n * cap, d)
        done = torch.stack([block.experts[mine[i]](arrived[i]) for i in range(epr)])
        back = all_to_all(done.view(epr, n, cap, d).transpose(0, 1).reshape(-1, d))
        return h.new_zeros(h.shape).index_copy(0, kept, back[slot])

    def routed_layer(h, expert, order):
        """The MoE layer without a capacity: uneven all-to-alls of the routed tokens."""
        per_expert = torch.bincount(expert, minlength=epr * n)
        send_counts = per_expert.view(n, epr).sum(1).tolist()
        # how many tokens each source sends to each of my experts
        with CLOCK("all_to_all"):
            got = torch.empty_like(per_expert)
            dist.all_to_all_single(got, per_expert)
        got = got.view(n, epr)
        recv_counts = got.sum(1).tolist()
        arrived = all_to_all(h[order], recv_counts, send_counts)
        pieces = torch.split(arrived, got.reshape(-1).tolist())
        done = torch.cat([block.experts[mine[i % epr]](piece) for i, piece in enumerate(pieces)])
        back = all_to_all(done, send_counts, recv_counts)
        return torch.empty_like(back).index_copy(0, order, back)

    def step():
        x, target = tokens(a, state["step"], rank)
        state["step"] += 1
        opt.zero_grad()
        h, weight, expert, order = block.route(x)
        moe_out = routed_layer(h, expert, order) if cap is None else capacity_layer(h, expert)
        loss = nn.functional.mse_loss(block.finish(h, weight, moe_out), target) / n
        return train_step(loss, block.dense_params(), opt)

    def reference(steps):
        ref = Block(a, n, range(epr * n))
        ropt = torch.optim.SGD(ref.dense_params() + ref.expert_params(), lr=a.lr)
        out = []
        for s in range(steps):
            ropt.zero_grad()
            total = 0.0
            for r in range(n):
                x, target = tokens(a, s, r)
                h, weight, expert, order = ref.route(x)
                moe_out = torch.zeros_like(h)
                keep = None if cap is None else capacity_slots(expert, epr * n, cap)[1]
                for e in range(epr * n):
                    sel = (expert == e).nonzero().squeeze(1)
                    if keep is not None:  # the tokens the expert took from rank r
                        sel = sel[torch.isin(sel, keep)]
                    if len(sel):
                        moe_out = moe_out.index_copy(0, sel, ref.experts[e](h[sel]))
                loss = nn.functional.mse_loss(ref.finish(h, weight, moe_out), target) / n
                loss.backward()
                total += loss.item()
            ropt.step()
            out.append(total)
        return out

    run(a, step, reference, samples_per_step=a.tokens * n, name="moe")


if __name__ == "__main__":
    main()
