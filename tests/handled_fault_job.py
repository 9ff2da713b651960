"""A job whose rank 1 meets a timeout, handles it and ends, while ranks 0 and 2 keep
working for seconds more (on a group without rank 1) and end later. Every rank must get
to print its line and the job must exit 0: the rank with the fault must not take its
peers down by leaving first (tests/test_launches.py). argv[1]: the backend."""
import sys
import time

import torch

import mcrdl_torch as dist
from mcrdl_core.base.errors import McrdlError

backend = sys.argv[1]
dist.init_process_group(backend=backend)
rank = dist.get_rank()
others = dist.new_group([0, 2])
if rank == 1:
    try:
        dist.recv(torch.zeros(4), src=0)  # rank 0 never sends
        raise SystemExit("rank 1: the recv completed, but nobody sent")
    except McrdlError as e:
        print(f"rank 1: handled {type(e).__name__}", flush=True)
else:
    time.sleep(3.0)  # past rank 1's exit, within MCRDL_FAULT_GRACE_S
    t = torch.full((8,), float(rank))
    dist.all_reduce(t, group=others)
    assert torch.equal(t, torch.full((8,), 2.0)), t
print(f"rank {rank}: finished", flush=True)
