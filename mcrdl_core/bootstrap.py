"""How the processes find each other.

- ``mpi``: launched by ``mpiexec``/``srun`` (PMI/PMIx variables present), or a plain
  single process (an MPI singleton). Rank and size come from ``MPI.COMM_WORLD``.
- ``env``: launched by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` set, no MPI launcher). MPI is then absent and says so; small objects
  are exchanged through the same TCP store Gloo uses (provided by the Gloo backend).
- ``MCRDL_BOOTSTRAP=mpi|env`` forces one.

``bcast``/``allgather`` move small picklable objects (ports, NCCL unique ids) during
set-up; they are not a data path.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import socket

from .errors import BackendUnavailableError, InvalidArgumentError

MPI_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                     "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def detect_kind() -> str:
    forced = os.environ.get("MCRDL_BOOTSTRAP", "auto").lower()
    if forced in ("mpi", "env"):
        return forced
    if forced != "auto":
        raise InvalidArgumentError(f"MCRDL_BOOTSTRAP={forced!r}; use 'mpi', 'env' or 'auto'")
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
    mpi_reason = "mpi4py is not installed (pip install 'mcr-dl[mpich]')"

    def bcast(self, obj, root: int = 0):
        return obj

    def allgather(self, obj) -> list:
        return [obj]

    def hostname(self) -> str:
        return socket.gethostname()


class MPIBootstrap(Bootstrap):
    kind = "mpi"
    mpi_reason = None

    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()  # private: set-up traffic never meets user tags
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        names = self.comm.allgather(MPI.Get_processor_name())
        self.all_local = len(set(names)) == 1

    def bcast(self, obj, root: int = 0):
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj) -> list:
        return self.comm.allgather(obj)


class EnvBootstrap(Bootstrap):
    """torchrun-style launch. ``store`` offers set(key, bytes) and get(key) -> bytes
    (blocking until present); the Gloo backend supplies one on MASTER_ADDR:MASTER_PORT."""

    kind = "env"
    mpi_reason = ("the job was launched by torchrun (RANK/WORLD_SIZE set, no MPI launcher): "
                  "launch with mpiexec to use the MPI backend")

    def __init__(self, store_factory):
        self.rank = int(os.environ["RANK"])
        self.size = int(os.environ["WORLD_SIZE"])
        self.all_local = int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == self.size
        self.store = store_factory(self)
        self._seq = 0

    def _key(self) -> str:
        self._seq += 1
        return f"mcrdl/bootstrap/{self._seq}"

    def bcast(self, obj, root: int = 0):
        key = self._key()
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def allgather(self, obj) -> list:
        key = self._key()
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.size)]


def create() -> Bootstrap:
    kind = detect_kind()
    if kind == "mpi":
        if not importlib.util.find_spec("mpi4py"):
            raise BackendUnavailableError(
                "launched under an MPI launcher but mpi4py is not installed: "
                "pip install 'mcr-dl[mpich]'")
        return MPIBootstrap()
    if kind == "env":
        from .backend import load_attr

        return EnvBootstrap(load_attr("mcrdl_backends.gloo:env_store"))
    return Bootstrap()
