"""Mix-and-match: hundreds of calls in a random interleaving (fixed seeds), alternating
MPI and Gloo, about half async and waited in a per-rank random order, on the world and
on a subgroup; every result checked. Includes read-after-write chains across backends
(an async all-reduce on one backend feeding an all-gather on the other), which only
come out right if the runtime orders the second call after the first."""
import numpy as np
import pytest
import torch

import mcrdl_torch as dist
from conftest import GROUPS, RANK, SIZE, assert_equal, members, values
from test_ops import reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce",
       "gather", "scatter", "send_recv", "barrier", "chain"]
NCALLS = 300


def issue(op, backend, other, dtype, count, async_op, gname, salt):
    """Issue one call; returns (work or None, check function)."""
    group, ranks = GROUPS[gname], members(gname)
    me, n = ranks.index(RANK), len(ranks)
    kw = dict(group=group, async_op=async_op, backend=backend)
    val = lambda r, c=count, s=salt: values(r, c, dtype, s)  # noqa: E731
    if op == "all_reduce":
        t = val(RANK)
        w = dist.all_reduce(t, **kw)
        return w, lambda: assert_equal(t, reference("SUM", [val(r) for r in ranks]))
    if op == "broadcast":
        t = val(RANK)
        w = dist.broadcast(t, ranks[0], **kw)
        return w, lambda: assert_equal(t, val(ranks[0]))
    if op == "all_gather":
        out = torch.zeros(n * count, dtype=dtype)
        w = dist.all_gather_into_tensor(out, val(RANK), **kw)
        return w, lambda: assert_equal(out, torch.cat([val(r) for r in ranks]))
    if op == "reduce_scatter":
        out = torch.zeros(count, dtype=dtype)
        w = dist.reduce_scatter_tensor(out, val(RANK, n * count), **kw)
        full = reference("SUM", [val(r, n * count) for r in ranks])
        return w, lambda: assert_equal(out, full[me * count:(me + 1) * count])
    if op == "all_to_all":
        cnt = lambda i, j: (i + 2 * j + salt) % 4 + 1  # noqa: E731
        ins, outs = [cnt(me, j) for j in range(n)], [cnt(j, me) for j in range(n)]
        out = torch.zeros(sum(outs), dtype=dtype)
        w = dist.all_to_all_single(out, val(RANK, sum(ins)), outs, ins, **kw)

        def check():
            parts = []
            for j, r in enumerate(ranks):
                start = sum(cnt(j, k) for k in range(me))
                parts.append(val(r, sum(cnt(j, k) for k in range(n)))[start:start + cnt(j, me)])
            assert_equal(out, torch.cat(parts))
        return w, check
    if op == "reduce":
        t = val(RANK)
        w = dist.reduce(t, ranks[-1], dist.ReduceOp.MAX, **kw)
        if RANK != ranks[-1]:  # only the root's tensor is defined afterwards (as in torch)
            return w, lambda: None
        return w, lambda: assert_equal(t, reference("MAX", [val(r) for r in ranks]))
    if op == "gather":
        outs = [torch.zeros(count, dtype=dtype) for _ in ranks] if me == 0 else None
        w = dist.gather(val(RANK), outs, ranks[0], **kw)
        return w, lambda: [assert_equal(o, val(r)) for o, r in zip(outs or [], ranks)]
    if op == "scatter":
        ins = [val(RANK, count, salt + j) for j in range(n)] if me == 0 else None
        out = torch.zeros(count, dtype=dtype)
        w = dist.scatter(out, ins, ranks[0], **kw)
        return w, lambda: assert_equal(out, val(ranks[0], count, salt + me))
    if op == "send_recv":
        if n < 2:
            return None, lambda: None
        out = torch.zeros(count, dtype=dtype)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        ws = dist.isend(val(RANK), nxt, group, tag=salt, backend=backend)
        wr = dist.irecv(out, prv, group, tag=salt, backend=backend)
        if not async_op:
            wr.wait()
            ws.wait()
            return None, lambda: assert_equal(out, val(prv))

        class Both:  # one handle for the pair, waited as a unit
            def wait(self):
                wr.wait()
                ws.wait()
        return Both(), lambda: assert_equal(out, val(prv))
    if op == "barrier":
        return dist.barrier(group, async_op, backend=backend), lambda: None
    if op == "chain":  # all_reduce(x) on `backend`, then all_gather(from x) on `other`
        x = val(RANK)
        w1 = dist.all_reduce(x, group=group, async_op=True, backend=backend)
        out = torch.zeros(n * count, dtype=dtype)
        w2 = dist.all_gather_into_tensor(out, x, group=group, async_op=True, backend=other)
        summed = reference("SUM", [val(r) for r in ranks])

        class Chain:
            def wait(self):
                w2.wait()
                w1.wait()
        return Chain(), lambda: assert_equal(out, np.concatenate([summed] * n))
    raise AssertionError(op)


def _described(check, what):
    def run():
        try:
            check()
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from None
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleaving(seed):
    calls = np.random.default_rng(seed)            # same stream on every rank
    order = np.random.default_rng(1000 + 97 * seed + RANK)  # differs per rank
    pending, done = [], 0
    for i in range(NCALLS):
        backend = ("mpi", "gloo")[i % 2] if calls.random() < 0.8 else str(calls.choice(["mpi", "gloo"]))
        other = "gloo" if backend == "mpi" else "mpi"
        op = str(calls.choice(OPS))
        dtype = DTYPES[int(calls.integers(len(DTYPES)))]
        count = int(calls.integers(1, 600))
        async_op = bool(calls.random() < 0.5) or op == "chain"
        gname = "sub" if calls.random() < 0.3 else "world"
        if RANK not in members(gname):
            continue
        work, raw_check = issue(op, backend, other, dtype, count, async_op, gname, salt=i)
        check = _described(raw_check, f"call {i}: {op} via {backend} {dtype} x{count} "
                                      f"{'async' if async_op else 'blocking'} on {gname}")
        if work is None:
            check()
            done += 1
        else:
            pending.append((work, check))
        if pending and order.random() < 0.25:  # wait a random subset, in random order
            k = int(order.integers(1, len(pending) + 1))
            idx = order.permutation(len(pending))[:k]
            for j in idx:
                pending[j][0].wait()
                pending[j][1]()
                done += 1
            pending = [p for j, p in enumerate(pending) if j not in set(idx.tolist())]
    for j in order.permutation(len(pending)):
        pending[j][0].wait()
        pending[j][1]()
        done += 1
    assert done > 0


@pytest.mark.skipif(SIZE < 2, reason="needs a peer that joins late")
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
def test_a_wait_on_gloo_alone_sleeps_in_torch(monkeypatch, op):
    """With only Gloo work in flight, a wait sleeps inside torch until Gloo's thread
    finishes the work (``GlooWork.block``) instead of polling, and the result is
    NumPy's. Rank 0 waits for peers that join 0.2 s late, so its wait must block;
    ``block`` returns within its time whether or not the work is done."""
    import time

    from mcrdl_backends import gloo as gloo_backend
    real, seen = gloo_backend.GlooWork.block, []

    def watched(self, seconds):
        t0 = time.monotonic()
        real(self, seconds)
        seen.append(time.monotonic() - t0 < 10.0)  # (never the whole wait: it returns)

    monkeypatch.setattr(gloo_backend.GlooWork, "block", watched)
    n, count = SIZE, 1 << 14
    for salt in range(3):
        dist.barrier(backend="gloo")
        if RANK != 0:
            time.sleep(0.2)
        x = values(RANK, n * count, torch.float32, salt)
        if op == "all_reduce":
            w = dist.all_reduce(x, async_op=True, backend="gloo")
            want = reference("SUM", [values(r, n * count, torch.float32, salt) for r in range(n)])
            w.wait()
            assert_equal(x, want)
        else:
            out = torch.zeros(n * count)
            w = dist.all_to_all_single(out, x, async_op=True, backend="gloo")
            w.wait()
            want = torch.cat([values(r, n * count, torch.float32, salt)[RANK * count:
                                                                        (RANK + 1) * count]
                              for r in range(n)])
            assert_equal(out, want)
    if RANK == 0:
        assert seen and all(seen), seen
