"""The core takes any DLPack producer: JAX arrays (zero-copy, read as inputs), NumPy
arrays (bfloat16 via ml_dtypes) and torch tensors, mixed in one call and across ranks."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import mcrdl_core as core
from conftest import RANK, SIZE

JAX_DTYPES = {"float32": (jnp.float32, np.float32), "bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16),
              "int32": (jnp.int32, np.int32), "float16": (jnp.float16, np.float16)}


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("name", list(JAX_DTYPES))
def test_jax_input_numpy_output(backend, name):
    jdt, ndt = JAX_DTYPES[name]
    x = jnp.full((3,), RANK + 1, dtype=jdt)
    buf = core.as_buffer(x)
    assert buf.ptr == x.unsafe_buffer_pointer()  # zero-copy
    out = np.zeros(3 * SIZE, dtype=ndt)
    core.all_gather_into_tensor(out, x, backend=backend)
    expected = np.repeat(np.arange(1, SIZE + 1), 3).astype(ndt)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_torch_to_numpy_point_to_point(backend):
    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    if RANK == 0:
        core.send(torch.arange(5, dtype=torch.bfloat16), 1, backend=backend)
    elif RANK == 1:
        got = np.zeros(5, dtype=ml_dtypes.bfloat16)
        assert core.recv(got, 0, backend=backend) == 0
        np.testing.assert_array_equal(got.astype(np.float32), np.arange(5, dtype=np.float32))


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("tdt, jdt", [(torch.float32, jnp.float32), (torch.bfloat16, jnp.bfloat16),
                                      (torch.int32, jnp.int32)])
def test_torch_rank_to_jax_rank_and_back(backend, tdt, jdt):
    """Rank 0 speaks mcrdl_torch, rank 1 mcrdl_jax: a tensor goes over as a JAX array
    and the doubled array comes back as a tensor."""
    import mcrdl_jax as mj
    import mcrdl_torch as mt

    if SIZE < 2:
        pytest.skip("needs 2 ranks")
    if RANK == 0:
        mt.send(torch.arange(6, dtype=tdt), 1, backend=backend)
        back = torch.zeros(6, dtype=tdt)
        mt.recv(back, 1, backend=backend)
        assert torch.equal(back, torch.arange(6, dtype=tdt) * 2)
    elif RANK == 1:
        x = mj.recv(jnp.zeros(6, jdt), 0, backend=backend)
        assert isinstance(x, jax.Array) and x.dtype == jdt
        np.testing.assert_array_equal(np.asarray(x, dtype=np.float64), np.arange(6.0))
        mj.send(x * 2, 0, backend=backend)
