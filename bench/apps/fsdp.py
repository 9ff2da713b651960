"""A small GPT-style transformer language model trained with FSDP2 over torch.distributed.

    mpiexec -n 2 .venv/bin/python bench/apps/fsdp.py --backend mcrdl [--pg-options mpi] [--check]
    mpiexec -n 2 .venv/bin/python bench/apps/fsdp.py --backend gloo
    MCRDL_COMPRESSION=all_gather=int8,reduce_scatter=int8 mpiexec -n 2 ... --backend mcrdl

Only ``torch.distributed`` is called (``init_process_group(--backend)``), so the same
code runs on torch's Gloo and on MCR-DL's registered backend. Every transformer layer
(pre-norm causal self-attention and an MLP, ``nn.TransformerEncoderLayer``) and the
model around them are sharded with FSDP2 (``fully_shard``): each rank holds 1/n of
every parameter; each layer's forward and backward all-gather its parameters
(``all_gather_into_tensor``) and its gradients are reduce-scattered
(``reduce_scatter_tensor``), the communication that MCR-DL's compressed all-gather and
reduce-scatter (``MCRDL_COMPRESSION``) shrink. The data are token sequences of a fixed
random Markov chain (``chain``: each token has a few likely successors), the same on
every backend (seeded by step and rank), so the loss falls from ln(vocab) towards the
chain's entropy. ``--check`` trains the same model in one process on the global batch
and compares the losses. The result line (JSON) gives samples (sequences) per second;
FSDP's own calls are not on the apps' communication clock, so its share is not given.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_common import init, parser, run


class LM(nn.Module):
    """Token and position embeddings, ``layers`` causal transformer layers, a head."""

    def __init__(self, a):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(a.dim, a.heads, a.ffn, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(a.seq),
                             persistent=False)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


_CHAINS: dict = {}


def chain(vocab: int) -> torch.Tensor:
    """The data's transition probabilities, fixed for the run: each token's successors
    drawn from a sharp softmax, so a few of them take most of the mass."""
    if vocab not in _CHAINS:
        g = torch.Generator().manual_seed(424242)
        _CHAINS[vocab] = torch.softmax(4 * torch.randn(vocab, vocab, generator=g), dim=1)
    return _CHAINS[vocab]


def batch(a, step: int, rows: range) -> torch.Tensor:
    """Sequences ``rows`` of the global batch of ``step`` (``seq + 1`` tokens each: inputs
    and shifted targets), drawn whole from the chain; the same rows whatever the ranks."""
    p = chain(a.vocab)
    out = []
    for r in rows:
        g = torch.Generator().manual_seed(7919 * step + 31 * r + 1)
        t = [int(torch.randint(0, a.vocab, (1,), generator=g))]
        u = torch.rand(a.seq, generator=g)
        cdf = p.cumsum(1)
        for i in range(a.seq):
            t.append(min(int(torch.searchsorted(cdf[t[-1]], u[i])), a.vocab - 1))
        out.append(t)
    return torch.tensor(out)


def main():
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam step")
    a = p.parse_args()
    # FSDP2 warns that the model's output is a view (of the head's matmul); nothing here
    # changes it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = init(a)
    model = LM(a)
    mesh = init_device_mesh("cpu", (n,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    loss_fn = nn.CrossEntropyLoss()
    state = {"step": 0}

    def step():
        seqs = batch(a, state["step"], range(rank * a.batch, (rank + 1) * a.batch))
        state["step"] += 1
        opt.zero_grad()
        logits = model(seqs[:, :-1])
        loss = loss_fn(logits.reshape(-1, a.vocab), seqs[:, 1:].reshape(-1))
        loss.backward()  # FSDP averages the gradients over ranks (reduce-scatter)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item() / n

    def reference(steps):
        ref = LM(a)
        ropt = torch.optim.Adam(ref.parameters(), lr=a.lr)
        out = []
        for s in range(steps):
            seqs = batch(a, s, range(n * a.batch))
            ropt.zero_grad()
            loss = loss_fn(ref(seqs[:, :-1]).reshape(-1, a.vocab), seqs[:, 1:].reshape(-1))
            loss.backward()
            ropt.step()
            out.append(loss.item())
        return out

    # Adam divides each step by the root of its second moment, so the last-bit
    # differences of summing the gradients in another order (FSDP's reduce-scatter
    # against one process's backward) grow to ~1e-4 of the loss within 20 steps
    run(a, step, reference, samples_per_step=a.batch * n, name="fsdp", clocked=False,
        tolerance=1e-3)


if __name__ == "__main__":
    main()
