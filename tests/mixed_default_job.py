"""Run by test_launches.py under mpiexec and torchrun, 3 ranks (members-only) or 2: a job whose default group is torch's gloo
and which makes "mcrdl" subgroups (issue 22 item 9: the first made by its members only hung
in the core's bootstrap, which is collective over every rank; then it was refused)."""
import os
import sys

import torch
import torch.distributed as dist

import mcrdl_autoload
import mcrdl_core
from mcrdl_torch.run import mpi_env

mcrdl_autoload.register()
if "RANK" not in os.environ:  # mpiexec (torchrun sets RANK)
    mpi_env()
dist.init_process_group("gloo")
rank = dist.get_rank()


def rank0_alone(g):
    """An all-reduce on the one-rank mcrdl group ``g`` of rank 0 (None elsewhere)."""
    if rank == 0:
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.ones(2))


if sys.argv[1] == "one-never-starts":
    # rank 1 never starts MCR-DL: rank 0's bootstrap, on torch's own store (whose
    # timeout is the group's 30 minutes), gives up at MCRDL_TIMEOUT with the remedy
    import time

    from mcrdl_core.base.errors import CommTimeoutError

    if rank == 0:
        start = time.monotonic()
        try:
            mcrdl_core.init()
            raise SystemExit("rank 0: expected CommTimeoutError")
        except CommTimeoutError as exc:
            assert "mcrdl_core.init()" in str(exc) and time.monotonic() - start < 15, exc
        print(f"rank {rank}: bootstrap timeout ok", flush=True)
    else:
        time.sleep(6)
    dist.destroy_process_group()
    sys.exit(0)
elif sys.argv[1] == "members-only":
    # the runtime is not up yet and rank 1 never enters the creator: the members start
    # a runtime among themselves (before, this hung in a bootstrap waiting for rank 1)
    g = dist.new_group([2, 0], backend="mcrdl", sort_ranks=False)
    if rank in (0, 2):
        assert dist.get_rank(g) == [2, 0].index(rank)
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((4,), 4.0)), t
        t = torch.full((3,), float(rank))
        dist.broadcast(t, src=2, group=g)  # torch's global rank 2 is group rank 0
        assert torch.equal(t, torch.full((3,), 2.0)), t
        out = [torch.empty(2) for _ in range(2)]
        dist.all_gather(out, torch.full((2,), float(rank)), group=g)
        assert [o[0].item() for o in out] == [2.0, 0.0], out
        w = dist.all_reduce(torch.ones(5), group=g, async_op=True)
        w.wait()
        # a later group inside the first one maps torch ranks the same way
        rank0_alone(dist.new_group([0], backend="mcrdl"))
        # one with a rank outside the runtime's world is refused (on the members that
        # have the runtime) with the remedy, before anything is sent
        if rank == 0:
            try:
                dist.new_group([0, 1], backend="mcrdl", use_local_synchronization=True)
                raise SystemExit("rank 0: expected an error")
            except Exception as exc:  # noqa: BLE001
                assert "mcrdl_core.init()" in str(exc) and "[1]" in str(exc), exc
                print(f"rank {rank}: refused: {type(exc).__name__}", flush=True)
        assert mcrdl_core.get_runtime().world_size == 2
    else:
        assert g is None or g == dist.GroupMember.NON_GROUP_MEMBER, g
    dist.barrier()
else:  # the documented remedy: start the runtime on every rank first
    mcrdl_core.init()
    rank0_alone(dist.new_group([0], backend="mcrdl"))
    g2 = dist.new_group([1, 0], backend="mcrdl")
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=g2)
    assert torch.equal(t, torch.full((3,), 3.0)), t
    # the per-device backend torch looks up (async_save, _get_pg_default_device)
    from torch.distributed.distributed_c10d import _get_pg_default_device
    assert _get_pg_default_device(g2) == torch.device("cpu")
    assert g2._get_backend(torch.device("cpu")) is not None
    dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}: mixed default ok", flush=True)
