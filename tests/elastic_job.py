"""Run by test_launches.py under ``torchrun --max-restarts 1``: the first attempt's rank 1
dies after its groups have rendezvoused; the restarted attempt must rendezvous afresh
(keys scoped by TORCHELASTIC_RESTART_COUNT), not with the dead attempt's addresses."""
import os

import torch

import mcrdl_torch as dist

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
g = dist.new_group([1, 0])
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t, group=g, backend="gloo")
assert torch.equal(t, torch.full((3,), 3.0)), t
if attempt == 0:
    dist.barrier(backend="gloo")
    if rank == 1:
        raise SystemExit(f"rank 1 of attempt {attempt}: dying on purpose")
    import time
    time.sleep(60)  # killed by the agent when rank 1 dies
dist.destroy_process_group()
print(f"rank {rank}: attempt {attempt} ok", flush=True)
