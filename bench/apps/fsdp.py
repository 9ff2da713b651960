"""A GPT-2 language model (HuggingFace ``transformers``, built from a config: no weights
downloaded) trained with FSDP2 over torch.distributed.

    mpiexec -n 2 .venv/bin/python bench/apps/fsdp.py --backend mcrdl [--pg-options mpi] [--check]
    mpiexec -n 2 .venv/bin/python bench/apps/fsdp.py --backend gloo
    MCRDL_COMPRESSION=all_gather=int8,reduce_scatter=int8 mpiexec -n 2 ... --backend mcrdl

Only ``torch.distributed`` is called (``init_process_group(--backend)``), so the same
code runs on torch's Gloo and on MCR-DL's registered backend. The model is
``GPT2LMHeadModel(GPT2Config(...))`` at the widths of ``--dim``, ``--heads``, ``--ffn``,
``--layers``, ``--vocab`` and ``--seq`` (dropout 0, so runs are comparable), its weights
drawn by transformers' own initialisation from a fixed seed (``pip install
'mcr-dl[apps]'`` installs transformers). Where transformers is not installed, or with
``--model small``, a GPT-style LM made here of ``nn.TransformerEncoderLayer`` layers
takes its place, and a one-line note says so. Every transformer layer (GPT-2's
``GPT2Block``s) and the model around them are sharded with FSDP2 (``fully_shard``):
each rank holds 1/n of
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

import importlib.util
import sys
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


def gpt2(a):
    """HuggingFace's GPT-2 (language-model head tied to the token embedding) at this
    app's widths, from a config; seeded, so every rank and the reference agree."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # (its note that GPT-2's eos id 50256 > our vocab)
    config = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.dim, n_layer=a.layers,
                        n_head=a.heads, n_inner=a.ffn, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class GPT2Logits(nn.Module):
    """``GPT2LMHeadModel`` giving its logits (as ``LM`` does); ``layers`` are its blocks."""

    def __init__(self, a):
        super().__init__()
        self.model = gpt2(a)

    @property
    def layers(self):
        return self.model.transformer.h  # (a property: not a second parent of the blocks)

    def forward(self, x):
        return self.model(input_ids=x, use_cache=False).logits


def build(a):
    """The model of ``--model``: ``gpt2`` (HuggingFace), ``small`` (``LM``) or ``auto``
    (gpt2 where transformers is installed, else small with a one-line note)."""
    if a.model == "auto":
        a.model = "gpt2" if importlib.util.find_spec("transformers") else "small"
        if a.model == "small" and a.note:
            print("fsdp.py: transformers is not installed (pip install 'mcr-dl[apps]'): "
                  "training the small GPT-style LM of this file instead of GPT-2",
                  file=sys.stderr, flush=True)
            a.note = False
    return GPT2Logits(a) if a.model == "gpt2" else LM(a)


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


def train_alone(a, model, steps: int, rows: int) -> list:
    """``--check``'s reference: ``model`` trained in one process with Adam on the first
    ``rows`` sequences of every step's global batch; its losses."""
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    out = []
    for s in range(steps):
        seqs = batch(a, s, range(rows))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(seqs[:, :-1]).reshape(-1, a.vocab),
                                           seqs[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def lm_arguments(p, batch_help: str = "sequences per rank per step") -> None:
    """The language model's and its data's options (this app's and megatron.py's)."""
    p.add_argument("--batch", type=int, default=4, help=batch_help)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam step")


def main():
    p = parser(__doc__)
    lm_arguments(p)
    p.add_argument("--model", choices=("auto", "gpt2", "small"), default="auto",
                   help="gpt2: HuggingFace GPT2LMHeadModel from a config (needs "
                        "transformers); small: a GPT-style LM of nn.TransformerEncoderLayer; "
                        "auto (default): gpt2 where transformers is installed, else small")
    a = p.parse_args()
    # FSDP2 warns that the model's output is a view (of the head's matmul); nothing here
    # changes it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = init(a)
    a.note = rank == 0
    model = build(a)
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
        return train_alone(a, build(a), steps, n * a.batch)

    # Adam divides each step by the root of its second moment, so the last-bit
    # differences of summing the gradients in another order (FSDP's reduce-scatter
    # against one process's backward) grow to ~1e-4 of the loss within 20 steps
    run(a, step, reference, samples_per_step=a.batch * n, name="fsdp", clocked=False,
        tolerance=1e-3)


if __name__ == "__main__":
    main()
