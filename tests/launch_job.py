"""Run by test_launches.py: a torch program on the "mcrdl" backend, launched without
torchrun or mpiexec. Mode "env": RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand
(a shell script or a Slurm wrapper); mode "spawn": torch.multiprocessing.spawn with an
explicit rank= and world_size=, as torch's own test driver launches."""
import os
import sys

import torch
import torch.distributed as dist

import mcrdl_autoload


def work(rank: int, size: int) -> None:
    mcrdl_autoload.register()
    if os.environ.get("LAUNCH_MODE") == "spawn":
        dist.init_process_group("mcrdl", rank=rank, world_size=size,
                                init_method=f"tcp://127.0.0.1:{os.environ['LAUNCH_PORT']}")
    else:
        dist.init_process_group("mcrdl")
    assert dist.get_rank() == rank and dist.get_world_size() == size
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), size * (size + 1) / 2)), t
    out = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(out, torch.full((2,), float(rank)))
    assert all(torch.equal(o, torch.full((2,), float(k))) for k, o in enumerate(out)), out
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: launch ok", flush=True)


if __name__ == "__main__":
    size = int(sys.argv[1])
    if os.environ.get("LAUNCH_MODE") == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(work, args=(size,), nprocs=size)
    else:
        work(int(os.environ["RANK"]), size)
