"""The Backend interface every module in ``backends/`` implements, and the registry.

A backend receives validated arguments: Buffers (contiguous where they are written),
a :class:`Group` of which this rank is a member, and ranks *within that group*. Each
op returns a :class:`Work` without blocking. Whatever a backend cannot do natively it
builds from its own library's primitives, never by quietly calling another backend.

Adding a backend is one new module plus a ``register_backend(name, "module:Class")``.
"""
from __future__ import annotations

import importlib

from .errors import BackendUnavailableError

#: name -> "module:attribute" (or the class itself once registered by code)
REGISTRY: dict[str, object] = {
    "mpi": "mcrdl_backends.mpi:MPIBackend",
    "gloo": "mcrdl_backends.gloo:GlooBackend",
    "nccl": "mcrdl_backends.nccl:NCCLBackend",
}


def register_backend(name: str, target) -> None:
    """Register a backend class (or a "module:Class" string) under ``name``."""
    REGISTRY[name] = target


def load_attr(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_class(name: str):
    """The class registered as ``name``; BackendUnavailableError if it cannot load."""
    target = REGISTRY.get(name)
    if target is None:
        raise BackendUnavailableError(f"unknown backend {name!r}; known: {sorted(REGISTRY)}")
    if isinstance(target, str):
        try:
            target = load_attr(target)
        except ModuleNotFoundError as exc:
            if exc.name == target.partition(":")[0]:
                raise BackendUnavailableError(
                    f"backend {name!r} is not part of this version of MCR-DL yet") from exc
            raise BackendUnavailableError(
                f"backend {name!r} cannot be imported ({exc}); install the "
                f"'mcr-dl[{ {'mpi': 'mpich', 'gloo': 'torch', 'nccl': 'gpu'}.get(name, 'all') }]' "
                "extra") from exc
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend {name!r} cannot be imported ({exc}); install the "
                f"'mcr-dl[{ {'mpi': 'mpich', 'gloo': 'torch', 'nccl': 'gpu'}.get(name, 'all') }]' "
                "extra") from exc
        REGISTRY[name] = target
    return target


class Backend:
    """Base class; one instance per backend per runtime."""

    name = "base"
    #: device kinds this backend handles ("cpu", "cuda")
    devices: tuple = ("cpu",)

    def __init__(self, runtime):
        self.rt = runtime

    # --- availability and capabilities --------------------------------------------------
    @classmethod
    def unavailable_reason(cls, bootstrap) -> str | None:
        """None if the backend can run in this job, else why not (shown to users)."""
        return None

    def unsupported_reason(self, op, device, dtype, reduce_op=None) -> str | None:
        """None if this backend can do ``op`` on this device/dtype/reduce op, else why."""
        if device.kind not in self.devices:
            return f"{self.name} does not handle {device.kind} buffers"
        return None

    # --- communicators ------------------------------------------------------------------
    def comm(self, group):
        """This backend's communicator for ``group``, created once and cached."""
        c = group.comms.get(self.name)
        if c is None:
            c = group.comms[self.name] = self.create_comm(group)
        return c

    def create_comm(self, group):
        raise NotImplementedError

    def destroy(self) -> None:
        """Release communicators (called by the runtime's destroy())."""

    # --- operations (all return Work) ---------------------------------------------------
    def send(self, group, buf, dst, tag): raise NotImplementedError
    def recv(self, group, buf, src, tag): raise NotImplementedError
    def broadcast(self, group, buf, root): raise NotImplementedError
    def reduce(self, group, buf, root, op): raise NotImplementedError
    def all_reduce(self, group, buf, op): raise NotImplementedError
    def all_gather(self, group, out, inp): raise NotImplementedError
    def reduce_scatter(self, group, out, inp, op): raise NotImplementedError
    def all_to_all(self, group, out, inp, out_counts, in_counts, even=False):
        """``even``: the call is even by its form on every rank (no split sizes given),
        so a backend may use an even-only algorithm; equal counts on this rank alone do
        not say that (another rank's may differ)."""
        raise NotImplementedError
    def gather(self, group, out, inp, root): raise NotImplementedError
    def scatter(self, group, out, inp, root): raise NotImplementedError
    def barrier(self, group): raise NotImplementedError
