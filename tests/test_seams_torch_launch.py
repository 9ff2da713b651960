"""Launches at the torch seams (issue 48, defects 14, 15 and 18): a hand-made env://
launch of the documented remedy for mixed defaults, a torchrun job that re-initializes
with Gloo subgroups, and a group timeout given to init_process_group once the runtime
runs. Each launch is short; a hang is a failure (hard timeout per launch)."""
import subprocess
import sys
from pathlib import Path

import pytest

from test_launches import _env, _free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _hand_made(size: int, job: str, *args: str, timeout_s: str = "20") -> list:
    """Run tests/<job> as ``size`` processes given RANK/WORLD_SIZE/MASTER_* by hand (no
    launcher); each one's output, after asserting every one exits 0."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / job), *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(RANK=r, WORLD_SIZE=size, MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, MCRDL_TIMEOUT=timeout_s))
             for r in range(size)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung:\n" + "\n".join(q.communicate()[0][-3000:] for q in procs))
    for p, out in zip(procs, outs):
        assert p.returncode == 0, "\n---\n".join(o[-3000:] for o in outs)
    return outs


def _torchrun(n: int, job: str, *args: str, timeout_s: str = "20") -> str:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(n),
           str(ROOT / "tests" / job), *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=_env(MCRDL_TIMEOUT=timeout_s))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the torchrun job hung:\n{(exc.stdout or b'')[-3000:]!r}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.multirank
def test_mixed_default_remedy_under_a_hand_made_env_launch():
    """init_process_group("gloo") and then mcrdl_core.init() (the documented remedy),
    launched by hand: rank 0 used to start a second store server on MASTER_PORT
    (EADDRINUSE) and rank 1 failed to receive; the core now shares torch's store."""
    outs = _hand_made(2, "mixed_default_job.py", "runtime-first")
    for r, out in enumerate(outs):
        assert f"rank {r}: mixed default ok" in out, out[-3000:]


@pytest.mark.multirank
def test_bootstrap_on_torchs_store_times_out_at_mcrdl_timeout():
    """The shared store's own timeout is torch's group's (30 minutes): a rank that never
    starts MCR-DL makes the others' bootstrap fail at MCRDL_TIMEOUT, naming the remedy."""
    outs = _hand_made(2, "mixed_default_job.py", "one-never-starts", timeout_s="2")
    assert "rank 0: bootstrap timeout ok" in outs[0], outs[0][-3000:]


@pytest.mark.multirank
def test_torchrun_reinit_with_gloo_subgroups():
    """destroy_process_group + init_process_group under torchrun, each time with a
    new_group(backend="gloo"): the second one used to hang on the first one's keys."""
    out = _torchrun(2, "reinit_job.py", "gloo-subgroups")
    assert out.count("reinit ok") == 2, out[-6000:]


@pytest.mark.multirank
def test_init_process_group_timeout_on_a_running_runtime_holds_on_gloo():
    """Under torchrun the runtime's world Gloo communicator is made when the runtime
    starts (here by get_rank(), with MCRDL_TIMEOUT=1: Gloo's 2 s); a later
    init_process_group("mcrdl", timeout=30 s) gives the world its own timeout, and a
    rank 3 s late used to fail in Gloo at 2 s (defect 14)."""
    out = _torchrun(2, "test_seams_torch_launch.py", "late-world", timeout_s="1")
    assert out.count("late world ok") == 2, out[-6000:]


def _late_world() -> None:
    """The job of the test above (run by torchrun as this file)."""
    import datetime
    import time

    import torch
    import torch.distributed as tdist

    import mcrdl_autoload
    import mcrdl_torch

    mcrdl_autoload.register()
    rank = mcrdl_torch.get_rank()  # the runtime starts: the world's Gloo group is made
    tdist.init_process_group("mcrdl", timeout=datetime.timedelta(seconds=30))
    t = torch.full((3,), float(rank + 1))
    if rank == 1:
        time.sleep(3.0)
    tdist.all_reduce(t)
    assert t.tolist() == [3.0] * 3, t
    tdist.destroy_process_group()
    print(f"rank {rank}: late world ok", flush=True)


if __name__ == "__main__":
    {"late-world": _late_world}[sys.argv[1]]()
