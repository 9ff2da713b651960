"""A Gloo rendezvous that times out, then interpreter exit (docs/reliability.md's A/B of
the helper-thread grace). Rank 0 calls all_reduce on Gloo; rank 1 sleeps past the
timeout and exits. Run, e.g.:

    for g in 0 5 0 5 0 5; do MCRDL_FAULT_GRACE_S=$g MCRDL_TIMEOUT=3 MCRDL_TUNING_TABLE=none \
        mpiexec -n 2 python tests/faults/rendezvous_exit.py > out.txt 2>&1; \
        echo "grace $g: exit $?, abort: $(grep -c 'terminate called' out.txt)"; done

Rank 0's exit status must be 1 (its CommTimeoutError reached the top level), not 6
(SIGABRT from a Gloo thread returning during finalization).
"""
import time

import torch

import mcrdl_torch as dist

dist.init_process_group()
t = torch.ones(4)
if dist.get_rank() == 0:
    dist.all_reduce(t, backend="gloo")  # raises CommTimeoutError after MCRDL_TIMEOUT
else:
    time.sleep(float(__import__("os").environ.get("MCRDL_TIMEOUT", "3")) + 2)
