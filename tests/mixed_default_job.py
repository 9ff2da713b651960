"""Run by test_launches.py under mpiexec -n 2: a job whose default group is torch's gloo
and which makes "mcrdl" subgroups (issue: the first made by its members only hung in the
core's bootstrap, which is collective over every rank)."""
import sys

import torch
import torch.distributed as dist

import mcrdl_autoload
import mcrdl_core
from mcrdl_torch.run import mpi_env

mcrdl_autoload.register()
mpi_env()
dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[1] == "members-only":
    # the runtime is not up yet and rank 1 never enters the creator: a clear error at
    # once on rank 0 (not a hang in a bootstrap that waits for rank 1)
    try:
        g = dist.new_group([0], backend="mcrdl")
        if rank == 0:
            raise SystemExit("rank 0: expected an error")
    except Exception as exc:  # noqa: BLE001
        assert rank == 0 and "mcrdl_core.init()" in str(exc), exc
        print(f"rank {rank}: refused: {type(exc).__name__}", flush=True)
    dist.barrier()
else:  # the documented remedy: start the runtime on every rank first
    mcrdl_core.init()
    g = dist.new_group([0], backend="mcrdl")
    if rank == 0:
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.ones(2))
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
