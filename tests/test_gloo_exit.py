"""The Gloo backend's hold on finished works' tensors (``mcrdl_backends.gloo._Held``).

torch's Gloo thread lets go of a work a moment after marking it done. If the work's
tensors have lost their Python references by then, that thread frees their Python
objects and needs the GIL; in the interpreter's final teardown that aborts the process
after the job succeeded (SIGABRT, "terminate called without an active exception": 8 of
40 two-rank env launches under gdb before the hold, 0 of 40 after). The abort itself is
a race, so these tests check the hold deterministically: an autograd node stands in for
Gloo's thread as the tensor's other C++ owner."""
import gc
import os
import subprocess
import sys
import weakref

import numpy as np
import torch

from mcrdl_backends.gloo import _Held

LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD",
               "MPI_LOCALNRANKS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "MCRDL_BACKEND", "MCRDL_COMPRESSION")


def _owned_elsewhere(t):
    """A C++ owner of ``t`` besides its Python object (an autograd node saves it)."""
    x = torch.ones(t.shape, requires_grad=True)
    y = x * t
    assert t._use_count() == 2
    return y


def test_an_entry_stays_while_another_owner_holds_a_tensor():
    held = _Held()
    t, u = torch.ones(3), torch.zeros(2)
    owner = _owned_elsewhere(t)
    held.add(("a buffer", [t, u]))  # nested and non-tensor objects: tensors are found
    assert len(held) == 1
    held.sweep()
    assert len(held) == 1  # t is still owned by the node
    del owner
    held.sweep()
    assert len(held) == 0


def test_entries_are_let_go_oldest_first_and_at_most_cap_are_kept():
    held = _Held()
    held.CAP = 3
    ts = [torch.ones(1) for _ in range(5)]
    owners = [_owned_elsewhere(t) for t in ts]
    for t in ts:
        held.add((t,))
    assert len(held) == 3  # the two oldest were let go early (the cap)
    del owners[2]  # the oldest held entry is free now
    held.sweep()
    assert len(held) == 2
    del owners[-1]  # the newest is free, but an older one is not: order is kept
    held.sweep()
    assert len(held) == 2
    held.add(())  # an entry with no tensors adds nothing, and sweeps
    assert len(held) == 2


def test_drain_waits_then_keeps_for_good_what_gloo_would_still_free():
    held = _Held()
    free, kept = torch.ones(2), torch.ones(2)
    owner = _owned_elsewhere(kept)
    held.add((free,))
    held.add((kept,))
    ref_free, ref_kept = weakref.ref(free), weakref.ref(kept)
    assert held.drain(wait_s=0.05) == 1  # `free` had no other owner: let go
    assert len(held) == 1
    del free, kept, owner
    gc.collect()
    assert ref_free() is None
    assert ref_kept() is not None  # kept for good: Gloo's thread never frees it


def test_finished_gloo_works_hand_their_tensors_to_the_hold():
    """Every kind of Gloo work (a GlooWork; send/recv/reduce-scatter go through a helper
    thread) hands the torch views it gave Gloo to the hold when it finishes."""
    code = """
import numpy as np, mcrdl_core
from mcrdl_core.world.bootstrap import Bootstrap
from mcrdl_backends import gloo
seen = []
add = gloo._HELD.add
gloo._HELD.add = lambda objs: (seen.append([t.data_ptr() for t in gloo._tensors(objs)]), add(objs))
rt = mcrdl_core.init(bootstrap=Bootstrap())
a = np.arange(4, dtype=np.float32)
mcrdl_core.all_reduce(a, backend="gloo")
out = np.zeros(4, np.float32)
mcrdl_core.all_gather_into_tensor(out, a, backend="gloo")
rs = np.zeros(4, np.float32)
mcrdl_core.reduce_scatter_tensor(rs, a, backend="gloo")
ptrs = [a.ctypes.data, out.ctypes.data, rs.ctypes.data]
assert len(seen) == 3, seen
for p, got in zip(ptrs, seen):
    assert p in got, (p, got)
print("handed", len(seen))
"""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["MCRDL_TUNING_TABLE"] = "none"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and "handed 3" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
