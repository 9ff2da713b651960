"""mcrdl_autoload: registers the "mcrdl" torch.distributed backend when torch is imported.

pyproject.toml names :func:`register` as an entry point of the ``torch.backends`` group;
torch calls every such entry point at the end of ``import torch`` (unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) and turns any exception into a failed
``import torch``. So this module never raises and does nothing heavy: it registers a
creator that imports the process group only when a group is created, and wraps
torch's ``env://`` rendezvous so that ``init_process_group`` also works under
``mpiexec`` (only when ``RANK`` is unset and an MPI launcher started the process; the
variables then come from MPI, see ``mcrdl_torch.run.mpi_env``). Errors are logged to
``mcrdl.torch.autoload`` at debug level.

It is a top-level package of its own, not a module of ``mcrdl_torch``: importing
``mcrdl_torch.anything`` runs ``mcrdl_torch/__init__.py`` and so imports ``mcrdl_core``,
which every ``import torch`` would then pay for (60-100 ms here), and a broken
``mcrdl_core`` would have made ``import torch`` fail. This package imports nothing but
the standard library until a group is created or the rendezvous runs.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("mcrdl.torch.autoload")

MPI_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
_FILLED: dict = {}  # the rendezvous variables this module set from MPI, and their values


def _create(dist_opts, backend_options=None):
    from mcrdl_torch.process_group import create

    return create(dist_opts, backend_options)


def _wrap_env_rendezvous(rdzv) -> None:
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    original = handlers.get("env") if handlers is not None else None
    if original is None or getattr(original, "_mcrdl", False):
        return

    def env_or_mpi(url, *args, **kwargs):
        if any(v in os.environ for v in MPI_VARS) and ("RANK" not in os.environ or _FILLED):
            from mcrdl_torch.run import mpi_env

            # a later init in the same job: what an earlier one filled in is chosen again
            # (a fresh MASTER_PORT from rank 0), so no rank can join the previous group's
            # store server while rank 0 still holds it
            for k, v in _FILLED.items():
                if os.environ.get(k) == v:
                    del os.environ[k]
            _FILLED.clear()
            _FILLED.update(mpi_env())
        return original(url, *args, **kwargs)

    env_or_mpi._mcrdl = True
    handlers["env"] = env_or_mpi


def register() -> None:
    """The entry point: register the lazy creator; never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        if "MCRDL" not in dist.Backend._plugins:
            dist.Backend.register_backend("mcrdl", _create, extended_api=True,
                                          devices=["cpu", "cuda"])
        import importlib

        # the module, not the function torch.distributed re-exports under that name
        _wrap_env_rendezvous(importlib.import_module("torch.distributed.rendezvous"))
    except Exception:  # an exception here would make `import torch` fail
        log.debug("mcrdl: could not register the torch.distributed backend", exc_info=True)
