"""mcrdl_jax in one process: arrays it cannot take are refused with advice, before
anything is sent (a subprocess, so that JAX can be given two CPU devices)."""
import os
import subprocess
import sys

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import mcrdl_jax as mj
from mcrdl_core.errors import InvalidArgumentError
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
try:
    mj.all_reduce(x, backend="mpi")
except InvalidArgumentError as e:
    assert "sharded over 2 devices" in str(e), e
    print("refused:", e)
y = mj.all_reduce(x.addressable_shards[0].data, backend="mpi")   # one device: fine
np.testing.assert_array_equal(np.asarray(y), [0.0, 1.0])
print("ok")
"""


def test_sharded_array_is_refused_with_advice():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               MCRDL_TUNING_TABLE="none", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused:" in proc.stdout and proc.stdout.strip().endswith("ok"), proc.stdout
