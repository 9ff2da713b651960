"""Build, enter, measure and remove one emulated cluster.

Layout: a switch namespace ``<name>-switch`` holding a bridge ``br0`` (address: the
block's last usable one; ``mpiexec`` runs there, host name ``switch``), and one
namespace ``<name>-h<i>`` per host with interface ``eth0`` (address 198.18.0.<i+1>/15),
joined to the bridge by a veth pair whose switch end is called ``h<i>``. Both ends of
every pair are shaped (tbf at the rate, netem under it for a delay), so each direction
of each host's link is limited. Each host has a persistent UTS namespace (its host
name) bound on a file under the cluster's state folder, and ``/etc/netns/<ns>/`` holds
its ``hosts`` and ``hostname`` (``ip netns exec`` mounts them over /etc).

Everything a cluster creates is listed in its state file
(``/run/mcrdl/cluster/<name>/state.json``) so ``mcrdl cluster down`` can remove a
cluster made by another process; ``teardown`` removes exactly that, never a namespace
of another name.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

from ..base import config as _config
from . import system as _sys
from .errors import ClusterError, ClusterSpecError
from .spec import HOST_IFACE, NETWORK, SWITCH_NAME, ClusterSpec
from .launch import program_env

log = logging.getLogger("mcrdl.cluster")

STATE_ROOT = _config.get("MCRDL_CLUSTER_STATE")
BRIDGE = "br0"


class Cluster:
    """One emulated cluster. ``Cluster(spec).build()`` creates it; ``teardown()``
    removes it (idempotent); as a context manager it does both, also on errors and on
    SIGINT/SIGTERM/SIGHUP (atexit as a last resort)."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.state_dir = os.path.join(STATE_ROOT, spec.name)
        self.machine = _config.get("MCRDL_CLUSTER_MACHINE") or socket.gethostname()
        self._built = False
        self._old_handlers: dict = {}

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        return [self.spec.netns(h) for h in self.spec.host_names] + [self.spec.netns(SWITCH_NAME)]

    def uts_path(self, host: str) -> str:
        return os.path.join(self.state_dir, "uts", host)

    @property
    def launcher(self) -> str:
        return os.path.join(self.state_dir, "ssh")

    def build(self) -> "Cluster":
        """Create every namespace, link and file of the cluster; on any failure remove
        what was made and raise."""
        _sys.require_allowed()
        clash = set(self.namespaces) & _sys.netns_list()
        if clash or os.path.exists(self.state_dir):
            raise ClusterSpecError(f"a cluster named {self.spec.name} exists already "
                                   f"({sorted(clash) or self.state_dir}): pick another --name "
                                   f"or remove it (mcrdl cluster down --name {self.spec.name})")
        atexit.register(self.teardown)
        self._built = True
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        log.info("built %s", self.spec.describe())
        return self

    def _build(self):
        s = self.spec
        os.makedirs(os.path.join(self.state_dir, "uts"))
        self._save_state()  # first: `down` can remove a half-built cluster
        prefix = NETWORK.prefixlen
        sw = s.netns(SWITCH_NAME)
        for host in [SWITCH_NAME] + s.host_names:
            ns = s.netns(host)
            _sys.netns_add(ns)
            _sys.write_etc(ns, {"hosts": s.hosts_file(), "hostname": host + "\n"})
            _sys.uts_create(self.uts_path(host), host)
        _sys.bridge_add(sw, BRIDGE, s.address(SWITCH_NAME), prefix)
        for host in s.host_names:
            ns = s.netns(host)
            _sys.veth_add(sw, host, BRIDGE, ns, HOST_IFACE, s.address(host), prefix)
            _sys.shape(ns, HOST_IFACE, s.rate_bits, s.delay_s)  # host -> switch
            _sys.shape(sw, host, s.rate_bits, s.delay_s)  # switch -> host
        self._write_launcher()

    def _save_state(self):
        state = {"spec": self.spec.to_dict(), "machine": self.machine, "pid": os.getpid(),
                 "namespaces": self.namespaces, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = os.path.join(self.state_dir, "state.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, os.path.join(self.state_dir, "state.json"))

    def _write_launcher(self):
        """The program hydra's mpiexec calls instead of ssh: ``ssh [-x] HOST CMD...``
        becomes CMD run by /bin/sh inside HOST (what sshd would do)."""
        s = self.spec
        text = f"""#!/bin/sh
# mcrdl cluster {s.name}: stands in for ssh for hydra's mpiexec (-launcher ssh
# -launcher-exec THIS). Called as: THIS [-x] HOST COMMAND...
[ "$1" = "-x" ] && shift
host="$1"; shift
if [ ! -e "{self.state_dir}/uts/$host" ] || [ "$host" = "{SWITCH_NAME}" ]; then
    echo "mcrdl cluster {s.name}: no host '$host' (hosts: {' '.join(s.host_names)})" >&2
    exit 255
fi
export MCRDL_CLUSTER_HOST="$host"
exec ip netns exec "{s.name}-$host" nsenter --uts="{self.state_dir}/uts/$host" -- /bin/sh -c "$*"
"""
        with open(self.launcher, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(self.launcher, 0o755)

    def keep(self) -> None:
        """Leave the cluster up when this process exits (``mcrdl cluster up``)."""
        atexit.unregister(self.teardown)

    def teardown(self) -> None:
        """Remove everything this cluster made: its processes, namespaces (and with
        them links and shaping), UTS bindings, /etc/netns entries and state folder."""
        if not self._built:
            return
        self._built = False
        atexit.unregister(self.teardown)
        self.kill_processes()
        for ns in self.namespaces:
            _sys.netns_delete(ns)
        for host in [SWITCH_NAME] + self.spec.host_names:
            _sys.uts_remove(self.uts_path(host))
            _sys.remove_etc(self.spec.netns(host))
        shutil.rmtree(self.state_dir, ignore_errors=True)
        left = set(self.namespaces) & _sys.netns_list()
        if left:
            log.warning("mcrdl cluster %s: namespaces %s could not be removed; try "
                        "`ip netns delete NAME` by hand", self.spec.name, sorted(left))
        log.info("removed cluster %s", self.spec.name)

    def kill_processes(self, grace_s: float = 3.0) -> list[int]:
        """End the processes still inside this cluster's namespaces (SIGTERM, then
        SIGKILL after ``grace_s`` seconds); returns their ids."""
        pids = sorted({p for ns in self.namespaces for p in _sys.netns_pids(ns)} - {os.getpid()})
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in pids if _alive(p)]
            if not alive:
                break
            log.warning("mcrdl cluster %s: ending %d leftover process(es) %s with %s",
                        self.spec.name, len(alive), alive, sig.name)
            for p in alive:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_alive(p) for p in alive):
                time.sleep(0.05)
        return pids

    def __enter__(self) -> "Cluster":
        if threading.current_thread() is threading.main_thread():  # only it may set them
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            return self.build()
        except BaseException:
            self._restore_handlers()
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.teardown()
        finally:
            self._restore_handlers()

    def _restore_handlers(self):
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        self._old_handlers.clear()

    @classmethod
    def attach(cls, name: str | None = None) -> "Cluster":
        """A cluster made earlier (``mcrdl cluster up``), by name; without a name the only
        one there is."""
        if name is None:
            names = existing()
            if len(names) != 1:
                raise ClusterSpecError(
                    "no cluster is up (start one with `mcrdl cluster up`)" if not names else
                    f"{len(names)} clusters are up ({', '.join(names)}): say which with --name")
            name = names[0]
        path = os.path.join(STATE_ROOT, name, "state.json")
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except OSError:
            raise ClusterSpecError(f"no cluster named {name!r} is up (no {path}); clusters up: "
                                   f"{', '.join(existing()) or 'none'}") from None
        c = cls(ClusterSpec.from_dict(state["spec"]))
        c.machine = state.get("machine", c.machine)
        c._built = True
        return c

    # --- using it -------------------------------------------------------------------------
    def env(self, host: str | None = None) -> dict[str, str]:
        """What a program in the cluster finds in its environment: where it runs and how
        the libraries must talk between hosts (see launch.program_env)."""
        return program_env(self, host)

    def host_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host`` (a host name or "switch")."""
        if host != SWITCH_NAME:
            self.spec.host_index(host)
        return _sys.enter_argv(self.spec.netns(host), self.uts_path(host)) + list(argv)

    def exec(self, host: str, argv: list[str], **popen) -> int:
        """Run ``argv`` in ``host`` with the cluster's environment; its exit status."""
        env = dict(os.environ, **self.env(host))
        return subprocess.call(self.host_argv(host, argv), env=env, **popen)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host put on and took off its link, read on the
        switch's end of the pair: {host: {"sent_bytes", "received_bytes", ...}}."""
        raw = _sys.link_counters(self.spec.netns(SWITCH_NAME))
        return {h: {"sent_bytes": raw[h]["rx_bytes"], "received_bytes": raw[h]["tx_bytes"],
                    "sent_packets": raw[h]["rx_packets"],
                    "received_packets": raw[h]["tx_packets"]}
                for h in self.spec.host_names if h in raw}

    def summary(self) -> str:
        s = self.spec
        return (f"{s.describe()}; machine {self.machine}; hosts "
                + ", ".join(f"{h}={s.address(h)}" for h in s.host_names))


def existing() -> list[str]:
    """Names of the clusters whose state is on this machine."""
    try:
        return sorted(d for d in os.listdir(STATE_ROOT)
                      if os.path.exists(os.path.join(STATE_ROOT, d, "state.json")))
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
