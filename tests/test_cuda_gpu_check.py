"""bench/gpu_check.py's decisions that need no GPU: part 2's environment (two processes
on one GPU: JAX must not preallocate) and skips decided by every rank together."""
import importlib.util
from pathlib import Path

from mcrdl_core.world.bootstrap import Bootstrap

PATH = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Gathered(Bootstrap):
    """A bootstrap whose allgather answers what the other ranks said."""

    def __init__(self, said):
        self.said = said

    def allgather(self, obj):
        return list(self.said)


def test_part_two_runs_without_jax_preallocation():
    gc = _gpu_check()
    env = gc.part_two_env({"PATH": "/bin", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["MCRDL_TUNING_TABLE"] == "none" and env["PATH"] == "/bin"


def test_a_skip_on_one_rank_is_a_skip_on_every_rank():
    gc = _gpu_check()
    assert gc.agree(Gathered([None, None]), None) is None
    # rank 0 could run, rank 1 could not: rank 0 must skip too, and say why
    assert gc.agree(Gathered([None, "JAX has no GPU backend"]), None) == \
        "rank 1: JAX has no GPU backend"
    assert gc.agree(Gathered(["a", "b"]), "a") == "rank 0: a"
    assert gc.agree(Bootstrap(), "alone") == "alone"
