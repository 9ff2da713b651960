"""The system side of the emulated cluster: running ``ip``, ``tc``, ``unshare``,
``nsenter`` and reading interface counters. Every command either succeeds or raises
ClusterError naming the command, its output and what to do.

Nothing here touches a namespace whose name the caller did not make (the names come
from ClusterSpec, unique per cluster).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

from .errors import ClusterError, ClusterPermissionError

log = logging.getLogger("mcrdl.cluster")

TOOLS = ("ip", "tc", "unshare", "nsenter", "mount", "umount")
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
NETNS_ETC = "/etc/netns"  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run one command; on failure raise ClusterError with its stderr (``check``)."""
    log.debug("+ %s", " ".join(argv))
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(argv)}` did not finish in {timeout:.0f} s; is the "
                           "machine overloaded?") from None
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def _effective_caps() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def why_not_allowed() -> str | None:
    """None if this process can build a cluster here, else the reason and what to do."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "an emulated cluster needs Linux network namespaces"
    caps = _effective_caps()
    missing = [n for n, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if not caps >> bit & 1]
    if missing:
        return (f"creating network namespaces needs root (or {' and '.join(missing)}); this "
                f"process runs as uid {os.geteuid()} without them: run the command with sudo "
                "(e.g. sudo -E .venv/bin/mcrdl cluster ...)")
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return (f"{', '.join(absent)} not found on PATH: install iproute2 (ip, tc) and "
                "util-linux (unshare, nsenter, mount)")
    return None


def require_allowed() -> None:
    reason = why_not_allowed()
    if reason:
        raise ClusterPermissionError(reason)


# --- namespaces ---------------------------------------------------------------------------
def netns_list() -> set[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def netns_add(ns: str) -> None:
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")


def netns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def netns_delete(ns: str) -> None:
    sh("ip", "netns", "delete", ns, check=False)


def write_etc(ns: str, files: dict[str, str]) -> str:
    """/etc/netns/<ns>/<name> for each file: what processes entered with
    `ip netns exec` see as /etc/<name> (hosts, hostname)."""
    d = os.path.join(NETNS_ETC, ns)
    os.makedirs(d, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            f.write(text)
    return d


def remove_etc(ns: str) -> None:
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


# --- UTS namespaces (host names) ----------------------------------------------------------
def uts_create(path: str, hostname: str) -> None:
    """A persistent UTS namespace bound on ``path`` whose host name is ``hostname``."""
    open(path, "a").close()
    sh("unshare", f"--uts={path}", "hostname", hostname)


def uts_remove(path: str) -> None:
    if os.path.exists(path):
        sh("umount", path, check=False)
        try:
            os.unlink(path)
        except OSError:
            pass


def enter_argv(ns: str, uts_path: str) -> list[str]:
    """The argv prefix that runs a command inside a host: its network namespace (with
    its /etc/hosts and /etc/hostname) and its UTS namespace (its host name)."""
    return ["ip", "netns", "exec", ns, "nsenter", f"--uts={uts_path}", "--"]


# --- links --------------------------------------------------------------------------------
def bridge_add(ns: str, bridge: str, address: str, prefix: int) -> None:
    sh("ip", "-n", ns, "link", "add", bridge, "type", "bridge")
    sh("ip", "-n", ns, "addr", "add", f"{address}/{prefix}", "dev", bridge)
    sh("ip", "-n", ns, "link", "set", bridge, "up")


def veth_add(switch_ns: str, port: str, bridge: str, host_ns: str, iface: str,
             address: str, prefix: int) -> None:
    """A veth pair: ``port`` on the switch's bridge, ``iface`` in the host."""
    sh("ip", "-n", switch_ns, "link", "add", port, "type", "veth", "peer", "name", iface,
       "netns", host_ns)
    sh("ip", "-n", switch_ns, "link", "set", port, "master", bridge, "up")
    sh("ip", "-n", host_ns, "addr", "add", f"{address}/{prefix}", "dev", iface)
    sh("ip", "-n", host_ns, "link", "set", iface, "up")


def shape(ns: str, dev: str, rate_bits: int | None, delay_s: float | None) -> None:
    """Shape what ``dev`` sends: a token bucket at ``rate_bits`` bits/s (tbf), under a
    netem delay of ``delay_s`` seconds when asked. Burst: 1 ms of the rate, at least
    128 KiB (veths hand over segmentation-offload packets of up to 64 KiB); queue: 20 ms."""
    parent = ["root"]
    if delay_s:
        r = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
               "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000", check=False)
        if r.returncode != 0:
            why = r.stderr.strip().rstrip(".")
            raise ClusterError(f"cannot add a delay on {dev}: {why}. This kernel "
                               "has no netem queueing discipline (module sch_netem); load it "
                               "(modprobe sch_netem) or leave out --delay")
        parent = ["parent", "1:1", "handle", "10:"]
    if rate_bits:
        burst = max(128 << 10, rate_bits // 8 // 1000)
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate",
           f"{rate_bits}bit", "burst", str(burst), "latency", "20ms")


def link_counters(ns: str) -> dict[str, dict[str, int]]:
    """{interface: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}} in ``ns``."""
    out = sh("ip", "-n", ns, "-j", "-s", "link", "show").stdout
    counters = {}
    for link in json.loads(out or "[]"):
        st = link.get("stats64") or link.get("stats") or {}
        counters[link["ifname"]] = {"rx_bytes": st.get("rx", {}).get("bytes", 0),
                                    "tx_bytes": st.get("tx", {}).get("bytes", 0),
                                    "rx_packets": st.get("rx", {}).get("packets", 0),
                                    "tx_packets": st.get("tx", {}).get("packets", 0)}
    return counters
