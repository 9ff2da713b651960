"""Run by test_launches.py under mpiexec -n 3: init_process_group("mcrdl") and
destroy_process_group three times in one job; each init takes a fresh MASTER_PORT (a
later init that reused the first one could join the previous store server and hang)."""
import torch, torch.distributed as dist, mcrdl_autoload
mcrdl_autoload.register()
for i in range(3):
    dist.init_process_group("mcrdl")
    t = torch.ones(2); dist.all_reduce(t); assert t[0] == dist.get_world_size()
    dist.destroy_process_group()
print("reinit ok", flush=True)
