"""``python -m mcrdl_torch.run script.py args...``: run a torch program with the
"mcrdl" backend registered, for environments that disable torch's backend autoloading
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) or installs without the entry point.

Under ``mpiexec`` it also sets what torch's ``env://`` rendezvous reads (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) from MPI, so the script's ``init_process_group`` needs no arguments.
Under ``torchrun`` those are already set and left alone.
"""
from __future__ import annotations

import os
import runpy
import socket
import sys

from mcrdl_core.base.errors import InvalidArgumentError


def mpi_env() -> dict:
    """Fill torch's rendezvous variables from MPI (collective over MPI's world: every
    rank calls it); variables already set are kept. Rank 0 picks a free TCP port for
    torch's store. Returns what was set."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    host = socket.gethostname()
    hosts = comm.allgather(host)
    addr = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        addr = ("127.0.0.1" if len(set(hosts)) == 1 else host, port)
    addr, port = comm.bcast(addr, root=0)
    local = [i for i, h in enumerate(hosts) if h == host]
    values = {"RANK": comm.rank, "WORLD_SIZE": comm.size, "LOCAL_RANK": local.index(comm.rank),
              "LOCAL_WORLD_SIZE": len(local), "MASTER_ADDR": addr, "MASTER_PORT": port}
    set_now = {}
    for k, v in values.items():
        if k not in os.environ:
            os.environ[k] = set_now[k] = str(v)
    return set_now


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    import mcrdl_autoload

    mcrdl_autoload.register()
    from mcrdl_autoload import MPI_VARS

    if "RANK" not in os.environ and any(v in os.environ for v in MPI_VARS):
        mpi_env()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise InvalidArgumentError("mcrdl_torch.run -m: name the module to run")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.exists(script):
        raise InvalidArgumentError(f"mcrdl_torch.run: no such script {script!r}; usage: "
                                   "python -m mcrdl_torch.run script.py args...")
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
