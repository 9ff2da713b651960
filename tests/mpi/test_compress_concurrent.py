"""Compressed collectives that are in flight together on one group, and in-place calls.

Two compressed calls issued back to back (async) must never match each other's
messages: each call on a group takes a sequence number, the same on every rank, and its
tags come from it. 2 ranks hide the crossing (a ring of 2 has one step), so these tests
matter at 3+ ranks; at 1 and 2 they still check the results.

In place: ``reduce_scatter_tensor(x[r*n:(r+1)*n], x)`` (NCCL, Megatron, FSDP1) and
``all_gather_into_tensor(out, out[r*n:(r+1)*n])`` give the same results as with separate
buffers, for every algorithm and codec.
"""
import numpy as np
import pytest
import torch

import mcrdl_core as mc
import mcrdl_torch as dist
from conftest import BACKENDS, RANK, SIZE
from test_compress import TOL, data, local_round_trip, rel

ALGOS = ["ring", "p2p", "a2a"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_async_all_gathers_of_different_sizes(backend):
    xa, xb = data(RANK, 1024, 20), data(RANK, 2048, 21)
    oa, ob = np.empty(SIZE * 1024, np.float32), np.empty(SIZE * 2048, np.float32)
    wa = mc.all_gather_into_tensor(oa, xa, async_op=True, backend=backend, compression="int8")
    wb = mc.all_gather_into_tensor(ob, xb, async_op=True, backend=backend, compression="int8")
    wb.wait()
    wa.wait()
    for k in range(SIZE):
        assert np.array_equal(oa[k * 1024:(k + 1) * 1024], local_round_trip("int8", data(k, 1024, 20))), k
        assert np.array_equal(ob[k * 2048:(k + 1) * 2048], local_round_trip("int8", data(k, 2048, 21))), k


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_prefetch_reduce_scatter_then_large_all_gather(backend, monkeypatch):
    """FSDP's pattern under MCRDL_COMPRESSION=int8: a gradient reduce-scatter in flight
    while the next layer's (larger, chunked) all-gather is issued."""
    monkeypatch.setenv("MCRDL_COMPRESSION", "int8")
    n, m = 3000, 600_000  # the all-gather's block is several pipelined chunks
    g = torch.from_numpy(data(RANK, SIZE * n, 22))
    shard = torch.empty(n)
    p = torch.from_numpy(data(RANK, m, 23))
    full = torch.empty(SIZE * m)
    w1 = dist.reduce_scatter_tensor(shard, g, async_op=True, backend=backend)
    w2 = dist.all_gather_into_tensor(full, p, async_op=True, backend=backend)
    w1.wait()
    w2.wait()
    exact = sum(data(k, SIZE * n, 22).astype(np.float64) for k in range(SIZE))[RANK * n:][:n]
    assert rel(shard.numpy(), exact) <= TOL["int8"] * max(SIZE - 1, 1)
    for k in range(0, SIZE):
        assert rel(full[k * m:(k + 1) * m].numpy(), data(k, m, 23)) <= TOL["int8"], k


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_calls_in_flight_than_tag_slots(backend):
    """40 async calls of three kinds and sizes at once: more than the reserved tag slots,
    so later calls wait for the slot's earlier holder instead of sharing its tags."""
    works, checks = [], []
    for i in range(40):
        n = 100 + 37 * i
        if i % 3 == 0:
            x, out = data(RANK, n, 100 + i), np.empty(SIZE * n, np.float32)
            works.append(mc.all_gather_into_tensor(out, x, async_op=True, backend=backend,
                                                   compression="fp16@ring"))
            checks.append(lambda out=out, n=n, i=i: all(
                np.array_equal(out[k * n:(k + 1) * n], local_round_trip("fp16", data(k, n, 100 + i)))
                for k in range(SIZE)))
        elif i % 3 == 1:
            x, out = data(RANK, SIZE * n, 100 + i), np.empty(n, np.float32)
            works.append(mc.reduce_scatter_tensor(out, x, async_op=True, backend=backend,
                                                  compression="none@p2p"))
            exact = sum(data(k, SIZE * n, 100 + i).astype(np.float64) for k in range(SIZE))
            checks.append(lambda out=out, e=exact[RANK * n:][:n]: rel(out, e) <= 1e-6)
        else:
            x = data(RANK, n, 100 + i)
            works.append(mc.all_reduce(x, async_op=True, backend=backend, compression="int8"))
            exact = sum(data(k, n, 100 + i).astype(np.float64) for k in range(SIZE))
            checks.append(lambda x=x, e=exact: rel(x, e) <= TOL["int8"] * 2 * max(SIZE - 1, 1))
    for w in reversed(works):
        w.wait()
    bad = [i for i, c in enumerate(checks) if not c()]
    assert not bad, f"rank {RANK}: calls {bad} gave wrong results"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_in_place_reduce_scatter(codec, algo, backend):
    n = 1000
    x = data(RANK, SIZE * n, 24)
    exact = sum(data(k, SIZE * n, 24).astype(np.float64) for k in range(SIZE))[RANK * n:][:n]
    mc.reduce_scatter_tensor(x[RANK * n:(RANK + 1) * n], x, backend=backend,
                             compression=f"{codec}@{algo}")
    quantizations = 1 if algo == "a2a" else max(SIZE - 1, 1)
    assert rel(x[RANK * n:(RANK + 1) * n], exact) <= TOL[codec] * quantizations


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_in_place_all_gather(codec, algo, backend):
    n = 1000
    out = np.zeros(SIZE * n, np.float32)
    out[RANK * n:(RANK + 1) * n] = data(RANK, n, 25)
    mc.all_gather_into_tensor(out, out[RANK * n:(RANK + 1) * n], backend=backend,
                              compression=f"{codec}@{algo}")
    for k in range(SIZE):
        xk = data(k, n, 25)
        got = out[k * n:(k + 1) * n]
        if algo == "p2p":
            assert rel(got, xk) <= TOL[codec] * max((RANK - k) % SIZE, 1), k
        else:
            assert np.array_equal(got, local_round_trip(codec, xk)), k


class TestDebugModeChecksCompressedCalls:
    """MCRDL_DEBUG=1 compares compressed calls too (codec, block, algorithm, chunks and
    the usual fields): a mismatch is a MismatchError on every rank, not garbage."""

    @pytest.fixture(autouse=True)
    def debug(self):
        rt = mc.get_runtime()
        rt.debug = True
        yield
        rt.debug = False

    @pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_codec_differs(self, backend):
        x = data(RANK, 500, 26)
        out = np.empty(SIZE * 500, np.float32)
        with pytest.raises(mc.MismatchError, match="has compression 'int4:128@ring"):
            mc.all_gather_into_tensor(out, x, backend=backend,
                                      compression="int4" if RANK == 1 else "int8")

    @pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_size_differs(self, backend):
        n = 600 if RANK == 1 else 500
        x = data(RANK, SIZE * n, 27)
        out = np.empty(n, np.float32)
        with pytest.raises(mc.MismatchError, match="elements per rank 600 where group "
                                                          "rank 0 has 500"):
            mc.reduce_scatter_tensor(out, x, backend=backend, compression="fp16")

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_consistent_compressed_call_passes(self, backend):
        x = data(RANK, 700, 28)
        mc.all_reduce(x, backend=backend, compression="int8@a2a")
        exact = sum(data(k, 700, 28).astype(np.float64) for k in range(SIZE))
        assert rel(x, exact) <= TOL["int8"] * 2
