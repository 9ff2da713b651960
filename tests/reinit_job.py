"""Run by test_launches.py under mpiexec -n 3: init_process_group("mcrdl") and
destroy_process_group three times in one job; each init takes a fresh MASTER_PORT (a
later init that reused the first one could join the previous store server and hang).

With the argument ``gloo-subgroups`` (test_seams_torch_launch.py, under torchrun): each
of the inits also makes a ``new_group(backend="gloo")``. torch names its groups afresh
after a destroy, on the same agent store, so the second init's Gloo group used to meet
the first one's rendezvous keys and hang (issue 48 defect 18)."""
import datetime
import sys
import time

import torch, torch.distributed as dist, mcrdl_autoload
mcrdl_autoload.register()
gloo_subgroups = sys.argv[1:] == ["gloo-subgroups"]
for i in range(3):
    dist.init_process_group("mcrdl")
    t = torch.ones(2); dist.all_reduce(t); assert t[0] == dist.get_world_size()
    if gloo_subgroups:
        if dist.get_rank() == 1:  # the others read the keys first (stale ones, before)
            time.sleep(1.0)
        g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
        assert dist.get_backend(g) == "gloo", dist.get_backend(g)
        t = torch.full((2,), float(dist.get_rank() + 1)); dist.all_reduce(t, group=g)
        n = dist.get_world_size()
        assert t.tolist() == [n * (n + 1) / 2] * 2, t
    dist.destroy_process_group()
print("reinit ok", flush=True)
