"""How the processes find each other.

- ``mpi``: launched by ``mpiexec``/``srun`` (PMI/PMIx variables present), or a plain
  single process (an MPI singleton). Rank and size come from ``MPI.COMM_WORLD``.
- ``env``: launched by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` set, no MPI launcher). MPI is then absent and says so; small objects
  are exchanged through the same TCP store Gloo uses (provided by the Gloo backend).
- ``MCRDL_BOOTSTRAP=mpi|env`` forces one.

``bcast``/``allgather`` move small picklable objects (ports, NCCL unique ids) during
set-up; they are not a data path. They are collective over the whole world;
``group_bcast``/``group_allgather`` are collective over the members of one group only
(what lazily created per-group communicators need: non-members never call them). Under
MPI they run on a sub-communicator of the bootstrap's private one, made once per rank
set; under torchrun on store keys private to the rank set.

``local_size`` is the number of ranks on this rank's host (NCCL needs a GPU per rank),
``local_rank`` this rank's position among them.

Topology: ``host_of`` names the host of every rank (MPI's processor name, i.e. the host
name; under torchrun the host names gathered through the store), ``hosts`` lists the
distinct hosts in rank order, ``hosts_in(ranks)`` counts the hosts a set of ranks spans
(tuning tables are keyed by ranks and hosts). On an emulated cluster (``mcrdl cluster``)
``cluster_info()`` returns what its environment says (name, link rate, delay).

Liveness: with the host names every rank sends :func:`process_identity` (the kernel's
boot id, the PID namespace and its process id). ``exited(ranks)`` names the ranks whose
process ran on this same kernel and PID namespace (so its pid means the same thing here)
and is gone: what lets a wait notice a dead peer on the same machine at once instead of
at the timeout (``Runtime.peers_gone``). Ranks on other machines cannot be probed so.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import socket
import zlib

from ..base import config as _config
from ..base.errors import BackendUnavailableError, CommTimeoutError, InvalidArgumentError
from . import mpi_setup
from ..engine.progress import engine
from .backend import load_attr

MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                     "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def detect_kind() -> str:
    forced = _config.get("MCRDL_BOOTSTRAP")
    if forced in ("mpi", "env"):
        return forced
    if any(v in os.environ for v in MPI_LAUNCHER_VARS):
        return "mpi"
    if all(v in os.environ for v in TORCHRUN_VARS):
        return "env"
    return "mpi" if importlib.util.find_spec("mpi4py") else "single"


class Bootstrap:
    kind = "single"
    rank = 0
    size = 1
    all_local = True  # every rank on this host (Gloo then uses the loopback device)
    local_size = 1  # ranks on this rank's host
    local_rank = 0  # this rank's position among them (a GPU index: local_rank % devices)
    mpi_reason = "mpi4py is not installed (pip install 'mcr-dl[mpich]')"
    host_of: tuple = ()  # host name of every rank, by rank
    proc_of: tuple = ()  # process_identity() of every rank, by rank

    def _set_hosts(self, entries) -> None:
        """Topology and liveness probes from every rank's (host name, process identity)
        (index: rank)."""
        names = [name for name, _ in entries]
        self.proc_of = tuple(ident for _, ident in entries)
        self.all_local = len(set(names)) == 1  # the real machines (Gloo's device)
        k = _config.get("MCRDL_RANKS_PER_HOST")
        if k is not None:  # emulated hosts: blocks of k consecutive ranks
            if k < 1:
                raise InvalidArgumentError(f"MCRDL_RANKS_PER_HOST={k}: must be at least 1")
            names = [f"{name}#{r // k}" for r, name in enumerate(names)]
        self.host_of = tuple(names)
        self.local_size = names.count(names[self.rank])
        self.local_rank = names[:self.rank].count(names[self.rank])
        self._spans: dict = {}

    @property
    def hosts(self) -> list[str]:
        """The distinct hosts, in the order of their lowest rank."""
        return list(dict.fromkeys(self.host_of or (self.hostname(),)))

    def hosts_in(self, ranks) -> int:
        """How many hosts the global ``ranks`` run on (memoized per rank tuple)."""
        if not self.host_of:
            return 1
        key = tuple(ranks)
        n = self._spans.get(key)
        if n is None:
            n = self._spans[key] = len({self.host_of[r] for r in key})
        return n

    def topology(self) -> str:
        """E.g. "2 hosts x 2 ranks (h0: ranks 0-1; h1: ranks 2-3)"."""
        by_host: dict = {}
        for r, h in enumerate(self.host_of or (self.hostname(),)):
            by_host.setdefault(h, []).append(r)
        counts = {len(v) for v in by_host.values()}
        shape = (f"{len(by_host)} host{'s' if len(by_host) > 1 else ''} x {counts.pop()} "
                 f"rank{'s' if self.size > len(by_host) else ''}" if len(counts) == 1
                 else f"{len(by_host)} hosts, {self.size} ranks")
        return shape + " (" + "; ".join(f"{h}: ranks {_span(v)}" for h, v in by_host.items()) + ")"

    def bcast(self, obj, root: int = 0):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def group_bcast(self, obj, ranks, root: int = 0):
        """``obj`` of global rank ``ranks[root]`` to every rank of ``ranks`` (only those
        call it)."""
        return obj

    def group_allgather(self, obj, ranks) -> list:
        """Every member's ``obj``, in the order of ``ranks`` (only members call it)."""
        return [obj]

    def hostname(self) -> str:
        return socket.gethostname()

    def exited(self, ranks) -> list[int]:
        """The global ``ranks`` (not this one) whose process ran on this machine, in this
        PID namespace, and has ended (or is a zombie); ranks elsewhere count as alive."""
        mine = self.proc_of[self.rank] if self.proc_of else None
        if mine is None:
            return []
        gone = []
        for r in ranks:
            ident = self.proc_of[r]
            if r != self.rank and ident is not None and ident[:2] == mine[:2] \
                    and not _pid_alive(ident[2]):
                gone.append(r)
        return gone


def process_identity():
    """(boot id, PID namespace, pid) of this process, or None where /proc cannot say
    (not Linux): two processes with equal first parts can probe each other's pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return (boot, os.stat("/proc/self/ns/pid").st_ino, os.getpid())
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: its /proc entry exists and it is not a
    zombie or dead (state Z/X, after the last ')' of /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3]
    return state not in (b"Z", b"X", b"x")


class MPIBootstrap(Bootstrap):
    kind = "mpi"
    mpi_reason = None

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self._setup = MPI, mpi_setup
        engine().rank = MPI.COMM_WORLD.Get_rank()  # for the diagnostics of the waits below
        self.comm = mpi_setup.dup(MPI.COMM_WORLD, what="bootstrap")  # private: set-up
        self.rank = self.comm.Get_rank()                             # traffic only
        self.size = self.comm.Get_size()
        self._set_hosts(self.allgather((MPI.Get_processor_name(), process_identity())))
        self._subs: dict = {}  # rank tuple -> sub-communicator of self.comm

    def bcast(self, obj, root: int = 0):
        return self._setup.bcast(self.comm, obj, root)

    def allgather(self, obj) -> list:
        return self._setup.allgather(self.comm, obj)

    def _sub(self, ranks: tuple):
        if ranks == tuple(range(self.size)):
            return self.comm
        sub = self._subs.get(ranks)
        if sub is None:
            grp = self.comm.Get_group().Incl(list(ranks))
            tag = zlib.crc32(repr(ranks).encode()) % 32768  # the same on every member
            self._setup.members_ready(self.comm, ranks, f"bootstrap{list(ranks)}",
                                      kind=2)  # timed, then:
            try:  # collective over the members only (MPI_Comm_create_group)
                sub = self._subs[ranks] = self.comm.Create_group(grp, tag=tag)
            finally:
                grp.Free()
        return sub

    def group_bcast(self, obj, ranks, root: int = 0):
        return self._setup.bcast(self._sub(tuple(ranks)), obj, root)

    def group_allgather(self, obj, ranks) -> list:
        return self._setup.allgather(self._sub(tuple(ranks)), obj)


class EnvBootstrap(Bootstrap):
    """torchrun-style launch. ``store`` offers set(key, bytes) and get(key) -> bytes
    (blocking until present); the Gloo backend supplies one on MASTER_ADDR:MASTER_PORT."""

    kind = "env"
    mpi_reason = ("the job was launched by torchrun (RANK/WORLD_SIZE set, no MPI launcher): "
                  "launch with mpiexec to use the MPI backend")

    def __init__(self, store_factory, rank: int | None = None, size: int | None = None,
                 mpi_reason: str | None = None):
        """``rank``/``size``: what torch was told (``init_process_group(rank=,
        world_size=)``, as under ``mp.spawn``), else RANK/WORLD_SIZE. ``mpi_reason``:
        why MPI is not used, where it is not the torchrun launch (the default)."""
        if mpi_reason is not None:
            self.mpi_reason = mpi_reason
        self.rank = int(os.environ["RANK"]) if rank is None else int(rank)
        self.size = int(os.environ["WORLD_SIZE"]) if size is None else int(size)
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.all_local = self.local_size == self.size
        self.store = store_factory(self)
        self._seq = 0
        self._group_seq: dict = {}
        self._set_hosts(self.allgather((socket.gethostname(), process_identity())))

    def _get(self, key: str):
        """The object another rank put under ``key``, waiting for it at most
        ``MCRDL_TIMEOUT``: the store may be torch's default group's (shared, see
        ``mcrdl_backends.gloo.env_store``), whose own timeout is that group's (30
        minutes by default), and a rank that never starts MCR-DL must not hold the
        others that long in silence."""
        wait = getattr(self.store, "wait", None)
        if wait is not None:
            secs = _config.get("MCRDL_TIMEOUT")
            try:
                wait([key], datetime.timedelta(seconds=secs))
            except RuntimeError as exc:  # torch's DistStoreError: "Wait timeout"
                raise CommTimeoutError(
                    f"mcrdl: rank {self.rank}: the bootstrap waited {secs:g} s (MCRDL_TIMEOUT) "
                    f"for {key!r} from another rank through the launcher's store: {exc}. "
                    "Every rank must start MCR-DL (its first call, or mcrdl_core.init()) "
                    "in the same order; raise MCRDL_TIMEOUT if a rank is just slow") from exc
        return pickle.loads(self.store.get(key))

    def _key(self) -> str:
        self._seq += 1
        return f"mcrdl/bootstrap/{self._seq}"

    def _group_key(self, ranks) -> str:
        ranks = tuple(ranks)
        n = self._group_seq[ranks] = self._group_seq.get(ranks, 0) + 1
        return f"mcrdl/bootstrap/g{'-'.join(map(str, ranks))}/{n}"

    def group_bcast(self, obj, ranks, root: int = 0):
        key = self._group_key(ranks)
        if self.rank == ranks[root]:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return self._get(key)

    def group_allgather(self, obj, ranks) -> list:
        key = self._group_key(ranks)
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [self._get(f"{key}/{r}") for r in ranks]

    def bcast(self, obj, root: int = 0):
        key = self._key()
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return self._get(key)

    def allgather(self, obj) -> list:
        key = self._key()
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [self._get(f"{key}/{r}") for r in range(self.size)]


def _span(ranks: list) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def launched_by_mpi() -> bool:
    """True under an MPI launcher (mpiexec, srun with PMI): MPI bootstraps the job."""
    return detect_kind() == "mpi" and (
        _config.get("MCRDL_BOOTSTRAP") == "mpi"
        or any(v in os.environ for v in MPI_LAUNCHER_VARS))


def store_prefix() -> str:
    """The prefix of every key MCR-DL puts in a torch store: scoped by torchelastic's
    restart count (as torch's agent scopes its own by attempt), so that a restarted
    worker never reads what the dead attempt wrote (hosts, Gloo's addresses)."""
    return f"mcrdl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def cluster_info() -> dict | None:
    """What an emulated cluster's environment says (``mcrdl cluster``), else None:
    {"name", "host", "hosts", "ranks_per_host", "rate", "delay", "machine"}."""
    name = _config.get("MCRDL_CLUSTER")
    if not name:
        return None
    get = lambda k: _config.get(f"MCRDL_CLUSTER_{k.upper()}")  # noqa: E731
    return {"name": name, "host": get("host"), "hosts": (get("hosts") or "").split(","),
            "ranks_per_host": get("ranks_per_host"), "rate": get("rate"),
            "delay": get("delay"), "machine": get("machine")}


def create() -> Bootstrap:
    kind = detect_kind()
    if kind == "mpi":
        if not importlib.util.find_spec("mpi4py"):
            raise BackendUnavailableError(
                "launched under an MPI launcher but mpi4py is not installed: "
                "pip install 'mcr-dl[mpich]'")
        return MPIBootstrap()
    if kind == "env":
        return EnvBootstrap(load_attr("mcrdl_backends.gloo:env_store"))
    return Bootstrap()
