"""Defects the differential fuzzer (tests/fuzz/) found beyond issue 48's list, each
checked on its own against NumPy on every rank:

- the two ends of one message selected their backend from different table entries (the
  send's from "send", the receive's from "recv", or the other dtype class's where one
  class had no entry), so under a table whose send and recv ranges differ a plain
  send/recv, a ring or a batch_isend_irecv used two libraries and hung;
- MCRDL_DEBUG under jax.jit compared an uneven all_to_all's per-rank element counts,
  which differ by design, and raised MismatchError on every rank.
"""
import os

import numpy as np
import pytest
import torch

import mcrdl_core as mc
import mcrdl_torch as dist
from conftest import RANK, SIZE
from mcrdl_core.dispatch.selection import TuningTable

HANG_S = 20.0
needs2 = pytest.mark.skipif(SIZE < 2, reason="needs 2 ranks")


@pytest.fixture
def p2p_table():
    """A table whose send and recv entries name different backends at every size
    (and, for int data, a send entry of its own but no recv entry)."""
    rt = mc.get_runtime()
    hosts = rt.bootstrap.hosts_in(rt.world.ranks)

    def put(send, recv):
        e = lambda op, cls, name: {"op": op, "world_size": SIZE, "hosts": hosts,  # noqa: E731
                                   "device": "cpu", "dtype_class": cls,
                                   "ranges": [[64, name], [None, name]]}
        rt.set_table(TuningTable({"schema": "mcrdl.tuning/2", "entries": [
            e("send", "float", send), e("recv", "float", recv), e("send", "int", send)]}))
    yield put
    rt.set_table(None)


@needs2
@pytest.mark.parametrize("send,recv", [("mpi", "gloo"), ("gloo", "mpi")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_both_ends_of_a_message_select_alike_under_a_table(p2p_table, send, recv, dtype):
    p2p_table(send, recv)
    g = mc.new_group(list(range(SIZE)))
    g.timeout = HANG_S
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    for count in (3, 1000):
        mine = torch.arange(count, dtype=torch.float64).add(100 * RANK).to(dtype)
        want = torch.arange(count, dtype=torch.float64).add(100 * prv).to(dtype)
        out = torch.zeros(count, dtype=dtype)
        works = [dist.irecv(out, src=prv, group=g), dist.isend(mine, dst=nxt, group=g)]
        for w in works:
            w.wait()
        assert torch.equal(out, want), (RANK, out[:4], want[:4])
        out2 = torch.zeros(count, dtype=dtype)
        ops = [mc.P2POp(dist.irecv, out2, prv, g), mc.P2POp(dist.isend, mine, nxt, g)]
        for w in mc.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(out2, want), (RANK, out2[:4], want[:4])


@needs2
def test_debug_mode_accepts_an_uneven_jitted_all_to_all():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import mcrdl_jax as mj

    rt = mc.get_runtime()
    m = (np.arange(SIZE * SIZE).reshape(SIZE, SIZE) % 3) + 1  # rows rank i sends to j
    ins = [np.arange(m[i].sum(), dtype=np.float32) + 100 * i for i in range(SIZE)]
    want = np.concatenate([np.split(ins[i], np.cumsum(m[i])[:-1])[RANK] for i in range(SIZE)])
    fn = jax.jit(lambda v: mj.all_to_all(v, input_split_sizes=[int(v) for v in m[RANK]],
                                         output_split_sizes=[int(v) for v in m[:, RANK]]))
    was = rt.debug
    rt.debug = True
    try:
        y = np.asarray(fn(jnp.asarray(ins[RANK])))
    finally:
        rt.debug = was
    np.testing.assert_array_equal(y, want)
