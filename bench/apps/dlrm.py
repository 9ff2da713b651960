"""A DLRM (deep learning recommendation model) trained over torch.distributed.

    mpiexec -n 2 .venv/bin/python bench/apps/dlrm.py --backend mcrdl [--pg-options mpi] [--check]
    mpiexec -n 2 .venv/bin/python bench/apps/dlrm.py --backend gloo

The program only calls ``torch.distributed`` (``init_process_group(--backend)``), so
the same code runs on Gloo and on MCR-DL. The model is the one of Naumov et al. (2019)
with its hybrid parallelism:

- embedding tables (EmbeddingBag, sum of ``--bag`` rows per sample) are *model
  parallel*: table t lives on rank t mod n, which looks up the whole global batch; an
  ``all_to_all_single`` (uneven when n does not divide the table count) hands every rank
  the embeddings of its own samples (the backward pass sends the gradients back);
- the bottom MLP (dense features) and the top MLP (after the dot-product interaction of
  all feature vectors) are *data parallel*: their gradients are summed with one flat
  ``all_reduce`` per step.

Random data, the same on every backend (seeded by step), with labels drawn from a
fixed teacher (``teacher``) so that the loss falls; each rank's loss is its
local mean divided by n, so the sum over ranks is the global mean. ``--check`` trains
the same model in one process on the global batch and compares the losses. The result
line (JSON) gives samples/s and the share of the step spent in communication.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from torch_common import all_to_all, init, parser, run, train_step


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Parts:
    """The model's parameters, built identically on every rank (seeded)."""

    def __init__(self, a, owned):
        torch.manual_seed(0)
        self.bottom = mlp([a.dense] + a.bottom + [a.dim])
        n_int = (a.tables + 1) * a.tables // 2
        self.top = mlp([a.dim + n_int] + a.top + [1])
        self.tables = {}
        for t in range(a.tables):
            torch.manual_seed(100 + t)
            emb = nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True)
            nn.init.uniform_(emb.weight, -0.05, 0.05)
            if t in owned:
                self.tables[t] = emb

    def dense_params(self):
        return list(self.bottom.parameters()) + list(self.top.parameters())

    def sparse_params(self):
        return [e.weight for e in self.tables.values()]


_TEACHERS: dict = {}


def teacher(a):
    """What the labels follow, fixed for the run (the same on every rank and step): a
    weight per dense feature and a value per embedding row. A sample's click
    probability is the sigmoid of its dense features times those weights plus the mean
    value of its rows in each table, so the MLPs and the tables both have something to
    learn and the loss falls below ln 2 (uniformly random labels would keep it there,
    whatever the communication does)."""
    key = (a.dense, a.tables, a.rows)
    if key not in _TEACHERS:
        g = torch.Generator().manual_seed(424242)
        _TEACHERS[key] = (3 * torch.randn(a.dense, generator=g) / a.dense ** 0.5,
                          torch.randn(a.tables, a.rows, generator=g))
    return _TEACHERS[key]


def batch(a, step, global_batch):
    g = torch.Generator().manual_seed(7919 * step + 1)
    dense = torch.rand(global_batch, a.dense, generator=g)
    idx = torch.randint(0, a.rows, (a.tables, global_batch, a.bag), generator=g)
    w, rows = teacher(a)
    logit = (dense - 0.5) @ w + torch.gather(rows, 1, idx.reshape(a.tables, -1)).reshape(
        a.tables, global_batch, a.bag).mean(2).sum(0) / a.tables ** 0.5
    labels = (torch.rand(global_batch, generator=g) < torch.sigmoid(logit)).float()
    return dense, idx, labels


def interact(bottom_out, embs):
    """DLRM's dot interaction: the pairwise dot products of the T+1 feature vectors
    (upper triangle), next to the bottom MLP's output."""
    z = torch.cat([bottom_out.unsqueeze(1), embs], dim=1)  # [B, T+1, dim]
    dots = torch.bmm(z, z.transpose(1, 2))
    i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
    return torch.cat([bottom_out, dots[:, i, j]], dim=1)


def owners(a, n):
    return [[t for t in range(a.tables) if t % n == r] for r in range(n)]


def main():
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100000, help="rows per table")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--bag", type=int, default=8, help="rows summed per sample and table")
    p.add_argument("--dense", type=int, default=13, help="dense features")
    p.add_argument("--bottom", type=int, nargs="+", default=[256, 128])
    p.add_argument("--top", type=int, nargs="+", default=[256, 128])
    p.add_argument("--lr", type=float, default=0.5, help="SGD step (0.5: the loss falls within 200 steps)")
    a = p.parse_args()
    rank, n = init(a)
    own = owners(a, n)
    parts = Parts(a, own[rank])
    perm = torch.tensor([t for r in range(n) for t in own[r]]).argsort()  # arrival -> table order
    opt = torch.optim.SGD(parts.dense_params() + parts.sparse_params(), lr=a.lr)
    B, lo = a.batch, rank * a.batch
    state = {"step": 0}
    loss_fn = nn.BCEWithLogitsLoss()

    def step():
        dense, idx, labels = batch(a, state["step"], B * n)
        state["step"] += 1
        opt.zero_grad()
        mine = own[rank]
        if mine:  # [global batch, my tables, dim]
            local = torch.stack([parts.tables[t](idx[t]) for t in mine], dim=1)
        else:
            local = torch.zeros(B * n, 0, a.dim)
        width = a.dim
        recv = all_to_all(local.reshape(-1), [B * len(own[s]) * width for s in range(n)],
                          [B * len(mine) * width] * n)
        pieces = torch.split(recv, [B * len(own[s]) * width for s in range(n)])
        embs = torch.cat([x.view(B, len(own[s]), width) for s, x in enumerate(pieces)], dim=1)
        embs = embs[:, perm]
        logits = parts.top(interact(parts.bottom(dense[lo:lo + B]), embs)).squeeze(1)
        loss = loss_fn(logits, labels[lo:lo + B]) / n
        return train_step(loss, parts.dense_params(), opt)

    def reference(steps):
        ref = Parts(a, range(a.tables))
        ropt = torch.optim.SGD(ref.dense_params() + ref.sparse_params(), lr=a.lr)
        out = []
        for s in range(steps):
            dense, idx, labels = batch(a, s, B * n)
            ropt.zero_grad()
            embs = torch.stack([ref.tables[t](idx[t]) for t in range(a.tables)], dim=1)
            logits = ref.top(interact(ref.bottom(dense), embs)).squeeze(1)
            loss = loss_fn(logits, labels)
            loss.backward()
            ropt.step()
            out.append(loss.item())
        return out

    run(a, step, reference, samples_per_step=B * n, name="dlrm")


if __name__ == "__main__":
    main()
