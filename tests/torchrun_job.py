"""Run by test_multirank.py under torchrun (2 ranks): no MPI launcher, so the bootstrap
uses torchrun's store, Gloo does the work, and MPI says why it is unavailable."""
import torch

import mcrdl_torch as dist
from mcrdl_core.base.errors import BackendUnavailableError

dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
assert size == 2, size
reason = dist.available_backends()["mpi"]
assert reason and "torchrun" in reason, reason
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)  # policy: mpi unavailable -> gloo
assert torch.equal(t, torch.full((3,), 3.0)), t
out = torch.zeros(2 * size)
dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), backend="gloo")
assert torch.equal(out, torch.tensor([0.0, 0.0, 1.0, 1.0])), out
g = dist.new_group([1, 0])
b = torch.full((2,), float(rank))
dist.broadcast(b, src=1, group=g)
assert torch.equal(b, torch.ones(2)), b
try:
    dist.all_reduce(t, backend="mpi")
    raise SystemExit("mpi should be unavailable under torchrun")
except BackendUnavailableError as exc:
    assert "torchrun" in str(exc) and "gloo" in str(exc), exc
dist.destroy_process_group()
print(f"rank {rank}: torchrun job ok")
