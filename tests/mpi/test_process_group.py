"""torch.distributed.init_process_group("mcrdl"): real torch clients on MCR-DL.

Runs on every rank (1, 2 or 3) under mpiexec. The default group is created by torch
itself (``init_process_group("mcrdl")`` with no arguments: the env:// rendezvous gets
its variables from MPI through the autoload hook). Every result is checked on every
rank against a reference computed locally from every rank's inputs (the inputs are
seeded per rank, so each rank can rebuild all of them); training is checked against
the same model trained in one process on the union of the ranks' batches (what DDP,
FSDP and FSDP2 compute, up to the order of the reduction). The same clients under
``gloo`` are compared with these in ``bench/apps --check`` (tests/test_process_group_apps.py).
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from mcrdl_core.observe.logger import logger

RANK = int(os.environ.get("PMI_RANK", os.environ.get("RANK", 0)))  # mpiexec, torchrun


pytestmark = pytest.mark.usefixtures("torch_world")  # conftest: an "mcrdl" default group


def _n():
    return dist.get_world_size()


def _vals(rank, count, dtype=torch.float32, salt=0):
    v = (np.arange(count) * 7 + rank * 3 + salt) % 5 + 1
    return torch.tensor(v, dtype=torch.float64).to(dtype)


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(a.double(), torch.as_tensor(b).double().reshape(a.shape),
                               rtol=tol, atol=tol, msg=lambda m: f"rank {RANK}: {m}")


# --- the backend itself --------------------------------------------------------------------
def test_registered_and_named():
    assert "MCRDL" in dist.Backend._plugins
    assert dist.get_backend() == "mcrdl"
    pg = dist.distributed_c10d._get_default_group()
    assert pg.getBackendName() == "mcrdl" and pg.name() == "mcrdl"
    assert pg.size() == _n() and pg.rank() == dist.get_rank() == RANK
    assert pg.group_name == dist.distributed_c10d._get_process_group_name(pg)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product", "premul"])
def test_all_reduce_ops(op):
    n = _n()
    t = _vals(RANK, 5)
    inputs = np.stack([_vals(r, 5).numpy() for r in range(n)])
    torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}.get(op)
    if op == "premul":
        torch_op = dist._make_nccl_premul_sum(0.5)
    expected = {"sum": inputs.sum(0), "avg": inputs.mean(0), "max": inputs.max(0),
                "min": inputs.min(0), "product": inputs.prod(0), "premul": 0.5 * inputs.sum(0)}[op]
    dist.all_reduce(t, op=torch_op)
    _close(t, expected)


def test_bitwise_all_reduce():
    n = _n()
    t = _vals(RANK, 6, torch.int64, salt=3)
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    expected = np.bitwise_xor.reduce(np.stack([_vals(r, 6, torch.int64, 3).numpy()
                                               for r in range(n)]), axis=0)
    assert t.tolist() == expected.tolist()


def test_rooted_and_gathering_collectives():
    n, root = _n(), _n() - 1
    ins = [_vals(r, 4) for r in range(n)]
    t = ins[RANK].clone()
    dist.broadcast(t, src=root)
    _close(t, ins[root])
    t = ins[RANK].clone()
    dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
    if RANK == root:
        _close(t, sum(ins))
    outs = [torch.empty(4) for _ in range(n)]
    dist.all_gather(outs, ins[RANK])
    for o, e in zip(outs, ins):
        _close(o, e)
    flat = torch.empty(4 * n)
    dist.all_gather_into_tensor(flat, ins[RANK])
    _close(flat, torch.cat(ins))
    big = [_vals(r, 4 * n, salt=1) for r in range(n)]
    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, big[RANK])
    _close(out, sum(big)[4 * RANK:4 * RANK + 4])
    out = torch.empty(4)
    dist.reduce_scatter(out, list(big[RANK].chunk(n)), op=dist.ReduceOp.MAX)
    _close(out, torch.stack(big).max(0).values[4 * RANK:4 * RANK + 4])
    gl = [torch.empty(4) for _ in range(n)] if RANK == root else None
    dist.gather(ins[RANK], gl, dst=root)
    if RANK == root:
        for o, e in zip(gl, ins):
            _close(o, e)
    out = torch.empty(4)
    dist.scatter(out, [big[root][4 * r:4 * r + 4].clone() for r in range(n)] if RANK == root
                 else None, src=root)
    _close(out, big[root][4 * RANK:4 * RANK + 4])
    outs = [torch.empty(3) for _ in range(n)]
    dist.all_to_all(outs, [_vals(RANK, 3, salt=10 * d) for d in range(n)])
    for s, o in enumerate(outs):
        _close(o, _vals(s, 3, salt=10 * RANK))
    dist.barrier()


@pytest.mark.parametrize("same_tensor", [False, True])
def test_uneven_all_to_all_single(same_tensor):
    """Rank s sends s + d + 1 elements to rank d (value 100 s + d)."""
    n = _n()
    in_splits = [RANK + d + 1 for d in range(n)]
    out_splits = [s + RANK + 1 for s in range(n)]
    inp = torch.cat([torch.full((c,), 100.0 * RANK + d) for d, c in enumerate(in_splits)])
    expected = torch.cat([torch.full((c,), 100.0 * s + RANK) for s, c in enumerate(out_splits)])
    if same_tensor:  # torch allows output is input when the splits match in total
        if sum(in_splits) != sum(out_splits):
            pytest.skip("in-place needs equal totals")
        dist.all_to_all_single(inp, inp, out_splits, in_splits)
        _close(inp, expected)
    else:
        out = torch.empty(sum(out_splits))
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        _close(out, expected)


def test_refusals_are_runtime_errors_too():
    """torch code catches RuntimeError from a backend: facebookresearch/dlrm probes
    all_to_all_single with 4 elements and falls back to scatter when it fails. MCR-DL's
    refusal (dim 0 not divisible by the group) is raised before anything is sent, as a
    RuntimeError that is still an InvalidArgumentError/ValueError."""
    from mcrdl_core.base.errors import InvalidArgumentError

    n = _n()
    if n == 1:
        pytest.skip("every size divides one rank")
    t = torch.zeros(n + 1)
    with pytest.raises(RuntimeError, match="not divisible") as info:
        dist.all_to_all_single(t, t)
    assert isinstance(info.value, InvalidArgumentError)
    dist.barrier()  # nothing was sent: the group is still in step


def test_batch_isend_irecv_ring():
    """Every rank sends to the next and receives from the previous in one batch; all
    ops are posted before any is waited, so the ring cannot deadlock."""
    n = _n()
    nxt, prv = (RANK + 1) % n, (RANK - 1) % n
    send = _vals(RANK, 1000)
    recv = torch.empty(1000)
    ops = [dist.P2POp(dist.irecv, recv, prv), dist.P2POp(dist.isend, send, nxt)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 2
    for w in works:
        w.wait()
    _close(recv, _vals(prv, 1000))


def test_send_recv_and_any_source():
    n = _n()
    if n == 1:
        pytest.skip("needs two ranks")
    if RANK == 0:
        got = set()
        for _ in range(n - 1):
            t = torch.empty(3)
            src = dist.recv(t)  # any source: torch asks the Work for the sender
            _close(t, _vals(src, 3))
            got.add(src)
        assert got == set(range(1, n))
    else:
        dist.send(_vals(RANK, 3), dst=0)


def test_object_collectives():
    n = _n()
    out = [None] * n
    dist.all_gather_object(out, {"rank": RANK, "text": "x" * RANK})
    assert out == [{"rank": r, "text": "x" * r} for r in range(n)]
    objs = [("hello", 3), [1, 2]] if RANK == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [("hello", 3), [1, 2]]
    gl = [None] * n if RANK == 0 else None
    dist.gather_object(RANK * 11, gl, dst=0)
    if RANK == 0:
        assert gl == [r * 11 for r in range(n)]
    out = [None]
    dist.scatter_object_list(out, [f"for {r}" for r in range(n)] if RANK == 0 else None, src=0)
    assert out == [f"for {RANK}"]


def test_new_group_and_per_group_backend():
    """A subgroup of the last two ranks (one rank at size 1), forced onto gloo through
    pg_options; non-members get the NON_GROUP_MEMBER marker as with any backend."""
    n = _n()
    ranks = list(range(max(0, n - 2), n))
    logger().enable()
    logger().clear()
    try:
        g = dist.new_group(ranks, pg_options="gloo")
        if RANK not in ranks:
            assert g == dist.GroupMember.NON_GROUP_MEMBER
            return
        t = _vals(RANK, 8)
        dist.all_reduce(t, group=g)
        _close(t, sum(_vals(r, 8) for r in ranks))
        out = [torch.empty(8) for _ in ranks]
        dist.all_gather(out, _vals(RANK, 8), group=g)
        for o, r in zip(out, ranks):
            _close(o, _vals(r, 8))
        assert dist.get_world_size(g) == len(ranks)
        assert dist.get_rank(g) == ranks.index(RANK)
        backends = {rec[2] for rec in logger().records}
        assert backends == {"gloo"}, backends
    finally:
        logger().disable()


def test_per_op_choice_and_logger():
    """pg_options per op: all_reduce on gloo, all_to_all on mpi, in the same group; the
    comm logger sees each call with the backend that ran it."""
    import mcrdl_torch

    why = mcrdl_torch.available_backends()["mpi"]
    if why:  # under torchrun only Gloo is there to mix
        pytest.skip(f"mpi unavailable: {why}")
    g = dist.new_group(list(range(_n())), pg_options="all_reduce=gloo,all_to_all=mpi")
    logger().enable()
    logger().clear()
    try:
        t = _vals(RANK, 4)
        dist.all_reduce(t, group=g)
        out = torch.empty(_n() * 2)
        dist.all_to_all_single(out, torch.arange(_n() * 2, dtype=torch.float32), group=g)
        seen = {(rec[0], rec[2]) for rec in logger().records}
        assert ("all_reduce", "gloo") in seen and ("all_to_all", "mpi") in seen, seen
    finally:
        logger().disable()


def test_future_completes_without_wait():
    """As DDP uses it: only get_future() and a chained callback, then a C++-side wait
    on the chained future. The progress thread has to complete it."""
    t = _vals(RANK, 1 << 16)
    work = dist.all_reduce(t, async_op=True)
    chained = work.get_future().then(lambda f: f.value()[0] * 2)
    result = chained.wait()
    _close(result, 2 * sum(_vals(r, 1 << 16) for r in range(_n())))
    assert work.is_completed() and work.exception() is None


def test_functional_collectives():
    import torch.distributed._functional_collectives as funcol

    n = _n()
    group = dist.group.WORLD
    x = _vals(RANK, 6)
    _close(funcol.all_reduce(x, "sum", group), sum(_vals(r, 6) for r in range(n)))
    _close(funcol.all_gather_tensor(x, 0, group), torch.cat([_vals(r, 6) for r in range(n)]))
    big = _vals(RANK, 6 * n, salt=2)
    _close(funcol.reduce_scatter_tensor(big, "sum", 0, group),
           sum(_vals(r, 6 * n, salt=2) for r in range(n))[6 * RANK:6 * RANK + 6])
    a2a = funcol.all_to_all_single(big, [6] * n, [6] * n, group)
    _close(a2a, torch.cat([_vals(s, 6 * n, salt=2)[6 * RANK:6 * RANK + 6] for s in range(n)]))


# --- training clients ----------------------------------------------------------------------
STEPS, BATCH, DIM = 3, 8, 16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 4, generator=g)


def _reference():
    """The model trained in one process on every rank's batch (the mean of the ranks'
    mean losses: what data-parallel gradient averaging computes)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x), y)
                   for x, y in (_batch(r, step) for r in range(_n()))) / _n()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(RANK, step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_ddp_matches_reference():
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.001)  # several buckets
    _train(ddp)
    ref = _reference()
    for k, v in ddp.module.state_dict().items():
        _close(v, ref[k], 1e-5)


def _fsdp2_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (_n(),))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp2_matches_reference():
    model = _fsdp2_model()
    _train(model)
    ref = _reference()
    for k, v in model.state_dict().items():
        _close(v.full_tensor(), ref[k], 1e-5)


def test_fsdp1_matches_reference():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=True)
    _train(model)
    ref = _reference()
    with FSDP.summon_full_params(model):
        for k, v in model.module.state_dict().items():
            _close(v, ref[k.replace("_fsdp_wrapped_module.", "")], 1e-5)


def test_checkpoint_save_load(tmp_path):
    """torch.distributed.checkpoint: save an FSDP2 model's sharded state dict, load it
    into a fresh model, and get the trained weights back on every rank."""
    import torch.distributed.checkpoint as dcp

    path = [str(tmp_path / "ckpt") if RANK == 0 else None]
    dist.broadcast_object_list(path, src=0)  # one directory for every rank (shared host)
    model = _fsdp2_model()
    _train(model)
    dcp.save(model.state_dict(), checkpoint_id=path[0])
    fresh = _fsdp2_model()
    state = fresh.state_dict()
    for v in state.values():
        v.to_local().zero_()
    dcp.load(state, checkpoint_id=path[0])
    fresh.load_state_dict(state)
    ref = _reference()
    for k, v in fresh.state_dict().items():
        _close(v.full_tensor(), ref[k], 1e-5)
