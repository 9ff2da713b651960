"""The call pipeline (mcrdl_core/dispatch/pipeline.py): a call described once as a
``Call`` and run by ``run``, on every rank, against NumPy. An op that is only a
description (its checks, the backend's call) gets the group checks, selection, the
observers, ordering against work in flight and the finish for free; its checks raise
before anything is sent; a compression reaches the op's ``compressed`` part and not the
backend's call; send and recv are not shown to observers (only one side calls them)."""
import numpy as np
import pytest

import mcrdl_core
from mcrdl_core.base.errors import InvalidArgumentError
from mcrdl_core.base.ops import Op, ReduceOp
from mcrdl_core.dispatch.pipeline import Call, run
from mcrdl_core.memory.buffer import Buffer
from conftest import RANK, SIZE


class Recorder(mcrdl_core.Observer):
    def __init__(self):
        self.seen, self.issued = [], []

    def before(self, rt, group, op, backend, buf, **signature):
        self.seen.append((op, backend.name, signature))

    def after(self, rt, work, nbytes):
        self.issued.append((work.op, nbytes))


@pytest.fixture
def rt():
    rt = mcrdl_core.get_runtime()
    yield rt
    rt.unwatch("Recorder")
    assert not rt.observed


def values(r, n, salt=0):
    return ((np.arange(n) * 5 + r * 3 + salt) % 7 + 1).astype(np.float32)


def all_reduce_call(x, backend, async_op=False, **kw):
    buf = Buffer.from_numpy(x)
    return Call(Op.ALL_REDUCE, None, backend, buf, reduce_op=ReduceOp.MAX, async_op=async_op,
                writes=(buf,), log_bytes=buf.nbytes, check=lambda g, c: {"count": buf.numel},
                issue=lambda be, g, red, sig: be.all_reduce(g, buf, red), **kw)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("n", [0, 1, 9])
def test_a_described_call_runs_blocking_and_async_with_its_observers(rt, backend, n):
    rec = Recorder()
    rt.watch(rec)
    x = values(RANK, n)
    assert run(all_reduce_call(x, backend)) is None
    expect = np.max([values(r, n) for r in range(SIZE)], axis=0) if n else x
    np.testing.assert_array_equal(x, expect)
    ys = [values(RANK, n, s) for s in (1, 2, 3)]
    works = [run(all_reduce_call(y, backend, async_op=True)) for y in ys]  # 3 in flight
    for s, (y, w) in enumerate(zip(ys, works), 1):
        w.wait()
        np.testing.assert_array_equal(
            y, np.max([values(r, n, s) for r in range(SIZE)], axis=0) if n else y)
    assert [(op, name) for op, name, _ in rec.seen] == [(Op.ALL_REDUCE, backend)] * 4
    assert all(sig == {"count": n, "reduce_op": ReduceOp.MAX} for _, _, sig in rec.seen)
    assert rec.issued == [(Op.ALL_REDUCE, 4 * n)] * 4


def test_the_checks_refuse_the_call_on_every_rank_before_anything_is_sent(rt):
    issued = []
    x = values(RANK, 4)
    before = x.copy()

    def check(g, c):
        if g.size == SIZE:
            raise InvalidArgumentError(f"refused on group rank {g.rank}")
        return {}

    call = all_reduce_call(x, "mpi")
    call.check, call.issue = check, lambda *a: issued.append(a)
    with pytest.raises(InvalidArgumentError, match=f"refused on group rank {RANK}"):
        run(call)
    assert issued == [] and np.array_equal(x, before)
    bad = all_reduce_call(np.arange(3, dtype=np.float32), "mpi")
    bad.reduce_op = "no-such-op"
    with pytest.raises(InvalidArgumentError):  # the reduce op, before the op's own checks
        run(bad)
    mcrdl_core.barrier()  # every rank is still in step


def test_a_compression_reaches_the_compressed_part_instead_of_the_backend(rt):
    seen = []
    x = values(RANK, 8)
    call = all_reduce_call(x, "mpi", compression="fp16")
    call.reduce_op = ReduceOp.SUM
    call.issue = lambda *a: pytest.fail("the backend's own call ran")
    call.compressed = lambda t, rt_, g, red, sig, cz: seen.append((red, sig, cz.codec))
    assert run(call) is None
    assert seen == [(ReduceOp.SUM, {"count": 8}, "fp16")]
    plain = all_reduce_call(x, "mpi")  # no compression: the backend's call, not the variant
    plain.compressed = lambda *a: pytest.fail("compressed without a compression")
    run(plain)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_send_and_recv_described_as_calls_are_not_shown_to_observers(rt, backend):
    if SIZE == 1 and backend == "gloo":
        pytest.skip("Gloo's pairs do not connect a rank to itself")
    rec = Recorder()
    rt.watch(rec)
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    out, inp = np.zeros(5, np.float32), values(RANK, 5)
    ob, ib = Buffer.from_numpy(out), Buffer.from_numpy(inp)
    recv = run(Call(Op.RECV, None, backend, ob, async_op=True, writes=(ob,),
                    check=lambda g, c: {"peer": g.group_rank(prv, "src")},
                    issue=lambda be, g, red, sig: be.recv(g, ob, sig["peer"], 3)))
    send = run(Call(Op.SEND, None, backend, ib, async_op=True, reads=(ib,),
                    check=lambda g, c: {"peer": g.group_rank(nxt, "dst")},
                    issue=lambda be, g, red, sig: be.send(g, ib, sig["peer"], 3)))
    send.wait()
    recv.wait()
    np.testing.assert_array_equal(out, values(prv, 5))
    assert rec.seen == [] and [op for op, _ in rec.issued] == [Op.RECV, Op.SEND]
