"""Compressed all-to-all on every rank, against NumPy (run at 1, 2 and 3 ranks).

Each rank can compute every rank's input (Gaussian, seeded by rank and a salt) and the
splits every rank uses (rows(src, dst) below, zeros included), so each checks what it
received: block k, from rank k, must equal a local encode/decode round trip of rank k's
block for this rank, bit for bit (one encoding per block, whatever P); where the group
spans several hosts (emulated: tests/test_multirank.py launches this file on 2 hosts of
2 ranks), blocks from this rank's own host must arrive exact instead. Uneven splits,
zero-sized blocks, 0 elements, the list form, 16-bit and float64 tensors, in place,
async, several calls in flight on one group, subgroups, mpi and gloo; the errors of bad
input (before anything is sent) and debug mode's MismatchError.
"""
import numpy as np
import pytest
import torch

import mcrdl_core as mc
from conftest import BACKENDS, RANK, SIZE
from mcrdl_core.compress import make_codec
from mcrdl_core.base.errors import (CommTimeoutError, DtypeError, InvalidArgumentError,
                                    MismatchError, UnsupportedError)
from test_compress import data, local_round_trip

CODECS = ["fp8", "int8", "fp16", "bf16", "none"]
WIDTH = 70  # elements per row: blocks end inside the codecs' blocks


def exact_from(k, ranks=None) -> bool:
    """Whether rank ``k``'s block reaches this rank raw: the same host, in a group (the
    world, or ``ranks``) that spans several hosts."""
    host = mc.get_runtime().bootstrap.host_of
    ranks = range(SIZE) if ranks is None else ranks
    return bool(host) and len({host[r] for r in ranks}) > 1 and host[k] == host[RANK]


def ref(codec, k, block, ranks=None):
    """What this rank must receive of rank ``k``'s ``block``."""
    return block.copy() if exact_from(k, ranks) else local_round_trip(codec, block)


def rows(src, dst, salt):
    """Rows rank ``src`` sends rank ``dst`` (0..3: some blocks are empty)."""
    return (src * 3 + dst * 5 + salt) % 4


def send_rows(src, salt):
    return [rows(src, d, salt) for d in range(SIZE)]


def recv_rows(dst, salt):
    return [rows(s, dst, salt) for s in range(SIZE)]


def rank_input(src, salt, width=WIDTH):
    return data(src, sum(send_rows(src, salt)) * width, salt).reshape(-1, width)


def expected(codec, salt, width=WIDTH, convert=None):
    """What this rank must receive: per sender k, the round trip of k's block for it.
    ``convert``: the sender's values as the call's tensor dtype holds them."""
    parts = []
    for k in range(SIZE):
        xk = rank_input(k, salt, width).reshape(-1)
        if convert is not None:
            xk = convert(xk)
        lo = sum(send_rows(k, salt)[:RANK]) * width
        parts.append(ref(codec, k, xk[lo:lo + rows(k, RANK, salt) * width]))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def exchange(salt, backend, **kwargs):
    """The uneven call of ``salt`` (blocking): what this rank received, flat."""
    out = np.full((sum(recv_rows(RANK, salt)), WIDTH), np.nan, np.float32)
    assert mc.all_to_all_single(out, rank_input(RANK, salt), recv_rows(RANK, salt),
                                send_rows(RANK, salt), backend=backend, **kwargs) is None
    return out.reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", CODECS)
def test_uneven_splits(codec, backend):
    assert np.array_equal(exchange(1, backend, compression=codec), expected(codec, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", CODECS)
def test_even_splits(codec, backend):
    n = 300  # per peer: two int8 blocks and a partial one
    x = data(RANK, SIZE * n, 2)
    out = np.empty(SIZE * n, np.float32)
    mc.all_to_all_single(out, x, backend=backend, compression=codec)
    for k in range(SIZE):
        want = ref(codec, k, data(k, SIZE * n, 2)[RANK * n:(RANK + 1) * n])
        assert np.array_equal(out[k * n:(k + 1) * n], want), k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_one_backend_all_to_all_schedule(codec, backend, monkeypatch):
    """The schedule of backends without tagged point-to-point in any order (NCCL's
    streams), run here on a host backend: all blocks in one backend all-to-all of
    staging bytes. Same values as the per-peer schedule: uneven splits (two patterns,
    empty blocks among them) and in place (an idle rank: ``test_zero_elements``)."""
    from mcrdl_core.compress.schedule import Channel

    monkeypatch.setattr(Channel, "force_paired", True)
    assert np.array_equal(exchange(1, backend, compression=codec), expected(codec, 1))
    assert np.array_equal(exchange(2, backend, compression=codec), expected(codec, 2))
    n = 70
    x = torch.from_numpy(data(RANK, SIZE * n, 23))
    mc.all_to_all_single(x, x, backend=backend, compression=codec)
    for k in range(SIZE):
        assert np.array_equal(x[k * n:(k + 1) * n].numpy(),
                              ref(codec, k, data(k, SIZE * n, 23)[RANK * n:(RANK + 1) * n]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_is_the_codecs(backend):
    """The received values are within each codec's stated bound of the sender's."""
    n = 2000
    x = data(RANK, SIZE * n, 3)
    for codec in ["fp8", "int8", "fp16", "bf16"]:
        out = np.empty(SIZE * n, np.float32)
        mc.all_to_all_single(out, x, backend=backend, compression=codec)
        for k in range(SIZE):
            sent = data(k, SIZE * n, 3)[RANK * n:(RANK + 1) * n].astype(np.float64)
            err = np.linalg.norm(out[k * n:(k + 1) * n] - sent) / np.linalg.norm(sent)
            assert err <= make_codec(codec).error_bound, (codec, k, err)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paired", [False, True], ids=["per-peer", "one-all-to-all"])
def test_zero_elements(backend, paired, monkeypatch):
    """No rank sends anything (0-byte Alltoallv on every rank), and a call in which this
    rank alone sends and receives nothing while the others exchange; in both schedules
    (``paired``: one backend all-to-all, as NCCL's streams get)."""
    from mcrdl_core.compress.schedule import Channel

    monkeypatch.setattr(Channel, "force_paired", paired)
    empty = np.zeros((0, 5), np.float32)
    mc.all_to_all_single(np.zeros((0, 5), np.float32), empty, [0] * SIZE, [0] * SIZE,
                         backend=backend, compression="fp8")
    mc.all_to_all_single(np.zeros(0, np.float32), np.zeros(0, np.float32), backend=backend,
                         compression="int8")
    idle = SIZE - 1

    def r(src, dst):
        return 0 if idle in (src, dst) else 2 + src + dst

    ins, outs = [r(RANK, d) for d in range(SIZE)], [r(s, RANK) for s in range(SIZE)]
    x = data(RANK, sum(ins), 4)
    out = np.full(sum(outs), np.nan, np.float32)
    mc.all_to_all_single(out, x, outs, ins, backend=backend, compression="fp16")
    off = 0
    for k in range(SIZE):
        xk = data(k, sum(r(k, d) for d in range(SIZE)), 4)
        lo = sum(r(k, d) for d in range(RANK))
        assert np.array_equal(out[off:off + outs[k]], ref("fp16", k, xk[lo:lo + outs[k]]))
        off += outs[k]
    # every rank issued the same backend primitive (the idle rank too): the group still
    # lines up for the next call
    y = np.empty(SIZE * 3, np.float32)
    mc.all_to_all_single(y, data(RANK, SIZE * 3, 40), backend=backend, compression="fp8")
    for k in range(SIZE):
        want = ref("fp8", k, data(k, SIZE * 3, 40)[RANK * 3:(RANK + 1) * 3])
        assert np.array_equal(y[k * 3:(k + 1) * 3], want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["fp8", "bf16"])
def test_async(codec, backend):
    x = rank_input(RANK, 5)
    out = np.full((sum(recv_rows(RANK, 5)), WIDTH), np.nan, np.float32)
    work = mc.all_to_all_single(out, x, recv_rows(RANK, 5), send_rows(RANK, 5),
                                async_op=True, backend=backend, compression=codec)
    work.wait()
    assert work.is_completed()
    assert np.array_equal(out.reshape(-1), expected(codec, 5))


@pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_late_peer_is_named_by_the_timeout_and_the_call_still_completes(backend):
    """Rank 0's wait on a compressed all-to-all whose peers join late times out naming
    the op, the backend and the ranks it is waiting to hear from; the work stays valid
    and completes with the right values once they join."""
    import time

    n = 50
    x = data(RANK, SIZE * n, 31)
    out = np.empty(SIZE * n, np.float32)
    # the backend set up (Gloo's first call waits for every rank), and the ranks lined
    # up: the peers' 1 s of sleep starts with rank 0's 0.3 s wait
    mc.barrier(backend=backend)
    if RANK == 0:
        w = mc.all_to_all_single(out, x, backend=backend, compression="int8", async_op=True)
        peers = ", ".join(str(k) for k in range(1, SIZE))
        with pytest.raises(CommTimeoutError, match=r"rank 0: all_to_all on group .* via "
                           r"backend '" + backend + r"\+int8:256@a2a' .*waiting on recv the "
                           r"first of the receives from ranks " + peers
                           + r" did not complete within 0.3 s"):
            w.wait(timeout=0.3)
        w.wait()
    else:
        time.sleep(1.0)
        mc.all_to_all_single(out, x, backend=backend, compression="int8")
    for k in range(SIZE):
        assert np.array_equal(out[k * n:(k + 1) * n],
                              ref("int8", k, data(k, SIZE * n, 31)[RANK * n:(RANK + 1) * n]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_in_flight_together_do_not_interfere(backend):
    """Compressed all-to-alls of different codecs and splits, a plain one between them,
    and more compressed calls than tag slots, all in flight on one group at once, waited
    in reverse order: each gets its own blocks (the crossing matters from 3 ranks)."""
    works, checks = [], []
    for i in range(20):
        salt = 10 + i
        codec = CODECS[i % len(CODECS)]
        width = 30 + 17 * (i % 4)
        x = rank_input(RANK, salt, width)
        out = np.full((sum(recv_rows(RANK, salt)), width), np.nan, np.float32)
        plain = i == 7
        works.append(mc.all_to_all_single(out, x, recv_rows(RANK, salt), send_rows(RANK, salt),
                                          async_op=True, backend=backend,
                                          compression=None if plain else codec))
        want = expected("none" if plain else codec, salt, width)
        checks.append(lambda out=out, want=want: np.array_equal(out.reshape(-1), want))
    for w in reversed(works):
        w.wait()
    bad = [i for i, c in enumerate(checks) if not c()]
    assert not bad, f"rank {RANK}: calls {bad} got wrong blocks"


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_compressed_all_gather_in_flight(backend):
    n = 500
    xg, og = data(RANK, n, 30), np.empty(SIZE * n, np.float32)
    wg = mc.all_gather_into_tensor(og, xg, async_op=True, backend=backend, compression="int8")
    x = rank_input(RANK, 31)
    out = np.empty((sum(recv_rows(RANK, 31)), WIDTH), np.float32)
    wa = mc.all_to_all_single(out, x, recv_rows(RANK, 31), send_rows(RANK, 31), async_op=True,
                              backend=backend, compression="fp8")
    wa.wait()
    wg.wait()
    assert np.array_equal(out.reshape(-1), expected("fp8", 31))
    for k in range(SIZE):
        assert np.array_equal(og[k * n:(k + 1) * n], local_round_trip("int8", data(k, n, 30)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_list_form(codec, backend):
    salt = 6
    x = rank_input(RANK, salt).reshape(-1)
    cuts = np.cumsum([0] + [n * WIDTH for n in send_rows(RANK, salt)])
    ins = [x[cuts[d]:cuts[d + 1]].copy() for d in range(SIZE)]
    outs = [np.full(n * WIDTH, np.nan, np.float32) for n in recv_rows(RANK, salt)]
    mc.all_to_all(outs, ins, backend=backend, compression=codec)
    assert np.array_equal(np.concatenate(outs), expected(codec, salt))
    outs2 = [np.full(n * WIDTH, np.nan, np.float32) for n in recv_rows(RANK, salt)]
    mc.all_to_all(outs2, ins, async_op=True, backend=backend, compression=codec).wait()
    assert np.array_equal(np.concatenate(outs2), expected(codec, salt))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_tensor_dtypes(dtype, backend):
    """16-bit tensors are encoded from float32 and stored back in their dtype; float64
    is encoded as float64."""
    salt = 7
    x = torch.from_numpy(rank_input(RANK, salt)).to(dtype)
    out = torch.empty((sum(recv_rows(RANK, salt)), WIDTH), dtype=dtype)
    mc.all_to_all_single(out, x, recv_rows(RANK, salt), send_rows(RANK, salt), backend=backend,
                         compression="fp8")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    want = expected("fp8", salt, convert=lambda v: torch.from_numpy(v).to(dtype).to(work).numpy())
    assert torch.equal(out.reshape(-1), torch.from_numpy(want).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place(backend):
    n = 400
    x = data(RANK, SIZE * n, 8)
    mc.all_to_all_single(x, x, backend=backend, compression="int8")
    for k in range(SIZE):
        want = ref("int8", k, data(k, SIZE * n, 8)[RANK * n:(RANK + 1) * n])
        assert np.array_equal(x[k * n:(k + 1) * n], want), k


def test_subgroup(grp):
    g, ranks, me = grp
    P = len(ranks)
    n = 257
    x = data(RANK, P * n, 9)
    out = np.empty(P * n, np.float32)
    mc.all_to_all_single(out, x, group=g, compression="fp8")
    for j, k in enumerate(ranks):
        want = ref("fp8", k, data(k, P * n, 9)[me * n:(me + 1) * n], ranks)
        assert np.array_equal(out[j * n:(j + 1) * n], want), j


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_blocks_that_cross_hosts_are_encoded(backend):
    """On several hosts, a peer on this rank's host (and this rank itself) gets the
    block exact and a peer on another host its int8 round trip, which differs; the plan
    says so. On one host every block is a round trip (the tests above)."""
    host = mc.get_runtime().bootstrap.host_of
    if not host or len(set(host)) < 2:
        pytest.skip("one host: every block is encoded")
    n = 300
    out = np.empty(SIZE * n, np.float32)
    mc.all_to_all_single(out, data(RANK, SIZE * n, 14), backend=backend, compression="int8")
    for k in range(SIZE):
        sent = data(k, SIZE * n, 14)[RANK * n:(RANK + 1) * n]
        got = out[k * n:(k + 1) * n]
        if host[k] == host[RANK]:
            assert np.array_equal(got, sent), k
        else:
            assert np.array_equal(got, local_round_trip("int8", sent)), k
            assert not np.array_equal(got, sent), k
    from mcrdl_core.compress.spec import Compression, plan_all_to_all
    exact = [host[k] == host[RANK] for k in range(SIZE)]
    p = plan_all_to_all(Compression("int8"), SIZE, RANK, [n] * SIZE, [n] * SIZE,
                        exact=exact)
    assert [b == n * 4 for b in p.send_bytes] == [e and k != RANK for k, e in enumerate(exact)]
    assert "exact" in str(p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_host_blocks_go_straight_between_the_arrays(backend, monkeypatch):
    """On several hosts the raw blocks for same-host peers are one send and one receive
    each, from the input into the output (float32 views of them, not staging bytes),
    none for an empty block; blocks for other hosts go as encoded bytes. An in-place
    call keeps every block in staging buffers (it must read every block before it
    writes one) and still gets the right values."""
    host = mc.get_runtime().bootstrap.host_of
    if not host or len(set(host)) < 2:
        pytest.skip("one host: every block is encoded")
    from mcrdl_core.compress.schedule import Channel

    calls, real = [], Channel.a2a_p2p

    def spy(self, send, arr, peer, tag):
        calls.append((send, peer, arr.size if arr.dtype != np.uint8 else -1))
        return real(self, send, arr, peer, tag)

    monkeypatch.setattr(Channel, "a2a_p2p", spy)
    peers = [k for k in range(SIZE) if k != RANK and host[k] == host[RANK]]
    for salt in (3, 4):
        calls.clear()
        assert np.array_equal(exchange(salt, backend, compression="int8"),
                              expected("int8", salt))
        want = [(True, k, rows(RANK, k, salt) * WIDTH) for k in peers if rows(RANK, k, salt)]
        want += [(False, k, rows(k, RANK, salt) * WIDTH) for k in peers if rows(k, RANK, salt)]
        assert sorted(c for c in calls if c[1] in peers) == sorted(want), (salt, calls)
        assert all(c[2] == -1 for c in calls if c[1] not in peers), calls  # encoded
    calls.clear()
    n = 40
    x = torch.from_numpy(data(RANK, SIZE * n, 21))
    mc.all_to_all_single(x, x, backend=backend, compression="int8")
    assert calls and all(c[2] == -1 for c in calls), calls
    for k in range(SIZE):
        assert np.array_equal(x[k * n:(k + 1) * n].numpy(),
                              ref("int8", k, data(k, SIZE * n, 21)[RANK * n:(RANK + 1) * n]))


# --- what is allowed, and bad input --------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_environment_names_all_to_all(backend, monkeypatch):
    """``MCRDL_COMPRESSION=all_to_all=fp8`` compresses an unchanged call; a bare spec
    (for the gathering and reducing ops) leaves all-to-all exact."""
    monkeypatch.setenv("MCRDL_COMPRESSION", "all_to_all=fp8")
    assert np.array_equal(exchange(12, backend), expected("fp8", 12))
    monkeypatch.setenv("MCRDL_COMPRESSION", "int8")
    assert np.array_equal(exchange(12, backend), expected("none", 12))
    monkeypatch.setenv("MCRDL_COMPRESSION", "all_to_all=fp8")  # the keyword wins
    assert np.array_equal(exchange(12, backend, compression="off"), expected("none", 12))


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_without_table_measurements_stays_plain(backend):
    got = exchange(13, backend, compression="auto:fp8+int8")
    assert np.array_equal(got, expected("none", 13))


@pytest.mark.parametrize("backend", BACKENDS)
def test_integers(backend):
    x = np.arange(SIZE * 6, dtype=np.int32) + 100 * RANK
    out = np.empty_like(x)
    with pytest.raises(DtypeError, match="compression 'fp8' is lossy and refuses int32"):
        mc.all_to_all_single(out, x, backend=backend, compression="fp8")
    mc.all_to_all_single(out, x, backend=backend, compression="none")  # lossless: allowed
    for k in range(SIZE):
        assert np.array_equal(out[6 * k:6 * (k + 1)], np.arange(6 * RANK, 6 * (RANK + 1)) + 100 * k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_before_anything_is_sent(backend):
    """Every rank raises (no rank is left in a collective): the plain call's messages."""
    x = data(RANK, 24, 14).reshape(12, 2)  # 12 rows: even at 1, 2, 3 and 4 ranks
    out = np.empty((12, 2), np.float32)
    bad = [0] * SIZE
    bad[0] = 5  # adds up to 5 rows, the tensors have 12
    with pytest.raises(InvalidArgumentError, match="sum to 5 but dim 0 of the tensor is 12"):
        mc.all_to_all_single(out, x, None, bad, backend=backend, compression="fp8")
    with pytest.raises(InvalidArgumentError, match="split sizes for a group of"):
        mc.all_to_all_single(out, x, [12] + [0] * SIZE, None, backend=backend, compression="int8")
    with pytest.raises(UnsupportedError, match="one algorithm"):
        mc.all_to_all_single(out, x, backend=backend, compression="int8@p2p")
    if SIZE > 1:  # the own block differs between the two split lists, on every rank
        ins, outs = [0] * SIZE, [0] * SIZE
        ins[RANK], outs[RANK] = 12, 0
        outs[(RANK + 1) % SIZE] = 12
        with pytest.raises(InvalidArgumentError, match="sends itself 24 elements but expects 0"):
            mc.all_to_all_single(out, x, outs, ins, backend=backend, compression="fp16")
    # nothing was left behind: the next call works
    y = np.empty(SIZE * 4, np.float32)
    mc.all_to_all_single(y, data(RANK, SIZE * 4, 15), backend=backend, compression="int8")


class TestDebugMode:
    """MCRDL_DEBUG=1: ranks that disagree on the codec or on the splits get a
    MismatchError on every rank, not garbage."""

    @pytest.fixture(autouse=True)
    def debug(self, monkeypatch):
        monkeypatch.setattr(mc.get_runtime(), "debug", True)

    @pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_codec_differs(self, backend):
        x = data(RANK, SIZE * 50, 16)
        out = np.empty(SIZE * 50, np.float32)
        with pytest.raises(MismatchError, match="has compression 'fp8:128@a2a' where group rank "
                                                "0 has 'int8:256@a2a'"):
            mc.all_to_all_single(out, x, backend=backend,
                                 compression="fp8" if RANK == 1 else "int8")

    @pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_one_rank_uncompressed(self, backend):
        x = data(RANK, SIZE * 50, 17)
        out = np.empty(SIZE * 50, np.float32)
        with pytest.raises(MismatchError, match="compression"):
            mc.all_to_all_single(out, x, backend=backend,
                                 compression=None if RANK == 1 else "fp16")

    @pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_splits_differ(self, backend):
        """Rank 0 sends rank 1 one row more than rank 1 expects."""
        ins, outs = [2] * SIZE, [2] * SIZE
        if RANK == 0:
            ins[1] = 3
        x = data(RANK, sum(ins) * 4, 18).reshape(-1, 4)
        out = np.empty((sum(outs), 4), np.float32)
        with pytest.raises(MismatchError, match="group rank 0 sends 12 elements to group rank 1, "
                                                "which expects 8"):
            mc.all_to_all_single(out, x, outs, ins, backend=backend, compression="fp8")

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_consistent_call_passes(self, backend):
        assert np.array_equal(exchange(19, backend, compression="bf16"), expected("bf16", 19))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ["ring", "a2a"])
def test_fp8_in_the_other_compressed_collectives(algo, backend):
    """fp8 is a codec like the others: the all-gather's blocks are its round trips."""
    n = 700
    out = np.empty(SIZE * n, np.float32)
    mc.all_gather_into_tensor(out, data(RANK, n, 41), backend=backend, compression=f"fp8@{algo}")
    for k in range(SIZE):
        assert np.array_equal(out[k * n:(k + 1) * n], local_round_trip("fp8", data(k, n, 41)))
    x = data(RANK, SIZE * n, 42)
    red = np.empty(n, np.float32)
    mc.reduce_scatter_tensor(red, x, backend=backend, compression=f"fp8@{algo}")
    exact = sum(data(k, SIZE * n, 42).astype(np.float64) for k in range(SIZE))[RANK * n:][:n]
    contributions = sum(np.linalg.norm(data(k, SIZE * n, 42)[RANK * n:][:n].astype(np.float64))
                        for k in range(SIZE) if k != RANK)
    quantizations = 1 if algo == "a2a" else max(SIZE - 1, 1)
    assert np.linalg.norm(red - exact) <= (make_codec("fp8").error_bound * quantizations * 1.1
                                           * contributions + 1e-6)


@pytest.mark.parametrize("codec", ["fp16", "fp8", "int8"])
def test_mcrdl_torch_takes_compression_on_both_forms(codec):
    """mcrdl_torch.all_to_all_single / all_to_all with ``compression=``: the same bits
    as the core's compressed call (each block a round trip of its sender's)."""
    import mcrdl_torch

    salt = 5
    x = torch.from_numpy(rank_input(RANK, salt).copy())
    out = torch.full((sum(recv_rows(RANK, salt)), WIDTH), float("nan"))
    mcrdl_torch.all_to_all_single(out, x, recv_rows(RANK, salt), send_rows(RANK, salt),
                                  backend="mpi", compression=codec)
    assert np.array_equal(out.numpy().reshape(-1), expected(codec, salt))
    ins = list(torch.split(x, send_rows(RANK, salt)))
    outs = [torch.full((r, WIDTH), float("nan")) for r in recv_rows(RANK, salt)]
    mcrdl_torch.all_to_all(outs, ins, backend="gloo", compression=codec)
    assert np.array_equal(torch.cat(outs).numpy().reshape(-1), expected(codec, salt))


@pytest.mark.parametrize("call", ["all_to_all_single", "all_to_all", "all_gather",
                                  "reduce_scatter", "all_reduce"])
def test_compressed_calls_let_their_tensors_go(call):
    """Once a compressed call returns, nothing of MCR-DL keeps its tensors: the host
    views these calls take of them must not tie them into a cycle the garbage collector
    cannot free (a NumPy array hides its references), which leaked every input and
    output of the DLRM app's all-to-alls (17 MB per call)."""
    import gc
    import weakref

    import mcrdl_torch

    n = 40 * SIZE
    x = torch.from_numpy(data(RANK, n, 9).copy())
    gone = []
    for _ in range(3):  # fresh tensors each time, as a training step makes
        src, out = x.clone(), torch.empty(n)
        if call == "all_to_all_single":
            mcrdl_torch.all_to_all_single(out, src, backend="mpi", compression="int8")
        elif call == "all_to_all":
            outs = list(torch.chunk(out, SIZE))
            mcrdl_torch.all_to_all(outs, list(torch.chunk(src, SIZE)), backend="mpi",
                                   compression="int8")
        elif call == "all_gather":
            src, out = src[:40].clone(), torch.empty(40 * SIZE)
            mcrdl_torch.all_gather_into_tensor(out, src, backend="mpi", compression="int8")
        elif call == "reduce_scatter":
            out = torch.empty(40)
            mcrdl_torch.reduce_scatter_tensor(out, src, backend="mpi", compression="int8")
        else:
            out = src
            mcrdl_torch.all_reduce(src, backend="mpi", compression="int8")
        assert torch.isfinite(out).all()
        gone += [weakref.ref(src), weakref.ref(out)]
        del src, out
        if call == "all_to_all":
            del outs
    gc.collect()
    assert [w() is None for w in gone] == [True] * len(gone)


def test_the_mcrdl_process_group_compresses_under_the_environment(torch_world, monkeypatch):
    """An unchanged torch program (torch.distributed on the "mcrdl" backend) gets the
    compressed all-to-all from MCRDL_COMPRESSION's all_to_all key, and the plain one
    without it."""
    import torch.distributed as tdist

    salt = 6
    for spec, codec in (("all_to_all=fp16", "fp16"), (None, "none")):
        if spec:
            monkeypatch.setenv("MCRDL_COMPRESSION", spec)
        else:
            monkeypatch.delenv("MCRDL_COMPRESSION", raising=False)
        x = torch.from_numpy(rank_input(RANK, salt).copy())
        out = torch.full((sum(recv_rows(RANK, salt)), WIDTH), float("nan"))
        tdist.all_to_all_single(out, x, recv_rows(RANK, salt), send_rows(RANK, salt))
        assert np.array_equal(out.numpy().reshape(-1), expected(codec, salt)), spec


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_mcrdl_jax_compressed_all_to_all_and_its_gradient(mode):
    """mcrdl_jax.all_to_all with ``compression=`` (uneven splits), eager and under
    jit (the core's codec in the host callback; mpi4jax has none), and its gradient:
    the backward all-to-all sends each cotangent block back through the same codec."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import mcrdl_jax

    salt, codec = 7, "fp16"
    ins, outs = tuple(send_rows(RANK, salt)), tuple(recv_rows(RANK, salt))

    def f(x):
        return mcrdl_jax.all_to_all(x, None, "mpi", ins, outs, compression=codec)

    call = jax.jit(f) if mode == "jit" else f
    x = jnp.asarray(rank_input(RANK, salt))
    y = call(x)
    assert np.array_equal(np.asarray(y).reshape(-1), expected(codec, salt))

    def weights(dst):  # rank dst's cotangent: one row per row it received
        return data(dst, sum(recv_rows(dst, salt)) * WIDTH, salt + 1).reshape(-1, WIDTH)

    def loss(x):
        return jnp.sum(f(x) * jnp.asarray(weights(RANK)))

    grad = (jax.jit(jax.grad(loss)) if mode == "jit" else jax.grad(loss))(x)
    parts = []
    for dst in range(SIZE):  # this rank's rows of every receiver's weights, round-tripped
        off = sum(recv_rows(dst, salt)[:RANK])
        block = weights(dst)[off:off + rows(RANK, dst, salt)].reshape(-1)
        parts.append(ref(codec, dst, block))
    assert np.array_equal(np.asarray(grad).reshape(-1), np.concatenate(parts))
