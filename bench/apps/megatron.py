"""A Megatron-style dense transformer LM: tensor parallelism inside each host, data
parallelism across hosts, over torch.distributed.

    mpiexec -n 2 .venv/bin/python bench/apps/megatron.py --backend mcrdl [--pg-options mpi] [--check]
    sudo .venv/bin/mcrdl cluster run --hosts 2 --ranks-per-host 2 --rate 1gbit -- \\
        .venv/bin/python bench/apps/megatron.py --backend mcrdl --tp-options mpi --dp-options gloo
    MCRDL_COMPRESSION=all_reduce=auto:bf16+int8 ... megatron.py --backend mcrdl

Only ``torch.distributed`` is called (``init_process_group(--backend)`` and
``new_group``), so the same code runs on torch's Gloo and on MCR-DL. The ranks form
``n / tp`` tensor-parallel groups of ``--tp`` consecutive ranks (default: the ranks per
host, so a TP group never leaves its host, as Megatron-LM places them) and ``tp``
data-parallel groups of the ranks with the same TP rank (one per host, across the
network). Each transformer layer is split as in Shoeybi et al. (2019):

- attention: the QKV projection is column-parallel (each TP rank owns ``heads / tp``
  heads), the output projection row-parallel;
- MLP: the first linear column-parallel, the second row-parallel;
- each row-parallel output is summed over the TP group in the forward pass
  (``all_reduce``, Megatron's *g*), and the gradient of each column-parallel input in
  the backward pass (Megatron's *f*): 4 all-reduces of ``batch x seq x dim`` per layer
  and step, inside the host;
- embeddings, layer norms, the row-parallel biases and the head are replicated in the
  TP group; every parameter's gradient is summed over the DP group in one flat
  ``all_reduce`` per step (a DDP bucket), across the hosts.

``--tp-options`` / ``--dp-options`` (mcrdl only) are the ``pg_options`` of the TP and
DP groups (e.g. ``mpi`` inside the host, ``gloo`` across): MCR-DL's per-group choice of
library; without them the groups take the default group's choice (the tuning table,
or ``--pg-options``). ``MCRDL_COMPRESSION=all_reduce=auto:...`` allows codecs on both
groups' all-reduces; the auto rule calibrates per group, so the one-host TP group keeps
the plain collective where the codec does not pay and the cross-host DP group takes it
where it does.

The data are the FSDP app's (``fsdp.batch``: sequences of a fixed random Markov chain,
seeded by step and row); each DP group member trains on its own rows of the global
batch, the TP ranks of a group on the same rows. ``--check`` trains the same model
(the full, unsplit layers, initialised alike) in one process on the global batch and
compares the losses.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp import batch, lm_arguments, train_alone
from torch_common import CLOCK, init, parser, run


class Block(nn.Module):
    """One pre-norm transformer layer, unsplit (the one-process reference, and the
    weights every TP rank takes its slices from)."""

    def __init__(self, a):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(a.dim), nn.LayerNorm(a.dim)
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.proj = nn.Linear(a.dim, a.dim)
        self.fc1 = nn.Linear(a.dim, a.ffn)
        self.fc2 = nn.Linear(a.ffn, a.dim)
        self.heads = a.heads

    def forward(self, x):
        h = x + self.proj(attention(self.qkv(self.ln1(x)), self.heads))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


def attention(qkv, heads: int):
    """Causal self-attention of ``heads`` heads on ``qkv`` = [q | k | v] (each
    heads x head-dim wide, head-major)."""
    b, s, w = qkv.shape
    q, k, v = (t.reshape(b, s, heads, -1).transpose(1, 2) for t in qkv.split(w // 3, dim=2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, w // 3)


class LM(nn.Module):
    """Embeddings, ``layers`` blocks (``Block`` or ``TPBlock``), a final norm and head;
    seeded, so every rank and the reference start from the same weights."""

    def __init__(self, a, tp=None):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(a.vocab, a.dim)
        self.pos = nn.Embedding(a.seq, a.dim)
        full = [Block(a) for _ in range(a.layers)]
        self.blocks = nn.ModuleList(full if tp is None else [TPBlock(b, *tp) for b in full])
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, a.vocab)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


class CopyToTP(torch.autograd.Function):
    """Megatron's *f*: identity forward; the backward sums the gradient over the TP group
    (each rank's column-parallel slice contributed a part of it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with CLOCK("all_reduce_tp"):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's *g*: the forward sums the row-parallel partial outputs over the TP
    group; identity backward (every rank needs the whole gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        with CLOCK("all_reduce_tp"):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _rows(w: torch.Tensor, r: int, t: int) -> torch.Tensor:
    """Rank ``r``'s block of ``t`` along dim 0."""
    k = w.shape[0] // t
    return w[r * k:(r + 1) * k]


class TPBlock(nn.Module):
    """A ``Block`` split over a TP group of ``t`` ranks, this rank being ``r``: QKV and
    fc1 column-parallel (rows of the weight), proj and fc2 row-parallel (columns), their
    biases added once after the sum."""

    def __init__(self, full: Block, group, r: int, t: int):
        super().__init__()
        dim = full.qkv.in_features
        self.group, self.heads = group, full.heads // t
        self.ln1, self.ln2 = full.ln1, full.ln2
        w, b = full.qkv.weight.detach().split(dim), full.qkv.bias.detach().split(dim)
        # q, k and v each keep this rank's heads (their rows), in the order [q | k | v]
        self.qkv_w = nn.Parameter(torch.cat([_rows(x, r, t) for x in w]).clone())
        self.qkv_b = nn.Parameter(torch.cat([_rows(x, r, t) for x in b]).clone())
        self.proj_w = nn.Parameter(_rows(full.proj.weight.detach().T, r, t).T.clone())
        self.proj_b = nn.Parameter(full.proj.bias.detach().clone())
        self.fc1_w = nn.Parameter(_rows(full.fc1.weight.detach(), r, t).clone())
        self.fc1_b = nn.Parameter(_rows(full.fc1.bias.detach(), r, t).clone())
        self.fc2_w = nn.Parameter(_rows(full.fc2.weight.detach().T, r, t).T.clone())
        self.fc2_b = nn.Parameter(full.fc2.bias.detach().clone())
        self.parallel = t > 1

    def _f(self, x):
        return CopyToTP.apply(x, self.group) if self.parallel else x

    def _g(self, x):
        return ReduceFromTP.apply(x, self.group) if self.parallel else x

    def forward(self, x):
        qkv = F.linear(self._f(self.ln1(x)), self.qkv_w, self.qkv_b)
        h = x + self._g(F.linear(attention(qkv, self.heads), self.proj_w)) + self.proj_b
        u = F.gelu(F.linear(self._f(self.ln2(h)), self.fc1_w, self.fc1_b))
        return h + self._g(F.linear(u, self.fc2_w)) + self.fc2_b


def groups(n: int, tp: int, backend: str, tp_options, dp_options):
    """Every TP group (consecutive ranks) and DP group (one rank of each TP group), made
    on every rank in the same order as ``new_group`` requires; this rank's two."""
    kw = (lambda o: {"pg_options": o} if backend == "mcrdl" and o else {})
    rank, mine = dist.get_rank(), {}
    for g in range(n // tp):
        ranks = list(range(g * tp, (g + 1) * tp))
        pg = dist.new_group(ranks, **kw(tp_options))
        if rank in ranks:
            mine["tp"] = pg
    for j in range(tp):
        ranks = list(range(j, n, tp))
        pg = dist.new_group(ranks, **kw(dp_options))
        if rank in ranks:
            mine["dp"] = pg
    return mine["tp"], mine["dp"]


def ranks_per_host(n: int) -> int:
    """The launcher's ranks per host (the emulated cluster's, torchrun's, hydra's)."""
    for var in ("MCRDL_CLUSTER_RANKS_PER_HOST", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return n


def main():
    p = parser(__doc__)
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel group size (default: the ranks per host)")
    p.add_argument("--tp-options", default=None, help="mcrdl: pg_options of the TP groups")
    p.add_argument("--dp-options", default=None, help="mcrdl: pg_options of the DP groups")
    lm_arguments(p, "sequences per DP rank per step")
    a = p.parse_args()
    rank, n = init(a)
    tp = a.tp or ranks_per_host(n)
    if n % tp or a.heads % tp or a.ffn % tp:
        raise SystemExit(f"megatron.py: --tp {tp} must divide the ranks ({n}), --heads "
                         f"({a.heads}) and --ffn ({a.ffn})")
    dp = n // tp
    tp_group, dp_group = groups(n, tp, a.backend, a.tp_options, a.dp_options)
    model = LM(a, (tp_group, rank % tp, tp))
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=a.lr)
    state = {"step": 0}
    d = rank // tp  # this rank's place in its DP group: its rows of the global batch

    def step():
        seqs = batch(a, state["step"], range(d * a.batch, (d + 1) * a.batch))
        state["step"] += 1
        opt.zero_grad()
        logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), seqs[:, 1:].reshape(-1)) / dp
        loss.backward()
        if dp > 1:  # one flat bucket of every gradient, summed across the hosts
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            with CLOCK("all_reduce_dp"):
                dist.all_reduce(flat, group=dp_group)
            off = 0
            for q in params:
                q.grad.copy_(flat[off:off + q.numel()].view_as(q.grad))
                off += q.numel()
        opt.step()
        total = loss.detach().clone()
        if dp > 1:
            with CLOCK("all_reduce_dp"):
                dist.all_reduce(total, group=dp_group)
        return total.item()

    def reference(steps):
        return train_alone(a, LM(a), steps, dp * a.batch)

    # Adam: the last-bit differences of the TP sums (another order than one matmul) grow
    # to ~1e-4 of the loss within 20 steps, as in the FSDP app
    run(a, step, reference, samples_per_step=a.batch * dp, name="megatron", tolerance=1e-3)


if __name__ == "__main__":
    main()
