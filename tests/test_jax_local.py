"""mcrdl_jax in one process (each case in a subprocess: JAX with two CPU devices, or with
an internal taken away before mcrdl_jax is imported): arrays it cannot take are refused
with advice before anything is sent, under jax.grad too; a JAX without an internal the
jit path needs is a clear error naming the supported versions; an mpi4jax without its
shareable ordered effect turns the mpi4jax path off instead of splitting the token
chain in two."""
import os
import subprocess
import sys

import pytest

from mcrdl_core.memory import cuda as mc_cuda

GPU_REASON = mc_cuda.device_reason()

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mcrdl_jax as mj
from mcrdl_core.base.errors import InvalidArgumentError
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
try:
    mj.all_reduce(x, backend="mpi")
except InvalidArgumentError as e:
    assert "sharded over 2 devices" in str(e), e
    print("refused:", e)
try:  # the same check when the call runs eagerly from a derivative rule
    jax.grad(lambda v: jnp.sum(mj.all_reduce(v, backend="mpi")))(x)
    raise SystemExit("a sharded array was accepted under jax.grad")
except InvalidArgumentError as e:
    assert "sharded over 2 devices" in str(e), e
y = mj.all_reduce(x.addressable_shards[0].data, backend="mpi")   # one device: fine
np.testing.assert_array_equal(np.asarray(y), [0.0, 1.0])
print("ok")
"""


def _python(script: str, **env):
    env = dict(os.environ, **{"MCRDL_TUNING_TABLE": "none", "JAX_PLATFORMS": "cpu", **env})
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)


def test_sharded_array_is_refused_with_advice():
    proc = _python(SCRIPT, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused:" in proc.stdout and proc.stdout.strip().endswith("ok"), proc.stdout


MISSING_INTERNAL = r"""
import jax._src.callback as cb
del cb.emit_python_callback              # as if JAX had moved it
try:
    import mcrdl_jax
except ImportError as e:
    from mcrdl_core.base.errors import McrdlError
    assert isinstance(e, McrdlError), type(e)
    print("refused:", e)
"""


def test_missing_jax_internal_is_a_clear_import_error():
    proc = _python(MISSING_INTERNAL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "refused:" in out, out
    assert "jax._src.callback.emit_python_callback" in out, out
    assert "jax and jaxlib 0.10.x" in out and "mpi4jax 0.9.x" in out, out


NO_MPI4JAX_EFFECT = r"""
import logging
logging.basicConfig(level=logging.WARNING)
import mpi4jax._src.utils as u
del u.ordered_effect                     # an mpi4jax whose token chain cannot be shared
import jax, jax.numpy as jnp, numpy as np
import mcrdl_jax as mj
from mcrdl_jax import callback
assert callback.MPI4JAX is None
def f(a, b):
    return mj.all_reduce(a, backend="mpi"), mj.all_gather(b, backend="gloo")
x = jnp.arange(3.0)
effects = jax.make_jaxpr(f)(x, x).effects
assert len(effects) == 1, effects        # one token chain for both backends
text = jax.jit(f).lower(x, x).as_text()
assert "mpi_allreduce" not in text and "python_cpu_callback" in text
s, g = jax.jit(f)(x, x)
np.testing.assert_array_equal(np.asarray(s), [0.0, 1.0, 2.0])
np.testing.assert_array_equal(np.asarray(g), [[0.0, 1.0, 2.0]])
print("ok")
"""


def test_mpi4jax_without_its_ordered_effect_is_not_used():
    pytest.importorskip("mpi4jax")
    proc = _python(NO_MPI4JAX_EFFECT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert "does not expose its ordered effect" in proc.stderr, proc.stderr


GPU_ARRAYS = r"""
import jax, jax.numpy as jnp, numpy as np
try:
    gpu = jax.devices("gpu")[0]
except RuntimeError as e:
    print("SKIP:", e)
    raise SystemExit(0)
import mcrdl_jax as mj
from mcrdl_core import ReduceOp


def on_gpu(y):
    assert {d.platform for d in y.devices()} == {"gpu"}, y.devices()
    return np.asarray(y)


ref = np.arange(6.0, dtype=np.float32)
x = jax.device_put(jnp.asarray(ref), gpu)
b = jax.device_put(jnp.arange(5.0, dtype=jnp.bfloat16), gpu)
e = jax.device_put(jnp.zeros((0, 3), jnp.float32), gpu)
for be in ("nccl", "mpi", "gloo"):
    np.testing.assert_array_equal(on_gpu(mj.all_reduce(x, backend=be)), ref)
    np.testing.assert_array_equal(on_gpu(mj.broadcast(x, 0, backend=be)), ref)
    np.testing.assert_array_equal(on_gpu(mj.all_gather(x, backend=be)), ref[None])
    np.testing.assert_array_equal(on_gpu(mj.reduce_scatter(x, backend=be)), ref)
    np.testing.assert_array_equal(on_gpu(mj.all_to_all(x, backend=be, input_split_sizes=[6],
                                                       output_split_sizes=[6])), ref)
    y = mj.all_reduce(b, ReduceOp.MAX, backend=be)
    assert y.dtype == jnp.bfloat16, y.dtype
    np.testing.assert_array_equal(on_gpu(y).astype(np.float32), np.arange(5.0))
    assert mj.all_reduce(e, backend=be).shape == (0, 3)
    np.testing.assert_array_equal(np.asarray(x), ref)  # the input is never changed
for be in ("mpi", "gloo"):  # under jit: mpi4jax's primitive or the host callback
    np.testing.assert_array_equal(on_gpu(jax.jit(lambda a: mj.all_reduce(a, backend=be) * 2)(x)),
                                  ref * 2)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")
def test_gpu_arrays_eagerly_on_every_backend_and_under_jit():
    """GPU JAX arrays stay on the GPU: every backend eagerly (nccl included), bfloat16,
    zero elements, and under jit; the input is left as it was."""
    proc = _python(GPU_ARRAYS, JAX_PLATFORMS="", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if proc.stdout.startswith("SKIP:"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.strip().endswith("ok"), proc.stdout
