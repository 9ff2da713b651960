"""The pipelined JAX MLP (bench/apps/jax_pipeline.py): one stage per rank, GPipe through
the derivatives of mcrdl_jax.send/recv under jax.jit, and 1F1B with jitted stages and
eager sendrecv. After N steps every stage's parameters equal a single-process run of
the same model, and the loss goes down."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "apps"))
import jax_pipeline as app  # noqa: E402

from conftest import RANK, SIZE  # noqa: E402


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("schedule, micro", [("gpipe", 4), ("1f1b", 5)])
def test_pipeline_matches_single_process_and_learns(backend, schedule, micro):
    dims = [16, 12, 12, 12, 4]
    steps, batch, lr = 25, 20, 0.1
    stage, losses, _ = app.train(dims, steps, micro=micro, batch_size=batch, lr=lr,
                                 backend=backend, log_every=steps - 1, schedule=schedule)
    assert len(stage.split) == SIZE and stage.mine == stage.split[RANK]
    diff = app.max_param_difference(stage, steps, batch, lr)
    assert diff < 1e-5, f"rank {RANK}: parameters differ from the single-process run by {diff}"
    (_, first), (_, last) = losses[0], losses[-1]
    assert last < 0.8 * first, f"loss did not go down: {losses}"
