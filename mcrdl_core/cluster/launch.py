"""Running a program on an emulated cluster: one process per rank, block-placed on the
hosts by the venv's hydra ``mpiexec`` (run in the switch namespace, with the cluster's
launcher script standing in for ssh), exactly as ``mpiexec -n N program`` would on one
host.

What the program's environment says (``program_env``):

- where it runs: ``MCRDL_CLUSTER`` (the cluster's name), ``MCRDL_CLUSTER_HOST`` (this
  host; set per host by the launcher), ``MCRDL_CLUSTER_HOSTS`` (all, comma-separated),
  ``MCRDL_CLUSTER_RANKS_PER_HOST``, ``MCRDL_CLUSTER_RATE`` (e.g. ``1gbit``),
  ``MCRDL_CLUSTER_DELAY`` and ``MCRDL_CLUSTER_MACHINE`` (the real machine, which
  tuning tables record as where they were measured);
- how the libraries must talk: all namespaces share one kernel and one /dev/shm.
  MPICH groups ranks into nodes by host name, and the hosts' names differ, so ranks of
  one host keep MPICH's shared memory and ranks of different hosts use the network
  module. That module is ofi over TCP (``MPIR_CVAR_CH4_NETMOD=ofi``, ``FI_PROVIDER=tcp``,
  ``FI_TCP_IFACE=eth0``): the wheel's default, ucx, finds processes of one machine by
  its boot id and moves their bytes through shared memory unless ``UCX_TLS=tcp,self``
  (also set, for whoever forces ucx), and with that setting its any-source receives
  hung here (MPICH 5.0.2: a message from another host never matched an
  ``MPI_ANY_SOURCE`` receive), which ofi does not.
  ``GLOO_SOCKET_IFNAME=eth0`` binds Gloo to the host's interface.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from .errors import ClusterError
from .spec import HOST_IFACE, SWITCH_NAME, format_delay, format_rate

log = logging.getLogger("mcrdl.cluster")

#: forced in every program's environment (see the module's docstring)
TRANSPORT_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": HOST_IFACE,
                 "UCX_TLS": "tcp,self", "GLOO_SOCKET_IFNAME": HOST_IFACE}


def program_env(cluster, host: str | None = None) -> dict[str, str]:
    """The variables a program in ``cluster`` gets (``host``: the host it runs on, if
    known here; under mpiexec the launcher sets it per host)."""
    s = cluster.spec
    env = {"MCRDL_CLUSTER": s.name, "MCRDL_CLUSTER_HOSTS": ",".join(s.host_names),
           "MCRDL_CLUSTER_RANKS_PER_HOST": str(s.ranks_per_host),
           "MCRDL_CLUSTER_RATE": format_rate(s.rate_bits),
           "MCRDL_CLUSTER_DELAY": format_delay(s.delay_s),
           "MCRDL_CLUSTER_MACHINE": cluster.machine}
    for k, v in TRANSPORT_ENV.items():
        if os.environ.get(k, v) != v:
            log.warning("mcrdl cluster: %s=%s replaced by %s=%s (bytes between emulated "
                        "hosts must cross their links)", k, os.environ[k], k, v)
        env[k] = v
    if host is not None:
        env["MCRDL_CLUSTER_HOST"] = host
    return env


def find_mpiexec() -> str:
    """The hydra mpiexec of this interpreter's environment (the venv's, from the mpich
    wheel), else the first on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise ClusterError("no mpiexec found next to this Python or on PATH: install the "
                           "mpich extra (pip install 'mcr-dl[mpich]')")
    return found


def mpiexec_argv(cluster, program: list[str], ranks_per_host: int | None = None,
                 mpiexec: str | None = None) -> list[str]:
    """hydra's command line that places ``ranks_per_host`` ranks on each host, blocks of
    consecutive ranks per host (h0 gets ranks 0..k-1)."""
    s = cluster.spec
    k = ranks_per_host or s.ranks_per_host
    return [mpiexec or find_mpiexec(), "-launcher", "ssh", "-launcher-exec", cluster.launcher,
            "-hosts", ",".join(s.host_names), "-ppn", str(k), "-n", str(k * s.hosts),
            *program]


def run_program(cluster, program: list[str], ranks_per_host: int | None = None,
                timeout_s: float | None = None) -> int:
    """Run ``program`` once per rank on ``cluster`` and return mpiexec's exit status.
    Ctrl-C (or SIGTERM to this process) is passed on to mpiexec, which ends the ranks
    (``Cluster.teardown`` ends whatever is left in the namespaces). A program
    still running after ``timeout_s`` seconds is interrupted the same way (status 124)."""
    if not program:
        raise ClusterError("no program to run: put it after `--`, e.g. "
                           "mcrdl cluster run --hosts 2 -- python train.py")
    env = dict(os.environ)
    env.pop("MCRDL_CLUSTER_HOST", None)  # hydra copies mpiexec's environment to the ranks
    env.update(program_env(cluster))
    # the ranks run this environment's `python`: its folder goes first on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    argv = cluster.host_argv(SWITCH_NAME, mpiexec_argv(cluster, program, ranks_per_host))
    log.info("running %s", " ".join(argv))
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.error("mcrdl cluster: the program ran past %.0f s; interrupting it", timeout_s)
        _stop(proc)
        return 124
    except BaseException:  # Ctrl-C, SIGTERM (raised as SystemExit by Cluster's handler)
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGINT to mpiexec (it forwards it to the ranks), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
