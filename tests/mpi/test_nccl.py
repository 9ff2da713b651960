"""NCCL set-up across ranks and CUDA buffers through every backend.

Without a GPU: the NCCL unique id made on a group's first rank reaches every member
byte for byte through the core's bootstrap (the real ``nccl.get_unique_id`` when CuPy
can load NCCL — it needs no GPU — else an injected id maker), for the world and for a
subgroup whose members only take part; every rank gives the same reason for NCCL being
unavailable and picks the same backend for CUDA buffers. With GPUs (marked ``gpu``):
every op on CuPy arrays through mpi and gloo (ranks may share a GPU) and nccl (a GPU
per rank)."""
import os

import numpy as np
import pytest

import mcrdl_core as core
from conftest import RANK, SIZE, SUB_RANKS
from mcrdl_backends.nccl import id_bytes, nccl_library, share_unique_id, shared_gpu_reason
from mcrdl_core.memory import cuda as mc_cuda
from mcrdl_core import dtypes as dt
from mcrdl_core.memory.buffer import Buffer, Device
from mcrdl_core.base.errors import BackendUnavailableError, InvalidArgumentError
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.dispatch.p2p import P2POp, batch_isend_irecv

RT = core.get_runtime()
BS = RT.bootstrap
NCCL_MOD, NCCL_WHY = nccl_library()
GPU_REASON = mc_cuda.device_reason()


def _make_id():
    """The real NCCL unique id if CuPy can load NCCL, else 128 random bytes."""
    return NCCL_MOD.get_unique_id() if NCCL_MOD is not None else os.urandom(128)


@pytest.mark.parametrize("which", ["world", "sub"])
def test_unique_id_reaches_every_member_intact(which):
    ranks = list(range(SIZE)) if which == "world" else SUB_RANKS
    made = []

    def maker():
        made.append(_make_id())
        return made[0]

    if RANK in ranks:
        uid = share_unique_id(BS, ranks, maker)
        assert bool(made) == (RANK == ranks[0]), "only the group's first rank makes the id"
        got = id_bytes(uid)
        assert len(got) == 128
        seen = BS.group_allgather(got, ranks)
        origin = seen[0]
        if made:
            assert id_bytes(made[0]) == origin == got
        assert all(s == origin for s in seen), f"rank {RANK}: ids differ across members"
    # a second handshake on the same group gets a fresh id (no stale store key / message)
    if RANK in ranks:
        second = id_bytes(share_unique_id(BS, ranks, lambda: b"\x07" * 128))
        assert second == b"\x07" * 128
    core.barrier()


def test_handshake_used_the_real_nccl_id_maker_where_possible():
    if NCCL_MOD is None:
        pytest.skip(f"NCCL cannot be loaded here, so an injected id maker was used: {NCCL_WHY}")
    uid = NCCL_MOD.get_unique_id()
    assert len(id_bytes(uid)) == 128


def test_every_rank_gives_the_same_nccl_verdict_and_choice():
    reason = RT.unavailable_reason("nccl")
    fake = Buffer(0, (16,), dt.float32, Device("cuda", 0))  # metadata only
    try:
        pick = RT.select(Op.ALL_REDUCE, RT.world, fake, None, ReduceOp.SUM).name
    except core.McrdlError as exc:
        pick = f"error: {type(exc).__name__}"
    views = BS.allgather((reason, pick))
    assert all(v == views[0] for v in views), views
    if reason is not None:
        assert pick != "nccl"
        if mc_cuda.cupy_reason() is None:
            assert pick == "mpi"


def test_explicit_nccl_without_it_fails_before_sending():
    if RT.unavailable_reason("nccl") is None:
        pytest.skip("nccl can run here")
    a = np.ones(4, dtype=np.float32)
    with pytest.raises(BackendUnavailableError, match="backend 'nccl' is not available: "):
        core.all_reduce(a, backend="nccl")
    np.testing.assert_array_equal(a, 1)  # nothing was sent or changed
    core.barrier()  # every rank is still in step


# --- batched send/recv (item 23), on the host backends here and on NCCL with GPUs ------------
def _ring_batch(backend, make, host):
    """Every rank sends to both neighbours and receives from both in one batch, sends
    listed first (one by one, that order deadlocks on NCCL). Checked against what
    every rank can compute."""
    if SIZE == 1:
        pytest.skip("needs 2 ranks")
    n = 5
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    rightward = make(np.arange(n, dtype=np.float32) + 10 * RANK + 1)
    leftward = make(np.arange(n, dtype=np.float32) + 10 * RANK + 2)
    from_left = make(np.zeros(n, dtype=np.float32))
    from_right = make(np.zeros(n, dtype=np.float32))
    works = batch_isend_irecv([P2POp("isend", rightward, right, tag=1),
                               P2POp(core.isend, leftward, left, tag=2),
                               P2POp("irecv", from_left, left, tag=1),
                               P2POp(core.irecv, from_right, right, tag=2)], backend=backend)
    assert len(works) == 4
    for w in works:
        w.wait()
    np.testing.assert_array_equal(host(from_left), np.arange(n) + 10 * left + 1)
    np.testing.assert_array_equal(host(from_right), np.arange(n) + 10 * right + 2)
    if backend != "nccl":
        assert works[2].result() == left and works[3].result() == right  # global ranks


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_batch_isend_irecv_ring_on_host_backends(backend):
    _ring_batch(backend, lambda a: a, lambda a: a)


def test_batch_isend_irecv_refuses_bad_batches_before_sending():
    a = np.ones(3, dtype=np.float32)
    with pytest.raises(InvalidArgumentError, match="op must be isend or irecv"):
        P2POp("all_reduce", a, 0)
    with pytest.raises(InvalidArgumentError, match="non-empty list of P2POp"):
        batch_isend_irecv([])
    sub = core.new_group(list(range(SIZE)))
    with pytest.raises(InvalidArgumentError, match="same group"):
        batch_isend_irecv([P2POp("isend", a, 0), P2POp("irecv", a.copy(), 0, group=sub)])
    with pytest.raises(InvalidArgumentError, match=r"p2p_op_list\[0\].peer"):
        batch_isend_irecv([P2POp("isend", a, SIZE + 3)], backend="mpi")
    core.barrier()


# --- bench/gpu_check.py across ranks (item 22) -------------------------------------------------
def _gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("skipping_rank", [None, SIZE - 1])
def test_gpu_check_skips_together_and_its_checks_pass_on_host_arrays(monkeypatch, skipping_rank):
    """gpu_check's own op checks on host arrays over mpi; when one rank cannot build the
    framework, every rank skips it (before, the others ran its collectives alone)."""
    gc = _gpu_check()

    class HostArrays:
        name, mutable = "numpy", True

        def __init__(self):
            if RANK == skipping_rank:
                raise gc.Skip("not on this rank")

        make = staticmethod(np.array)
        host = staticmethod(np.asarray)

        @staticmethod
        def empty(n):
            return np.zeros(n, dtype=np.float32)

    monkeypatch.setitem(gc.FRAMEWORKS, "numpy", HostArrays)
    rows = gc.run_part(core, "test", ["mpi"], ["numpy"], RANK, SIZE, stream_checks=False)
    if skipping_rank is None:
        bad = [r for r in rows if r["status"] == "FAIL"]
        assert not bad, bad
        assert len([r for r in rows if r["status"] == "PASS"]) == (11 if SIZE > 1 else 10)
    else:
        assert [(r["check"], r["status"]) for r in rows] == [("every op", "SKIP")]
        assert rows[0]["detail"] == ("not on this rank" if SIZE == 1
                                     else f"rank {SIZE - 1}: not on this rank")


@pytest.mark.gpu
def test_batch_isend_irecv_ring_on_nccl():
    cp = _gpu_backend("nccl")
    _ring_batch("nccl", cp.asarray, cp.asnumpy)


# --- with GPUs (skipped here) --------------------------------------------------------------
def _gpu_backend(backend):
    if GPU_REASON is not None:
        pytest.skip(f"needs a CUDA GPU: {GPU_REASON}")
    reason = RT.unavailable_reason(backend)
    if reason is None:
        reason = RT.backend(backend).unsupported_reason(Op.ALL_REDUCE, Device("cuda", 0),
                                                        dt.float32, ReduceOp.SUM)
    if reason is None and backend == "nccl":
        # NCCL needs a GPU per rank; on one GPU shared by the ranks (a single-GPU
        # machine) every rank skips alike, from the bus ids every rank gathered
        dev = BS.local_rank % mc_cuda.device_count()
        reason = shared_gpu_reason(RT.group(None),
                                   BS.allgather((BS.hostname(), mc_cuda.pci_bus_id(dev))))
    if reason is not None:
        pytest.skip(reason)
    import cupy as cp

    cp.cuda.Device(BS.local_rank % mc_cuda.device_count()).use()
    return cp


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mpi", "gloo", "nccl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_cuda_collectives_across_ranks(backend, dtype):
    cp = _gpu_backend(backend)
    np_dt = dt.lookup(dtype).np_dtype
    n = 6
    mine = (np.arange(n) + RANK + 1).astype(np_dt)
    every = [(np.arange(n) + r + 1).astype(np_dt) for r in range(SIZE)]

    def dev(a):  # bfloat16 lives on the GPU as its bits (CuPy has no bfloat16)
        return cp.asarray(a.view(np.uint16)) if dtype == "bfloat16" else cp.asarray(a)

    def b(x):  # a Buffer with the real dtype, made by hand (DLPack would say uint16)
        return Buffer(x.data.ptr, x.shape, dt.lookup(dtype), Device("cuda", x.device.id),
                      owner=x)

    def host(x):
        return cp.asnumpy(x).view(np_dt).astype(np.float64)

    x = dev(mine)
    core.all_reduce(b(x), "sum", backend=backend)
    np.testing.assert_allclose(host(x), sum(e.astype(np.float64) for e in every), rtol=1e-2)

    out = cp.zeros(n * SIZE, dtype=x.dtype)
    core.all_gather_into_tensor(b(out), b(dev(mine)), backend=backend)
    np.testing.assert_allclose(host(out), np.concatenate(every).astype(np.float64))

    y = dev(mine if RANK == 0 else np.zeros(n, np_dt))
    core.broadcast(b(y), 0, backend=backend)
    np.testing.assert_allclose(host(y), every[0].astype(np.float64))

    if SIZE > 1:  # a ring as one batch: send-then-recv one by one can deadlock on NCCL
        peer, src = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        got = cp.zeros(n, dtype=x.dtype)
        works = batch_isend_irecv([P2POp("isend", b(dev(mine)), peer),
                                   P2POp("irecv", b(got), src)], backend=backend)
        for w in works:
            w.wait()
        np.testing.assert_allclose(host(got), every[src].astype(np.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mpi", "gloo", "nccl"])
def test_cuda_all_to_all_uneven(backend):
    cp = _gpu_backend(backend)
    send_counts = [r + 1 for r in range(SIZE)]  # rank r gets r+1 elements from everyone
    recv_counts = [RANK + 1] * SIZE
    inp = cp.concatenate([cp.full(c, RANK * 10 + p, dtype=cp.float32)
                          for p, c in enumerate(send_counts)])
    out = cp.zeros(sum(recv_counts), dtype=cp.float32)
    core.all_to_all_single(out, inp, recv_counts, send_counts, backend=backend)
    expected = np.concatenate([np.full(RANK + 1, p * 10 + RANK, np.float32) for p in range(SIZE)])
    np.testing.assert_array_equal(cp.asnumpy(out), expected)
