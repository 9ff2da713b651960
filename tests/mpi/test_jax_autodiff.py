"""mcrdl_jax under jax.grad and jax.vmap: the gradient of every differentiable op, on
mpi and gloo, eager and jitted, equals the gradient of the same program written for
one process (the sum over ranks of each rank's objective, see autodiff.py); vmap of
every op equals a loop of calls; a data-parallel model's all-reduced gradients equal
the single-process gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mcrdl_jax as mj
from conftest import RANK, SIZE
from mcrdl_core.base.errors import UnsupportedError

N = 4  # rows per rank block


def x_of(r, shape, salt=0):
    n = int(np.prod(shape))
    return jnp.asarray(((np.arange(n) * 7 + r * 3 + salt) % 5 + 1).reshape(shape), jnp.float32)


def w_of(r, shape):
    """Rank r's objective is sum(w_r * out_r): different weights per rank and element."""
    return x_of(r, shape, salt=11) / 5.0 - 0.5


# op name -> (input shape, multi-process call, single-process semantics of rank r's output)
def _ring(xs, r):
    return xs[(r - 1) % SIZE]


CASES = {
    "all_reduce_sum": ((N,), lambda x, b: mj.all_reduce(x, "sum", backend=b),
                       lambda xs, r: sum(xs)),
    "all_reduce_avg": ((N,), lambda x, b: mj.all_reduce(x, "avg", backend=b),
                       lambda xs, r: sum(xs) / SIZE),
    "reduce": ((N,), lambda x, b: mj.reduce(x, SIZE - 1, backend=b),
               lambda xs, r: sum(xs) if r == SIZE - 1 else xs[r]),
    "broadcast": ((N,), lambda x, b: mj.broadcast(x, SIZE - 1, backend=b),
                  lambda xs, r: xs[SIZE - 1]),
    "all_gather": ((2, N), lambda x, b: mj.all_gather(x, backend=b),
                   lambda xs, r: jnp.stack(xs)),
    "all_gather_tiled": ((2, N), lambda x, b: mj.all_gather(x, backend=b, tiled=True),
                         lambda xs, r: jnp.concatenate(xs)),
    "reduce_scatter": ((2 * SIZE, N), lambda x, b: mj.reduce_scatter(x, backend=b),
                       lambda xs, r: sum(xs)[2 * r:2 * r + 2]),
    "reduce_scatter_avg": ((2 * SIZE, N), lambda x, b: mj.reduce_scatter(x, "avg", backend=b),
                           lambda xs, r: (sum(xs) / SIZE)[2 * r:2 * r + 2]),
    "all_to_all": ((2 * SIZE, N), lambda x, b: mj.all_to_all(x, backend=b),
                   lambda xs, r: jnp.concatenate([x[2 * r:2 * r + 2] for x in xs])),
    "gather": ((N,), lambda x, b: mj.gather(x, 0, backend=b),
               lambda xs, r: jnp.stack(xs) if r == 0 else xs[r]),
    "scatter": ((SIZE, N), lambda x, b: mj.scatter(x, 0, backend=b), lambda xs, r: xs[0][r]),
    "sendrecv_ring": ((N,), lambda x, b: mj.sendrecv(x, x, (RANK - 1) % SIZE, (RANK + 1) % SIZE,
                                                     backend=b), _ring),
}


def case_of(case):
    """(input shape, call, semantics) of a case; skips cases this world size lacks."""
    if case == "sendrecv_ring" and SIZE < 2:
        pytest.skip("needs 2 ranks")
    return CASES[case]


def reference_grad(shape, semantics, weight=w_of):
    """d/dx_RANK of sum_r sum(weight_r * out_r(x_0..x_{n-1})), in one process."""
    def total(xs):
        return sum(jnp.sum(weight(r, semantics(xs, r).shape) * semantics(xs, r))
                   for r in range(SIZE))
    xs = [x_of(r, shape) for r in range(SIZE)]
    return jax.grad(total)(xs)[RANK]


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_grad_matches_single_process(case, backend, mode):
    shape, call, semantics = case_of(case)

    def objective(x):
        y = call(x, backend)
        return jnp.sum(w_of(RANK, y.shape) * y)

    grad = jax.grad(objective)
    if mode == "jit":
        grad = jax.jit(grad)
    g = grad(x_of(RANK, shape))
    np.testing.assert_allclose(np.asarray(g), np.asarray(reference_grad(shape, semantics)),
                               rtol=1e-5, atol=1e-5, err_msg=f"rank {RANK}")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["all_reduce_sum", "all_gather", "reduce_scatter",
                                  "all_to_all", "sendrecv_ring"])
def test_grad_in_16_bit_floats(case, backend, mode, dtype):
    """Cotangents keep the primal's 16-bit dtype on every path (the jit MPI path widens
    reductions to float32 and moves data as bits; the values here are exact in 16 bits)."""
    shape, call, semantics = case_of(case)
    dt = jnp.dtype(dtype)

    def weight(r, shape):  # small integers: exact in 16 bits
        return (w_of(r, shape) * 4).round()

    def objective(x):
        y = call(x, backend)
        return jnp.sum(weight(RANK, y.shape).astype(dt) * y).astype(jnp.float32)

    grad = jax.grad(objective)
    g = (jax.jit(grad) if mode == "jit" else grad)(x_of(RANK, shape).astype(dt))
    assert g.dtype == dt

    want = reference_grad(shape, semantics, weight)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want), rtol=1e-2,
                               err_msg=f"rank {RANK}")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_send_recv_grad_travels_back(backend, mode):
    """Rank 0 sends h = x0**2 to rank 1, which computes sum(w * h * v). The cotangent of
    h comes back to rank 0: d/dx0 = 2 x0 w v; rank 1 gets d/dv = w h."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    x0, v, w = x_of(0, (N,)), x_of(1, (N,), 3), w_of(1, (N,))
    wrap = jax.jit if mode == "jit" else (lambda f: f)
    if RANK == 0:
        g = wrap(jax.grad(lambda x: mj.send(x * x, 1, tag=3, backend=backend)))(x0)
        np.testing.assert_allclose(np.asarray(g), np.asarray(2 * x0 * w * v), rtol=1e-6)
    elif RANK == 1:
        def f(v, like):  # like is differentiated so that recv's cotangent goes back
            return jnp.sum(w * mj.recv(like, 0, tag=3, backend=backend) * v)
        gv, glike = wrap(jax.grad(f, argnums=(0, 1)))(v, jnp.zeros(N, jnp.float32))
        np.testing.assert_allclose(np.asarray(gv), np.asarray(w * x0 * x0), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(glike), 0)


def test_non_linear_reductions_refuse_grad():
    with pytest.raises(UnsupportedError, match="only SUM and AVG are differentiable"):
        jax.grad(lambda x: jnp.sum(mj.all_reduce(x, "max", backend="mpi")))(jnp.ones(3))
    with pytest.raises(UnsupportedError, match="any source is not differentiable"):
        jax.grad(lambda x: jnp.sum(mj.recv(x, None, backend="mpi")))(jnp.ones(3))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", list(CASES))
def test_vmap_matches_a_loop(case, backend, mode):
    """vmap over a batch of 3 gives what 3 separate calls give."""
    shape, call, _ = case_of(case)
    xb = jnp.stack([x_of(RANK, shape, salt=s) for s in range(3)])
    f = jax.vmap(lambda x: call(x, backend))
    if mode == "jit":
        f = jax.jit(f)
    got = f(xb)
    want = jnp.stack([call(xb[i], backend) for i in range(3)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, err_msg=f"rank {RANK}")


def test_vmap_of_grad():
    xb = jnp.stack([x_of(RANK, (N,), salt=s) for s in range(2)])
    g = jax.vmap(jax.grad(lambda x: jnp.sum(mj.all_reduce(x, backend="gloo") ** 2)))(xb)
    tot = sum(jnp.stack([x_of(r, (N,), salt=s) for s in range(2)]) for r in range(SIZE))
    np.testing.assert_allclose(np.asarray(g), np.asarray(2 * tot * SIZE), rtol=1e-6)


def _mlp(params, x):
    (w1, b1), (w2, b2) = params
    return jnp.tanh(x @ w1 + b1) @ w2 + b2


def _loss(params, x, y):
    return jnp.mean((_mlp(params, x) - y) ** 2)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_data_parallel_gradients_equal_single_process(backend, mode):
    """Each rank takes its shard of the batch; the all-reduced (AVG) gradients equal the
    gradient of the whole batch in one process."""
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = [(jax.random.normal(k[0], (5, 8)) * 0.3, jnp.zeros(8)),
              (jax.random.normal(k[1], (8, 2)) * 0.3, jnp.zeros(2))]
    x = jax.random.normal(k[2], (4 * SIZE, 5))
    y = jax.random.normal(k[3], (4 * SIZE, 2))
    shard = slice(4 * RANK, 4 * RANK + 4)

    def dp_grads(p, xs, ys):
        g = jax.grad(_loss)(p, xs, ys)
        return jax.tree_util.tree_map(lambda t: mj.all_reduce(t, "avg", backend=backend), g)

    step = jax.jit(dp_grads) if mode == "jit" else dp_grads
    got = step(params, x[shard], y[shard])
    want = jax.grad(_loss)(params, x, y)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend, mode", [("mpi", "jit"), ("gloo", "eager")])
def test_all_to_all_grad_with_only_output_splits_given(backend, mode):
    """Rank r's input has n*(r+1) rows split evenly (input_split_sizes=None); every rank
    receives j+1 rows from rank j (output_split_sizes=[1..n]). The backward all-to-all
    must send the cotangent back with x's even split, not an even split of itself."""
    outs = list(range(1, SIZE + 1))

    def rows(r):
        return SIZE * (r + 1)

    def out_r(xs, r):  # rank r receives block r of each rank j's even split (j+1 rows)
        return jnp.concatenate([xs[j][r * (j + 1):(r + 1) * (j + 1)] for j in range(SIZE)])

    def objective(x):
        y = mj.all_to_all(x, backend=backend, output_split_sizes=outs)
        return jnp.sum(w_of(RANK, y.shape) * y)

    grad = jax.jit(jax.grad(objective)) if mode == "jit" else jax.grad(objective)
    g = grad(x_of(RANK, (rows(RANK), 2)))

    def total(xs):
        return sum(jnp.sum(w_of(r, out_r(xs, r).shape) * out_r(xs, r)) for r in range(SIZE))
    want = jax.grad(total)([x_of(r, (rows(r), 2)) for r in range(SIZE)])[RANK]
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, err_msg=f"rank {RANK}")


# each pair of rules on each lowering (mpi4jax, host callback), eager on both backends;
# a selection, as second derivatives take about a second each to trace and compile
HVP_CASES = [("all_reduce_sum", "mpi", "jit"), ("all_reduce_sum", "gloo", "eager"),
             ("broadcast", "gloo", "jit"), ("reduce_scatter", "mpi", "jit"),
             ("scatter", "mpi", "jit"), ("sendrecv_ring", "gloo", "jit")]


@pytest.mark.parametrize("case, backend, mode", HVP_CASES)
def test_hessian_vector_product_matches_single_process(case, backend, mode):
    """Reverse over reverse: the derivative rules are written with the differentiable
    ops, so grad(vdot(grad(f), v)) works and equals the single-process Hessian-vector
    product (the cases cover each pair of rules: all_reduce, broadcast<->reduce,
    reduce_scatter<->all_gather, scatter<->gather, sendrecv)."""
    shape, call, semantics = case_of(case)

    def objective(x):  # cubic, so that the Hessian is not zero
        y = call(x, backend)
        return jnp.sum(w_of(RANK, y.shape) * y ** 3)

    v = x_of(RANK, shape, salt=5) / 5.0

    def hvp(x):
        return jax.grad(lambda z: jnp.vdot(jax.grad(objective)(z), v))(x)

    got = (jax.jit(hvp) if mode == "jit" else hvp)(x_of(RANK, shape))

    def total(xs):
        return sum(jnp.sum(w_of(r, semantics(xs, r).shape) * semantics(xs, r) ** 3)
                   for r in range(SIZE))
    xs = [x_of(r, shape) for r in range(SIZE)]
    vs = [x_of(r, shape, salt=5) / 5.0 for r in range(SIZE)]
    want = jax.jit(jax.grad(lambda xs: sum(jnp.vdot(g, u) for g, u in
                                           zip(jax.grad(total)(xs), vs))))(xs)[RANK]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=f"rank {RANK}")


def test_forward_mode_is_refused_with_the_documented_error():
    """jvp/jacfwd are not supported (docs/jax.md): JAX raises this TypeError before anything
    is sent, on every rank."""
    x = x_of(RANK, (N,))
    msg = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"
    with pytest.raises(TypeError, match=msg):
        jax.jvp(lambda x: mj.all_reduce(x, backend="mpi"), (x,), (x,))
    with pytest.raises(TypeError, match=msg):
        jax.jit(jax.jacfwd(lambda x: mj.all_gather(x, backend="gloo")))(x)
    # reverse mode still works afterwards: nothing was left half sent
    g = jax.grad(lambda x: jnp.sum(mj.all_reduce(x, backend="mpi")))(x)
    np.testing.assert_allclose(np.asarray(g), SIZE)


def _comm_calls(jaxpr_text: str) -> int:
    """Communication primitives in a jaxpr: mpi4jax's and mcrdl_jax's host call."""
    return sum(jaxpr_text.count(p) for p in ("mcrdl_host_call[", "allreduce_mpi["))


@pytest.mark.parametrize("backend, mode", [("mpi", "jit"), ("gloo", "eager")])
def test_checkpoint_around_a_communicating_layer(backend, mode):
    """jax.checkpoint (remat) around a layer with an all_reduce: the gradient equals the
    one without checkpoint, and the program holds the same number of communications
    (JAX keeps an effectful call's outputs instead of replaying it, so no rank
    re-issues a collective in the backward pass)."""
    w = x_of(0, (N, N)) / 10.0

    def layer(x):
        return jnp.tanh(mj.all_reduce(x @ w, backend=backend))

    def loss(x, wrap):
        return jnp.sum(w_of(RANK, (N,)) * wrap(layer)(x) ** 2)

    x = x_of(RANK, (N,)) / 5.0
    grads = {}
    for name, wrap in (("remat", jax.checkpoint), ("plain", lambda f: f)):
        g = jax.grad(lambda x: loss(x, wrap))
        grads[name] = (jax.jit(g) if mode == "jit" else g)(x)
    np.testing.assert_allclose(np.asarray(grads["remat"]), np.asarray(grads["plain"]),
                               rtol=1e-6, err_msg=f"rank {RANK}")
    texts = {name: str(jax.make_jaxpr(jax.grad(lambda x: loss(x, wrap)))(x))
             for name, wrap in (("remat", jax.checkpoint), ("plain", lambda f: f))}
    assert _comm_calls(texts["remat"]) == _comm_calls(texts["plain"]) == 2, texts["remat"]
