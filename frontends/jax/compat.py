"""The JAX and mpi4jax versions mcrdl_jax supports, and the private internals it uses.

mcrdl_jax's jit path reaches into ``jax._src`` (a primitive of its own, an XLA host
callback that carries an ordered effect, the tracing state) and into mpi4jax's private
ordered effect, as mpi4jax itself reaches into JAX. Those names move between releases,
so they are all looked up here, once, at import: a missing one is a
:class:`JaxVersionError` naming the versions that are supported and tested, instead of
an ``AttributeError`` deep inside a jitted program.

The ordering rule: every communication of a jitted function, MPI through mpi4jax and
every other backend through the host callback, must hang on *one* token chain, or two
calls that share no data may run in different orders on different ranks (a deadlock).
So the callback carries mpi4jax's own ordered effect. If the installed mpi4jax does not
expose it (another version), the mpi4jax path is turned off (MPI then runs through the
callback into the core, on mcrdl_jax's own effect) and a warning says so: the chain is
never split in two.
"""
from __future__ import annotations

import importlib
import logging

from mcrdl_core.base.errors import McrdlError

log = logging.getLogger("mcrdl.jax")

SUPPORTED = "jax and jaxlib 0.10.x (tested: 0.10.2) with mpi4jax 0.9.x (tested: 0.9.1)"
INSTALL = "pip install 'mcr-dl[jax]' (jax>=0.10.2,<0.11, mpi4jax>=0.9.1,<0.10)"


class JaxVersionError(McrdlError, ImportError):
    """The installed JAX lacks an internal mcrdl_jax relies on; the message names the
    supported versions."""


# (module, attribute) of every private JAX name the frontend uses
INTERNALS = (
    ("jax.core", "Tracer"),  # deprecated public aliases, used to tell traced values
    ("jax.core", "ShapedArray"),
    ("jax._src.core", "Primitive"),
    ("jax._src.core", "ShapedArray"),
    ("jax._src.core", "trace_state_clean"),
    ("jax._src.dispatch", "apply_primitive"),
    ("jax._src.dispatch", "prim_requires_devices_during_lowering"),
    ("jax._src.effects", "Effect"),
    ("jax._src.effects", "lowerable_effects"),
    ("jax._src.effects", "ordered_effects"),
    ("jax._src.effects", "control_flow_allowed_effects"),
    ("jax._src.effects", "custom_derivatives_allowed_effects"),
    ("jax._src.effects", "remat_allowed_effects"),
    ("jax._src.callback", "emit_python_callback"),
    ("jax._src.interpreters.mlir", "register_lowering"),
    ("jax._src.interpreters.mlir", "TokenSet"),
)


def _lookup(module: str, attr: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def check_internals() -> dict:
    """``{"module.attr": object}`` for every name in INTERNALS; raises JaxVersionError
    naming all the missing ones and the supported versions."""
    import jax

    found = {f"{m}.{a}": _lookup(m, a) for m, a in INTERNALS}
    missing = [name for name, obj in found.items() if obj is None]
    if missing:
        raise JaxVersionError(
            f"mcrdl_jax cannot run with jax {jax.__version__}: it lacks "
            f"{', '.join(missing)}. mcrdl_jax supports {SUPPORTED}; install those "
            f"({INSTALL}), or use mcrdl_core's calls on arrays (they need no JAX internals)")
    return found


def mpi4jax_effect():
    """(mpi4jax module or None, its ordered effect or None). None for the effect means:
    do not lower to mpi4jax (absent, or a version whose token chain cannot be shared)."""
    try:
        import mpi4jax
    except ImportError:
        return None, None
    version = getattr(mpi4jax, "__version__", "unknown")
    effect = _lookup("mpi4jax._src.utils", "ordered_effect")
    if effect is None:
        log.warning("mcrdl_jax: mpi4jax %s does not expose its ordered effect "
                    "(mpi4jax._src.utils.ordered_effect), so MPI calls under jax.jit run "
                    "through MCR-DL's host callback instead of mpi4jax (one token chain for "
                    "every backend). Supported: %s", version, SUPPORTED)
        return None, None
    return mpi4jax, effect


def trace_state_clean():
    """The function that says whether no JAX transformation is tracing right now."""
    return _lookup("jax._src.core", "trace_state_clean")
