"""mcrdl_jax non-blocking calls (``async_op=True``, ``mcrdl_jax.wait``), eager and under
``jax.jit``, on mpi and gloo, the world and a reversed subgroup, against NumPy on every
rank: every op with several handles in flight waited out of their start order, p2p
rings, handles on two backends at once, a handle carried through ``lax.fori_loop``,
gradients equal to the blocking calls', async reshard, and the bad uses (a handle
waited twice, never waited, leaving its jit). Jitted functions are compiled once per
backend and group and shared by the tests (compiles dominate the time)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcrdl_jax as mj
from conftest import RANK, SIZE, grp  # noqa: F401  (fixture)
from mcrdl_core.base.errors import InvalidArgumentError

BACKENDS = ["mpi", "gloo"]
N = 6  # a multiple of 1, 2 and 3 ranks


def vals(rank, shape, salt=0):
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + rank * 3 + salt) % 5 + 1).reshape(shape).astype(np.float32)


def expected(ranks, me):
    """NumPy references of every op in ``start_all`` on a group of ``ranks``."""
    n = len(ranks)
    xs = [vals(r, (N,)) for r in ranks]
    total = sum(xs)
    ring_src = ranks[(me - 1) % n]
    ref = {
        "all_reduce": total,
        "reduce": total if me == 0 else xs[me],
        "broadcast": xs[n - 1],
        "all_gather": np.stack(xs),
        "reduce_scatter": total.reshape(n, -1)[me],
        "all_to_all": np.concatenate([x.reshape(n, -1)[me] for x in xs]),
        "gather": np.stack(xs) if me == n - 1 else xs[me],
        "scatter": vals(ranks[0], (n, 2), 9)[me],
        "sendrecv": vals(ring_src, (N,)),
    }
    if n == 1:  # point-to-point needs a peer (Gloo cannot send to itself)
        del ref["sendrecv"]
    return ref


def start_all(x, blocks, group, ranks, backend):
    """Every op, started with async_op=True, in one order on every rank; returns
    {name: handle}. Roots are group members given by global rank."""
    me = ranks.index(RANK)
    n = len(ranks)
    kw = dict(group=group, backend=backend, async_op=True)
    handles = {
        "all_reduce": mj.all_reduce(x, **kw),
        "reduce": mj.reduce(x, dst=ranks[0], **kw),
        "broadcast": mj.broadcast(x, src=ranks[-1], **kw),
        "all_gather": mj.all_gather(x, **kw),
        "reduce_scatter": mj.reduce_scatter(x, **kw),
        "all_to_all": mj.all_to_all(x, **kw),
        "gather": mj.gather(x, dst=ranks[-1], **kw),
        "scatter": mj.scatter(blocks, src=ranks[0], **kw),
    }
    if n > 1:
        handles["sendrecv"] = mj.sendrecv(x, x, source=ranks[(me - 1) % n],
                                          dest=ranks[(me + 1) % n], **kw)
    return handles


def wait_reversed(handles):
    """Wait in the reverse of the start order (any order is allowed)."""
    return {k: mj.wait(handles[k]) for k in reversed(list(handles))}


def check(results, ranks, me):
    ref = expected(ranks, me)
    for k, v in results.items():
        np.testing.assert_allclose(np.asarray(v), ref[k], err_msg=f"rank {RANK}: {k}")


def inputs(ranks):
    n = len(ranks)
    return jnp.asarray(vals(RANK, (N,))), jnp.asarray(vals(ranks[0], (n, 2), 9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_eager_several_in_flight(grp, backend):
    group, ranks, me = grp
    x, blocks = inputs(ranks)
    handles = start_all(x, blocks, group, ranks, backend)
    assert all(isinstance(h, mj.Handle) for h in handles.values())
    results = wait_reversed(handles)
    check(results, ranks, me)
    assert all(h.is_completed() for h in handles.values())
    np.testing.assert_array_equal(np.asarray(x), vals(RANK, (N,)))  # inputs untouched
    assert mj.in_flight() == 0


@functools.lru_cache(maxsize=None)
def jitted_all(backend, group_name):
    """One compiled program per backend and group: every op started, independent
    compute, every op waited in reverse order."""
    from conftest import GROUPS, members

    group, ranks = GROUPS[group_name], members(group_name)

    @jax.jit
    def f(x, blocks, w):
        handles = start_all(x, blocks, group, ranks, backend)
        busy = jnp.tanh(w @ w)  # depends on no handle: XLA may run it between
        return wait_reversed(handles), busy

    return f


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_jit_several_in_flight(grp, backend):
    group, ranks, me = grp
    name = "world" if group is None else "sub"
    x, blocks = inputs(ranks)
    f = jitted_all(backend, name)
    for _ in range(2):  # run twice: each run starts fresh handles
        results, busy = f(x, blocks, jnp.eye(8))
        check(results, ranks, me)
    assert mj.in_flight() == 0


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_p2p_ring_and_two_backends_in_flight(mode):
    """send and recv around the ring, both started before either is waited (no
    ordering deadlock), with an mpi and a gloo all-reduce in flight meanwhile."""
    if SIZE < 2:
        pytest.skip("point-to-point needs 2 ranks")
    x = jnp.asarray(vals(RANK, (N,)))
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE

    def f(x):
        a = mj.all_reduce(x, backend="mpi", async_op=True)
        b = mj.all_reduce(x * 2, backend="gloo", async_op=True)
        r = mj.recv(x, prv, tag=3, backend="gloo", async_op=True)
        s = mj.send(x, nxt, tag=3, backend="gloo", async_op=True)
        return mj.wait(b), mj.wait(r), mj.wait(s), mj.wait(a)

    b, r, s, a = (jax.jit(f) if mode == "jit" else f)(x)
    total = sum(vals(q, (N,)) for q in range(SIZE))
    np.testing.assert_allclose(np.asarray(a), total)
    np.testing.assert_allclose(np.asarray(b), 2 * total)
    np.testing.assert_allclose(np.asarray(r), vals(prv, (N,)))
    assert float(s) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_handle_carried_through_fori_loop(backend):
    """A pipeline's shape: each iteration waits the previous iteration's all-reduce and
    starts the next one; the last is waited after the loop."""
    x = jnp.asarray(vals(RANK, (N,)))

    @jax.jit
    def f(x):
        h0 = mj.all_reduce(x, backend=backend, async_op=True)

        def body(i, h):
            y = mj.wait(h)
            return mj.all_reduce(y / SIZE, backend=backend, async_op=True)

        return mj.wait(jax.lax.fori_loop(0, 3, body, h0))

    total = sum(vals(q, (N,)) for q in range(SIZE))
    np.testing.assert_allclose(np.asarray(f(x)), total, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_equal_blocking(backend):
    """grad and vjp through split-phase calls (jit and eager grad) equal the blocking
    calls' derivatives."""
    x = jnp.asarray(vals(RANK, (N,)))
    nxt, prv = (RANK + 1) % SIZE, (RANK - 1) % SIZE

    def loss(x, async_op):
        def go(call, *a, **k):
            r = call(*a, backend=backend, async_op=async_op, **k)
            return mj.wait(r) if async_op else r
        a = go(mj.all_reduce, x)
        b = go(mj.all_gather, x * a)
        c = go(mj.sendrecv, jnp.sin(x), x, source=prv, dest=nxt) if SIZE > 1 else x
        d = go(mj.reduce_scatter, jnp.tile(x, SIZE))
        return jnp.sum(a ** 2) + jnp.sum(jnp.cos(b)) + jnp.sum(c * x) + jnp.sum(d ** 3)

    ref = jax.grad(lambda x: loss(x, False))(x)
    got_jit = jax.jit(jax.grad(lambda x: loss(x, True)))(x)
    got_eager = jax.grad(lambda x: loss(x, True))(x)
    np.testing.assert_allclose(np.asarray(got_jit), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_eager), np.asarray(ref), rtol=1e-6)
    y, vjp = jax.vjp(lambda x: mj.wait(mj.all_reduce(x, backend=backend, async_op=True)), x)
    (ct,) = vjp(jnp.ones_like(y))
    np.testing.assert_allclose(np.asarray(ct), np.full(N, SIZE, np.float32))


def test_deleted_input_kept_alive():
    """An eager input deleted while its call is in flight: the handle keeps its memory."""
    if SIZE < 2:
        pytest.skip("point-to-point needs 2 ranks")
    x = jnp.asarray(vals(RANK, (1 << 16,)))
    h = mj.all_reduce(x, backend="mpi", async_op=True)
    s = mj.send(jnp.asarray(vals(RANK, (1 << 16,), 1)), (RANK + 1) % SIZE, tag=5,
                backend="mpi", async_op=True)
    r = mj.recv(x, (RANK - 1) % SIZE, tag=5, backend="mpi", async_op=True)
    x.delete()
    import gc
    gc.collect()
    total = sum(vals(q, (1 << 16,)) for q in range(SIZE))
    np.testing.assert_allclose(np.asarray(mj.wait(h)), total)
    np.testing.assert_allclose(np.asarray(mj.wait(r)), vals((RANK - 1) % SIZE, (1 << 16,), 1))
    mj.wait(s)


def test_handle_leaves_its_jit():
    """A handle returned by a jitted function is waited eagerly, or in another jitted
    function; a second wait of it is an error on every rank, never a hang."""
    x = jnp.asarray(vals(RANK, (N,)))
    start = jax.jit(lambda x: mj.all_reduce(x, backend="gloo", async_op=True))
    finish = jax.jit(lambda h: mj.wait(h) + 1)
    total = sum(vals(q, (N,)) for q in range(SIZE))
    h = start(x)
    np.testing.assert_allclose(np.asarray(mj.wait(h)), total)
    h2 = start(x)
    np.testing.assert_allclose(np.asarray(finish(h2)), total + 1)
    with pytest.raises(Exception, match="already waited"):
        jax.block_until_ready(finish(h2))  # the run-time check, inside the callback


def test_bad_uses_are_clear_errors():
    mj.wait_all()  # (what a failed test before this one left)
    x = jnp.asarray(vals(RANK, (N,)))
    h = mj.all_reduce(x, backend="mpi", async_op=True)
    mj.wait(h)
    with pytest.raises(InvalidArgumentError, match="already waited"):
        mj.wait(h)

    def twice(x):
        h = mj.all_reduce(x, backend="mpi", async_op=True)
        return mj.wait(h) + mj.wait(h)

    with pytest.raises(InvalidArgumentError, match="already waited"):
        jax.jit(twice)(x)  # at trace time: nothing was started
    with pytest.raises(InvalidArgumentError, match="Handle"):
        mj.wait(x)
    with pytest.raises(InvalidArgumentError, match="eager handles"):
        jax.jit(lambda x: mj.all_reduce(x, async_op=True).is_completed())(x)
    # never waited: still completes; wait_all drops them
    for _ in range(3):
        mj.broadcast(x, src=0, backend="gloo", async_op=True)
    jax.jit(lambda x: mj.all_reduce(x, backend="mpi", async_op=True).ident)(x)
    assert mj.in_flight() == 4
    assert mj.wait_all() == 4 and mj.in_flight() == 0


@pytest.mark.parametrize("method", ["broadcast", "send_recv"])
def test_reshard_async(method):
    """rows over the world -> columns over the reversed world, eager and jitted, as the
    blocking reshard gives."""
    from mcrdl_core.reshard import Layout, Mesh

    shape = (2 * SIZE, 3 * SIZE)
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    src = Layout(Mesh(list(range(SIZE)), ("a",)), ["a", None])
    dst = Layout(Mesh(list(reversed(range(SIZE))), ("b",)), [None, "b"])
    (r0, r1), _ = src.tile(shape, RANK)
    _, (c0, c1) = dst.tile(shape, RANK)
    tile = jnp.asarray(full[r0:r1])
    h = mj.reshard(tile, src, dst, shape, method=method, async_op=True)
    np.testing.assert_array_equal(np.asarray(mj.wait(h)), full[:, c0:c1])
    f = jax.jit(lambda t: mj.wait(mj.reshard(t, src, dst, shape, method=method,
                                             async_op=True)))
    np.testing.assert_array_equal(np.asarray(f(tile)), full[:, c0:c1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_1f1b_nonblocking_matches_single_process(backend):
    """bench/apps/jax_pipeline.py's 1F1B with non-blocking sends and receives posted
    ahead: the parameters of a single-process run."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "apps"))
    import jax_pipeline as app

    dims, steps, batch, lr = [8, 8, 8, 4], 4, 12, 0.1
    stage, _, _ = app.train(dims, steps, micro=3, batch_size=batch, lr=lr, backend=backend,
                            schedule="1f1b", comm="nonblocking")
    diff = app.max_param_difference(stage, steps, batch, lr)
    assert diff < 1e-5, f"rank {RANK}: parameters differ from the single-process run by {diff}"
    assert mj.in_flight() == 0
