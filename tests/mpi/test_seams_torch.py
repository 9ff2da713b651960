"""Seams of the torch frontend with the core (issue 48, defects 6, 7, 14 and 19).

Runs on every rank (1, 2 or 3) under mpiexec; each test makes the same calls on every
rank and checks its own result against a NumPy reference (or the same error).
"""
import datetime
import time
import warnings

import numpy as np
import pytest
import torch

import mcrdl_core
import mcrdl_torch as dist
from mcrdl_core.base.errors import CommTimeoutError, InvalidArgumentError, McrdlError

from conftest import BACKENDS, RANK, SIZE

WORLD = list(range(SIZE))


def _rt():
    return mcrdl_core.get_runtime()


# --- defect 7: nested tensors --------------------------------------------------------------
def _nested():
    with warnings.catch_warnings():  # ("the nested tensor API is in prototype stage")
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])  # strided layout


def _calls(backend):
    """(name, call of a tensor-shaped argument x) for every fast-path op of mcrdl_torch;
    each plain call binds its key (the same dtype, group, backend and async flag)."""
    n = SIZE
    peer_to, peer_from = (RANK + 1) % n, (RANK - 1) % n

    def p2p(x):  # the send first: a refused one leaves no receive posted
        s = dist.isend(x, peer_to, backend=backend)
        r = dist.irecv(torch.empty_like(x), peer_from, backend=backend)
        s.wait(), r.wait()
    calls = [
        ("all_reduce", lambda x: dist.all_reduce(x, backend=backend)),
        ("all_reduce async", lambda x: dist.all_reduce(x, backend=backend, async_op=True).wait()),
        ("broadcast", lambda x: dist.broadcast(x, 0, backend=backend)),
        ("reduce", lambda x: dist.reduce(x, 0, backend=backend)),
        ("send/recv", p2p),
        ("all_gather_into_tensor in", lambda x: dist.all_gather_into_tensor(
            torch.empty(n * 4), x, backend=backend)),
        ("all_gather_into_tensor out", lambda x: dist.all_gather_into_tensor(
            x, torch.ones(4 if x.is_nested else x.numel() // n), backend=backend)),
        ("reduce_scatter_tensor", lambda x: dist.reduce_scatter_tensor(
            torch.empty(4), x, backend=backend)),
        ("all_to_all_single", lambda x: dist.all_to_all_single(
            torch.empty(x.numel() if not x.is_nested else 5), x, backend=backend)),
    ]
    return [c for c in calls if SIZE > 1 or c[0] != "send/recv"]  # (Gloo: none to oneself)


def _plain(name):
    """A plain tensor of the shape each call takes (the nested one has 5 elements)."""
    n = SIZE
    return {"all_gather_into_tensor out": torch.ones(4 * n), "reduce_scatter_tensor":
            torch.ones(4 * n), "all_to_all_single": torch.ones(2 * n)}.get(name, torch.ones(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nested_tensors_get_one_clear_error_on_every_path(backend):
    """Before: the first call raised torch's "NestedTensorImpl doesn't support sizes" (an
    internal error) and, once a plain tensor had bound the key, the same call went
    through the bound fast path and "succeeded". Now every call refuses it, before
    anything is sent, with InvalidArgumentError naming nested tensors."""
    for name, call in _calls(backend):
        for attempt in ("first", "after plain calls bound the key"):
            with pytest.raises(InvalidArgumentError, match="nested tensors") as info:
                call(_nested())
            assert "NestedTensorImpl" not in str(info.value), (name, attempt)
            if attempt == "first":
                call(_plain(name))
                call(_plain(name))  # (the second runs on the bound closure)
    x = torch.full((3,), float(RANK + 1))
    dist.all_reduce(x, backend=backend)  # the world is still usable
    assert x.tolist() == [SIZE * (SIZE + 1) / 2] * 3
