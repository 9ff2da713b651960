"""What an emulated cluster looks like: hosts, ranks per host, link rate and delay,
names and addresses. Pure data: nothing here touches the system.

Addresses come from 198.18.0.0/15, the block set aside for network benchmarks
(RFC 2544): host ``h<i>`` is 198.18.0.0 + i + 1, the switch (where the launcher
runs) is the block's last usable address. They exist only inside the namespaces the
cluster creates.
"""
from __future__ import annotations

import ipaddress
import os
import re
import secrets
from dataclasses import dataclass, field

from .errors import ClusterSpecError

NETWORK = ipaddress.ip_network("198.18.0.0/15")
SWITCH_NAME = "switch"  # host name of the switch namespace (mpiexec runs there)
HOST_IFACE = "eth0"  # each host's interface, the same name in every host namespace
MAX_HOSTS = 1000
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str | None) -> int | None:
    """A link rate in tc's units ("1gbit", "10gbit", "500mbit", "1gbps" = bytes/s) ->
    bits per second; None, "", "none" or "0" -> None (an unshaped link)."""
    if text is None or str(text).strip().lower() in ("", "none", "0", "unlimited"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS:
        raise ClusterSpecError(f"rate {text!r}: use a number and a unit of tc, e.g. 1gbit, "
                               f"10gbit, 500mbit (units: {', '.join(_UNITS)})")
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if bits < 8000:
        raise ClusterSpecError(f"rate {text!r} is below 8 kbit/s; give a real link rate")
    return bits


def parse_delay(text: str | None) -> float | None:
    """A one-way delay per link ("50us", "1ms", "0.2ms") -> seconds; None/"0" -> None."""
    if text is None or str(text).strip().lower() in ("", "none", "0"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|ns)\s*", str(text).lower())
    if not m:
        raise ClusterSpecError(f"delay {text!r}: use a number and a unit, e.g. 50us, 1ms")
    return float(m.group(1)) * _TIME[m.group(2)]


def format_rate(bits: int | None) -> str:
    if bits is None:
        return "unshaped"
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= mult and bits % mult == 0:
            return f"{bits // mult}{unit}"
    return f"{bits}bit"


def format_delay(seconds: float | None) -> str:
    if not seconds:
        return "none"
    return f"{seconds * 1e6:g}us"


def new_name() -> str:
    """A cluster name that no other cluster on this machine has: a prefix, this
    process's id and a random part (short enough for interface and namespace names)."""
    return f"mcrdl{os.getpid() % 100000}{secrets.token_hex(2)}"


@dataclass
class ClusterSpec:
    """``hosts`` emulated hosts with ``ranks_per_host`` ranks each, every host's link
    shaped to ``rate_bits`` bits/s (None: unshaped) with ``delay_s`` seconds of one-way
    delay per link direction (None: none)."""

    hosts: int = 2
    ranks_per_host: int = 1
    rate_bits: int | None = 10**10
    delay_s: float | None = None
    name: str = field(default_factory=new_name)

    def __post_init__(self):
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise ClusterSpecError(f"hosts={self.hosts!r}: give 1 to {MAX_HOSTS} hosts")
        if not isinstance(self.ranks_per_host, int) or self.ranks_per_host < 1:
            raise ClusterSpecError(f"ranks_per_host={self.ranks_per_host!r}: give 1 or more")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", self.name):
            raise ClusterSpecError(f"cluster name {self.name!r}: use 1-16 lower-case letters "
                                   "and digits, starting with a letter")

    # --- names and addresses --------------------------------------------------------------
    @property
    def host_names(self) -> list[str]:
        return [f"h{i}" for i in range(self.hosts)]

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def netns(self, host: str) -> str:
        """The network namespace of ``host`` (a host name or SWITCH_NAME)."""
        return f"{self.name}-{host}"

    def address(self, host: str) -> str:
        if host == SWITCH_NAME:
            return str(NETWORK[-2])
        return str(NETWORK[self.host_index(host) + 1])

    def host_index(self, host: str) -> int:
        if host not in self.host_names:
            raise ClusterSpecError(f"no host {host!r} in cluster {self.name}: its hosts are "
                                   f"{', '.join(self.host_names)}")
        return int(host[1:])

    def hosts_file(self) -> str:
        """/etc/hosts as every process of the cluster sees it."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{self.address(SWITCH_NAME)}\t{SWITCH_NAME}"]
        lines += [f"{self.address(h)}\t{h}" for h in self.host_names]
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        return (f"cluster {self.name}: {self.hosts} hosts x {self.ranks_per_host} ranks, links "
                f"{format_rate(self.rate_bits)}, delay {format_delay(self.delay_s)}")

    def to_dict(self) -> dict:
        return {"name": self.name, "hosts": self.hosts, "ranks_per_host": self.ranks_per_host,
                "rate_bits": self.rate_bits, "delay_s": self.delay_s}

    @classmethod
    def from_dict(cls, d: dict) -> "ClusterSpec":
        return cls(hosts=d["hosts"], ranks_per_host=d["ranks_per_host"],
                   rate_bits=d["rate_bits"], delay_s=d["delay_s"], name=d["name"])
