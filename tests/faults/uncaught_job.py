"""A rank that dies of an uncaught exception while its peers are in a collective
(tests/test_seams_exit.py; issue 48, defect 17).

    mpiexec -n 3 python tests/faults/uncaught_job.py BACKEND

Every rank makes one all-reduce on BACKEND (its communicator made), then rank 1 prints
``RAISED {time}`` and raises; the others start the next all-reduce, which can never
complete, and handle its error (as a training loop that catches errors would), so only
rank 1 failed. The job's status must be non-zero, and it must end well before
``MCRDL_TIMEOUT``.
"""
import sys
import time

import numpy as np

import mcrdl_core as core

rt = core.get_runtime()
backend = sys.argv[1]
x = np.ones(4, np.float32)
core.all_reduce(x, backend=backend)
if rt.rank == 1:
    print(f"RAISED {time.time():.3f}", flush=True)
    raise RuntimeError("rank 1 dies of an uncaught exception")
try:
    core.all_reduce(x, backend=backend)
except Exception as exc:  # handled: this rank itself succeeds
    print(f"rank {rt.rank} handled {type(exc).__name__}", flush=True)
print(f"rank {rt.rank} done", flush=True)
