"""Argument and shape checks shared by the eager, traced and non-blocking paths of mcrdl_jax."""
from __future__ import annotations

import jax
import numpy as np

from mcrdl_core.base.errors import InvalidArgumentError


def leading_blocks(x, n: int, name: str, exact: bool = False) -> int:
    """Rows per block when the leading axis of ``x`` splits into ``n`` blocks (``exact``:
    the leading axis must be ``n`` itself); a clear error otherwise."""
    ok = x.ndim > 0 and (x.shape[0] == n if exact else x.shape[0] % n == 0)
    if not ok:
        want = f"equal to the group size {n}" if exact else f"a multiple of the group size {n}"
        raise InvalidArgumentError(f"mcrdl_jax.{name}: the leading axis of shape "
                                   f"{tuple(x.shape)} must be {want}")
    return x.shape[0] // n


def check_array(x, what: str = "x"):
    """``x`` itself when it is a JAX (or NumPy) array; an InvalidArgumentError naming the
    argument (``what``) otherwise, raised before the call chooses a path or sends anything."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise InvalidArgumentError(f"mcrdl_jax: {what} must be a JAX (or NumPy) array, got "
                                   f"{type(x).__name__}")
    return x
