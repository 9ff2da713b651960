"""The runtime: bootstrap, groups, backend instances, selection, and issuing calls.

One Runtime per process (``get_runtime()``), created on first use or by ``init()``.

Faults (docs/reliability.md). Every step that waits for peers — bootstrap exchanges,
communicator creation, the debug checks, the ops — waits in the progress loop under
``MCRDL_TIMEOUT``. A wait that runs past it raises CommTimeoutError and marks the
groups of the unfinished work broken (``Group.mark_broken``): later calls on them raise
BrokenGroupError at once. A timeout with no group (a bootstrap exchange while the
runtime is created) marks the whole process's runtime broken the same way.
``mcrdl_core.engine.faults`` then makes sure the process can exit with the Python exception's
status: helper threads still inside a library get a bounded grace to return, and
``destroy()`` does not wait again for work of broken groups.
"""
from __future__ import annotations

import logging

from ..base import config as _config
from ..base.errors import (BackendUnavailableError, BrokenGroupError, CommFailedError,
                           InvalidArgumentError, NotInitializedError)
from ..engine import faults as _faults
from ..engine.progress import engine as _engine
from ..engine.work import conflicts as _conflicts
from ..observe import recorder as _recorder
from ..observe.logger import logger as comm_logger
from ..world import bootstrap as _bootstrap
from ..world.backend import REGISTRY, backend_class
from ..world.group import Group
from . import hooks as _hooks
from . import selection as _selection
from .selection import TuningTable, parse_override, table_from_env

log = logging.getLogger("mcrdl.runtime")


class Runtime:
    def __init__(self, *, timeout: float | None = None, debug: bool | None = None,
                 table: TuningTable | str | None = None, bootstrap=None):
        """``bootstrap``: one made by the caller (the torch frontend's creator makes one
        on the store torch hands it), else the launcher's (``bootstrap.create``)."""
        self.engine = _engine()
        self.engine.on_timeout = self._timed_out
        self.engine.peer_check = self.peers_gone
        # before the bootstrap, whose waits for peers may fail too
        _faults.install_exit_guard(mpi_world=bootstrap is None
                                   and _bootstrap.detect_kind() == "mpi")
        if timeout is not None:
            self.engine.timeout = float(timeout)
        self.bootstrap = bootstrap if bootstrap is not None else _bootstrap.create()
        self.rank = self.bootstrap.rank
        self.world_size = self.bootstrap.size
        self.engine.rank = self.rank
        self.engine.configure(getattr(self.bootstrap, "local_size", 1))
        # observers (observe/observer.py) by name; ``observed``: calls take the general
        # path, which calls them (the fast path checks this one flag)
        self._watching: dict = {}
        self.observers: tuple = ()
        self.observed = False
        self.debug = _config.get("MCRDL_DEBUG") if debug is None else debug
        self.override = parse_override(_config.get("MCRDL_BACKEND"))
        if isinstance(table, str):
            table = TuningTable.load(table)
        self.table = table if table is not None else table_from_env()
        self.world = Group(0, range(self.world_size), self.rank, "world")
        self.groups = [self.world]
        self._made: dict = {}  # ranks -> how many groups of them new_group made
        self._backends: dict = {}
        self._unavailable: dict = {}
        self.choices: dict = {}  # memoized selections (and the fast path's plans)
        self.rules: dict = {}  # the rule of each selection (select(why=True))
        self._caches: dict = {}  # name -> a cache of a module, per runtime (cache())
        self.logger = comm_logger()
        self.alive = True
        self.unusable = None  # why calls are refused: "destroyed" or "broken" (check_alive)
        self.connect(self.world)
        _recorder.attach(self)

    # --- observers ----------------------------------------------------------------------
    def watch(self, observer, name: str | None = None) -> None:
        """Add an observer: an ``Observer`` (``name``: how to remove it; default its
        class's name) or the name of a registered one (``hooks.register_observer``;
        "debug" is the debug checks). Every rank adds the same observers: ``before``
        runs where a collective's ranks meet."""
        if isinstance(observer, str):
            name, observer = observer, _hooks.observer(observer)
        if not all(callable(getattr(observer, h, None)) for h in ("before", "after")):
            raise InvalidArgumentError(f"watch: {observer!r} is not an observer: it needs "
                                       "before() and after() (subclass mcrdl_core.Observer)")
        self._watching[name or type(observer).__name__] = observer
        self.observers = tuple(self._watching.values())
        self.observed = True

    def unwatch(self, name: str) -> None:
        """Remove the observer added as ``name`` (nothing if there is none)."""
        self._watching.pop(name, None)
        self.observers = tuple(self._watching.values())
        self.observed = bool(self.observers)

    @property
    def debug(self) -> bool:
        """Whether the debug checks (MCRDL_DEBUG) watch the calls; settable."""
        return "debug" in self._watching

    @debug.setter
    def debug(self, on: bool) -> None:
        if on:
            self.watch("debug")
        else:
            self.unwatch("debug")

    def before(self, group, op, backend, buf, **signature) -> None:
        """Show a collective about to run to every observer (they may refuse it)."""
        for o in self.observers:
            o.before(self, group, op, backend, buf, **signature)

    # --- backends -----------------------------------------------------------------------
    def unavailable_reason(self, name: str) -> str | None:
        if name in self._backends:
            return None
        if name not in self._unavailable:
            try:
                cls = backend_class(name)
                self._unavailable[name] = cls.unavailable_reason(self.bootstrap)
            except BackendUnavailableError as exc:
                self._unavailable[name] = str(exc)
        return self._unavailable[name]

    def available_backends(self) -> dict:
        """{name: None if usable here else the reason it is not}."""
        return {name: self.unavailable_reason(name) for name in REGISTRY}

    def backend(self, name: str):
        be = self._backends.get(name)
        if be is not None:
            return be
        reason = self.unavailable_reason(name)
        if reason is not None:
            usable = [n for n, r in self.available_backends().items() if r is None]
            raise BackendUnavailableError(f"backend {name!r} is not available: {reason}. "
                                          f"Available here: {usable}")
        be = self._backends[name] = backend_class(name)(self)
        return be

    def set_override(self, spec: str | dict | None) -> None:
        """Replace the MCRDL_BACKEND override ('mpi' or 'op=backend,...', or a dict)."""
        self.override = parse_override(spec) if isinstance(spec, str) or spec is None else dict(spec)
        self.choices.clear()
        self.rules.clear()

    def set_table(self, table: TuningTable | str | None) -> None:
        self.table = TuningTable.load(table) if isinstance(table, str) else table
        self.choices.clear()
        self.rules.clear()

    def cache(self, name: str) -> dict:
        """A dict of this runtime's, for a module's memo of things that hold only within
        one runtime (keyed by group ids, which restart at 0 in the next runtime):
        ``destroy()`` drops them all."""
        c = self._caches.get(name)
        if c is None:
            c = self._caches[name] = {}
        return c

    def named_backend(self, op, group: Group, backend: str | None) -> str | None:
        """The backend the user named for a call, or None where the choice is MCR-DL's
        (a table, then the policy). The one place of the rule: the call's ``backend=``,
        else the group's default (``new_group(backend=)``, ``init_process_group(backend=)``),
        else ``MCRDL_BACKEND`` (for ``op``, else for every op); "auto" names none."""
        if backend is None:
            backend = group.backend
        if backend is not None and backend != "auto":
            return backend
        ov = self.override
        return (ov.get(op.value) or ov.get("*")) if ov else None  # (usually empty: no lookups)

    def table_decides(self, op, group: Group, backend: str | None) -> bool:
        """Whether the tuning table chooses this call's backend, by its size: there is a
        table and nobody named a backend (``named_backend``: the call's ``backend=``,
        else the group's default, else ``MCRDL_BACKEND``; "auto" names none, also as a
        group's default, and a call's "auto" overrides its group's default). The one
        test of it: the general path's memo (``select``), the table's algorithms
        (``selection.algorithm``) and the fast path's memo keys and bound closures call
        it, so that every path of a call, on every rank, keys its choice by size alike."""
        return self.table is not None and self.named_backend(op, group, backend) is None

    def select(self, op, group: Group, buf, backend: str | None, reduce_op=None,
               nbytes: int | None = -1, why: bool = False):
        """The Backend instance for one call (explicit > MCRDL_BACKEND > table > policy),
        memoized here; ``selection.decide`` makes each new choice. ``why``: return
        (instance, the rule that chose it: ``selection.decide_why``), memoized alike."""
        if nbytes == -1:
            nbytes = buf.nbytes
        requested = backend
        if backend is None:
            backend = group.backend  # new_group(..., backend=) / init(backend=) default
        if why:
            be = self.select(op, group, buf, requested, reduce_op, nbytes)
            key = (requested is None, group.id, backend, op, buf.device.kind, buf.dtype,
                   reduce_op, nbytes if self.table_decides(op, group, backend) else None)
            rule = self.rules.get(key)
            if rule is None:
                rule = _selection.decide_why(self, op, group, buf.device, buf.dtype, reduce_op,
                                             backend, nbytes, requested)[1]
                if len(self.rules) > 65536:
                    self.rules.clear()
                self.rules[key] = rule
            return be, rule
        device, dtype = buf.device, buf.dtype
        # memo: explicit and policy choices by (backend, op, device, dtype, reduce op);
        # table choices also by group (its size and hosts) and message size (bounded)
        key = (backend, op, device.kind, dtype, reduce_op)
        if self.table is not None and self.table_decides(op, group, backend):
            key += (group.id, nbytes)
        be = self.choices.get(key)
        if be is not None:
            return be
        be = _selection.decide(self, op, group, device, dtype, reduce_op, backend, nbytes)
        if len(self.choices) > 65536:
            self.choices.clear()
        self.choices[key] = be
        return be

    def explain(self, op, buffer, group=None, backend: str | None = None, reduce_op=None,
                compression=None) -> dict:
        """What a call would get, and why, without sending anything: ``{"backend",
        "algorithm", "codec", "rule", "table"}`` (``selection.explain`` says more)."""
        return _selection.explain(self, op, buffer, group, backend, reduce_op, compression)

    # --- groups -------------------------------------------------------------------------
    def new_group(self, ranks=None, name: str | None = None, backend: str | None = None,
                  key: str | None = None) -> Group:
        """Like torch.distributed.new_group: every rank calls it, or the members only.
        ``ranks`` keep the order given (group rank i is ``ranks[i]``). ``key``: the
        group's identity among its members (default: the ranks and how many groups of
        the same ranks this process made before, which every member counts alike)."""
        if ranks is None:
            ranks = range(self.world_size)
        ranks = list(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad:
            raise InvalidArgumentError(f"new_group: ranks {bad} are outside the world of "
                                       f"{self.world_size} ranks (0..{self.world_size - 1})")
        if len(set(ranks)) != len(ranks) or not ranks:
            raise InvalidArgumentError(f"new_group: ranks {ranks} must be distinct and non-empty")
        made = self._made.get(tuple(ranks), 0)
        if key is None:
            key = f"{','.join(map(str, ranks))}#{made}"
        g = Group(len(self.groups), ranks, self.rank, name, key)
        g.backend = backend
        if g.is_member:
            self.connect(g)  # raises on every member if they are out of step: then the
        self._made[tuple(ranks)] = made + 1  # group counts as never made, here as there
        self.groups.append(g)
        return g

    def eager_backends(self, group: Group) -> list:
        """The backends whose communicators are made when the group is (``connect``): the
        group's default backend and the launcher's own (MPI under mpiexec, Gloo under
        torchrun), where available. The list depends only on what every rank shares."""
        names = [group.backend] if isinstance(group.backend, str) else []
        names.append({"mpi": "mpi", "env": "gloo"}.get(self.bootstrap.kind))
        return [n for n in dict.fromkeys(names)
                if n not in (None, "auto") and self.unavailable_reason(n) is None]

    def connect(self, group: Group) -> None:
        """Create the group's communicators of ``eager_backends`` now, while every member
        is in the call that made the group (``new_group``, the runtime's creation for the
        world), as torch's Gloo does: a first call on the group (an ``isend``, say) then
        never waits for the other members to make theirs, and members may use their
        groups in any order. Other backends' communicators are made on first use."""
        if group.size == 1:
            return
        for name in self.eager_backends(group):
            self.backend(name).comm(group)

    def group(self, group) -> Group:
        """Resolve None to the world and check that this rank is a member, that the
        runtime is alive and that the group is not broken (two attribute tests)."""
        if self.unusable is not None:
            self.check_alive()
        if group is None:
            if self.world.broken is not None:
                self.world.raise_broken()
            return self.world
        if not isinstance(group, Group):
            group = getattr(group, "mcrdl_group", group)
            if not isinstance(group, Group):
                raise InvalidArgumentError(f"group must be a group from new_group(), got "
                                           f"{type(group).__name__}")
        if not group.is_member:
            raise InvalidArgumentError(f"rank {self.rank} is not a member of {group.describe()}; "
                                       "only members may call collectives on it")
        if group.broken is not None:
            group.raise_broken()
        return group

    # --- issuing ------------------------------------------------------------------------
    def order(self, reads=(), writes=(), keep: bool = True):
        """Wait (through the progress loop) for in-flight work whose memory conflicts with
        this call's: read-after-write, write-after-read, write-after-write. Returns the
        spans to record on the new work; a blocking call (``keep=False``) never has
        another call issued while it is in flight, so it records none."""
        inflight = self.engine.inflight
        if not inflight and not keep:
            return ()
        spans = [(*b.span(), False) for b in reads] + [(*b.span(), True) for b in writes]
        if inflight:
            hazards = [w for w in inflight if _conflicts((w,), spans)]
            if hazards:
                self.engine.wait(hazards)
        return spans

    def finish(self, work, spans, async_op: bool, nbytes: int = 0):
        """Register the work; return it (async) or wait for it (blocking). ``nbytes`` is
        the call's size S for the comm logger (nccl-tests convention)."""
        work.spans = spans
        if self.observed:
            for o in self.observers:
                o.after(self, work, nbytes)
        if self.logger.enabled:
            work.add_finalizer(self.logger.start(work.op.value, nbytes, work.backend,
                                                 work.group.size if work.group else 1))
        if async_op:
            self.engine.add(work)
            return work
        work.wait()
        return None

    def check_alive(self):
        if not self.alive:
            raise NotInitializedError("the MCR-DL runtime was destroyed; call init() again")
        if _faults.runtime_fault is not None:
            raise BrokenGroupError(
                f"the MCR-DL runtime of this process is unusable since a set-up exchange "
                f"failed: {_faults.runtime_fault}. End the job (every rank gets an error) and "
                "check that every rank makes the same calls") from _faults.runtime_fault

    def peers_gone(self, works):
        """The error that says ``works`` (unfinished, in a wait) can no longer complete,
        or None: a group of theirs was broken meanwhile by another work (a library
        error, another thread's timeout), or a member whose process ran on this machine
        has ended (``Bootstrap.exited``). The engine asks every ``progress.CHECK_S`` s
        of a wait. Peers on other machines are seen only through their libraries (a
        closed Gloo connection) or at the timeout (docs/reliability.md)."""
        for w in works:
            g = w.group
            if not isinstance(g, Group):
                continue
            if g.broken is not None:
                return g.broken_error()
            dead = self.bootstrap.exited(g.ranks)
            if dead:
                return CommFailedError(
                    f"mcrdl: rank {self.rank}: {w.op} on {g.describe()} via backend "
                    f"'{w.backend}' {w.desc + ' ' if w.desc else ''}cannot complete: "
                    f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of the "
                    "group ran on this machine and has exited. The group is unusable now; "
                    "check that rank's output for why it ended.")
        return None

    def _timed_out(self, works, error) -> None:
        """The engine's hook for a wait past the runtime's timeout (see faults.py): a
        set-up exchange that timed out (no group) makes every later call refuse."""
        _faults.timed_out(works, error)
        if _faults.runtime_fault is not None:
            self.unusable = "broken"

    def destroy(self) -> None:
        """Wait for in-flight work (under the timeout), then release communicators. Work
        of broken groups is dropped, not waited for again: it cannot complete."""
        if not self.alive:
            return
        inflight = self.engine.inflight
        for w in [w for w in inflight if getattr(w.group, "broken", None) is not None]:
            self.engine.discard(w)
        if inflight:
            self.engine.wait(list(inflight))
        for be in self._backends.values():
            be.destroy()
        self._backends.clear()
        for g in self.groups:
            g.comms.clear()
        self.choices.clear()
        self._caches.clear()
        self.alive = False
        self.unusable = "destroyed"


_RUNTIME: Runtime | None = None


def init(**kwargs) -> Runtime:
    """Create the process's runtime (idempotent). Keywords: timeout (s), debug, table,
    bootstrap.

    If creating it timed out waiting for peers (a rank that never starts MCR-DL), the
    process's runtime is broken: this and every later call raise BrokenGroupError at
    once, since the set-up exchange that timed out is still pending in MPI."""
    global _RUNTIME
    if _RUNTIME is None or not _RUNTIME.alive:
        if _faults.runtime_fault is not None:
            raise BrokenGroupError(
                f"the MCR-DL runtime of this process is unusable since its creation failed: "
                f"{_faults.runtime_fault}. End the job (every rank gets an error) and check "
                "that every rank starts MCR-DL") from _faults.runtime_fault
        _RUNTIME = Runtime(**kwargs)
    return _RUNTIME


def get_runtime() -> Runtime:
    return _RUNTIME if _RUNTIME is not None and _RUNTIME.alive else init()


def is_initialized() -> bool:
    return _RUNTIME is not None and _RUNTIME.alive


def destroy() -> None:
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.destroy()
    _RUNTIME = None
