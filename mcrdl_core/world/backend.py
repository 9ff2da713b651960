"""The Backend interface every module in ``backends/`` implements, and the registry.

A backend receives validated arguments: Buffers (contiguous where they are written),
a :class:`Group` of which this rank is a member, and ranks *within that group*. Each
op returns a :class:`Work` without blocking. Whatever a backend cannot do natively it
builds from its own library's primitives, never by quietly calling another backend.

Adding a backend is one new module plus a ``register_backend(name, "module:Class")``.
The ops below are required; the methods under "optional" have a default that says the
backend does not offer the feature, and the core calls them directly (no ``getattr``).
"""
from __future__ import annotations

import importlib

from ..base.errors import BackendUnavailableError
from ..engine.work import conflicts

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

    # --- optional: features the core uses where a backend offers them -----------------
    #: True if ``batch_p2p`` issues several sends and receives as one group, ordered on
    #: a stream (NCCL's groupStart/groupEnd); point-to-point schedules then skip
    #: pre-posting receives (``p2p.py``, ``compress/schedule.py``)
    grouped_p2p: bool = False

    def batch_p2p(self, group, sends, recvs):
        """One Work for ``sends`` [(buf, group rank, tag)] and ``recvs`` (same shape),
        issued as a group. Only called where ``grouped_p2p`` is True."""
        raise NotImplementedError

    def cuda_call(self, op, fn, group, args):
        """Run ``fn(*args)`` (one of the ops above) for CUDA buffers on a backend whose
        library works on host memory or device pointers: ``cuda.cuda_dispatch`` routes
        the ops of a backend with "cuda" in ``devices`` here (device pointers after the
        producer's stream, or staging through host memory)."""
        raise NotImplementedError

    def fast_all_reduce(self, group, dtype, op):
        """An issuer ``issue(mem, count) -> request`` of an in-place all-reduce on host
        memory for the fast path (``fastpath.py``), or None: the default, the general
        path then runs every call."""
        return None

    def fast_issuer(self, op, group, dtype, red=None, root=None):
        """An issuer of ``op`` on host memory given by address for the fast path (see
        ``MPIBackend.fast_issuer`` for the arguments of each op), or None: the default,
        the general path then runs every call of the key."""
        return None

    def fast_blocking(self, op, group, dtype, red=None, root=None):
        """A compiled issue-and-poll of ``fast_issuer``'s call for blocking calls
        (``MPIBackend.fast_blocking``), or None: the default, the fast path then issues
        through ``fast_issuer`` and polls in Python."""
        return None

    def fast_request(self, left):
        """The pending request a ``fast_blocking`` call returned unfinished. Needed with
        ``fast_blocking``."""
        raise NotImplementedError

    def fast_work(self, op, group, req, spans, keep):
        """The Work, not yet registered with the engine, of a request an issuer made
        (``spans``: the memory it reads and writes; ``keep``: what keeps that memory
        alive). Needed with ``fast_issuer``. A request is whatever the issuer returns
        that ``Test()`` polls (a receive's also tells ``source()``); it may be the
        Work already (the MPI backend's compiled issuers make it), which this then
        completes. A receive's Work tells its sender: ``source()``, its rank in
        ``group``, and once complete ``value``, its global rank (``Work.result()``)."""
        raise NotImplementedError

    def fast_launch(self, op, group, issue, args, spans, keep, engine):
        """An async fast-path call: ``issue(*args)``, its Work (as ``fast_work``
        makes it) registered with the progress ``engine``. None, with nothing issued,
        where its memory ``spans`` conflict with work in flight (``conflicts``) or the
        issuer refuses its arguments (returns False): the general path then orders or
        judges the call. The default does it in Python; a backend may offer a
        compiled one (the MPI backend's is one C call), which the fast path binds once
        per key."""
        inflight = engine.inflight
        if inflight and conflicts(inflight, spans):
            return None
        req = issue(*args)
        if req is False:
            return None
        work = self.fast_work(op, group, req, spans, keep)
        work.engine = engine
        inflight.append(work)
        return work

    def work_of(self, op, group, req, ptr, nbytes, owner):
        """The Work of a request ``fast_all_reduce``'s issuer made, in place on
        ``nbytes`` at ``ptr``. Needed with ``fast_all_reduce``."""
        return self.fast_work(op, group, req, ((ptr, ptr + nbytes, True),), (owner,))
