"""Defects the differential fuzzer (tests/fuzz/) found beyond issue 48's list, each checked
here on its own (single process)."""
import numpy as np
import torch

from mcrdl_core.memory.buffer import as_buffer


def test_empty_and_size_one_layouts_are_contiguous_as_numpy_judges():
    # torch.from_numpy(np.zeros(0)) has stride (0,): a 0-element receive buffer of
    # batch_isend_irecv was refused as "not contiguous" (found by the fuzzer, seed 18 at 3 ranks)
    for t in (torch.from_numpy(np.zeros((0,), np.float64)), torch.from_numpy(np.zeros((0, 3))),
              torch.zeros(3, 1).t()):
        assert t.is_contiguous()
        assert as_buffer(t).is_contiguous, (t.shape, t.stride())
    assert not as_buffer(torch.zeros(4, 2)[:, :1]).is_contiguous  # a real gap stays one


def test_mcrdl_backend_names_one_backend_for_both_ends_of_a_message():
    import pytest
    from mcrdl_core.base.errors import TableError
    from mcrdl_core.dispatch.selection import parse_override
    assert parse_override("send=gloo") == {"send": "gloo", "recv": "gloo"}
    assert parse_override("mpi,recv=gloo")["send"] == "gloo"
    with pytest.raises(TableError, match="both ends of a message"):
        parse_override("send=mpi,recv=gloo")
