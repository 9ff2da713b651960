"""The link model the planner predicts times with.

Every host has one full-duplex link to a non-blocking switch: ``bandwidth`` bytes/s
each way, ``latency`` seconds per message; ranks of one host move data between them at
``intra_bandwidth`` bytes/s; all links together carry at most ``aggregate_bandwidth``
(0: no limit). ``bench/resharding.py`` calibrates them (one 64 MiB send; two concurrent
sends from one host, which share its link; two disjoint pairs, which do not; every
host sending to the next at once, for the aggregate; one send inside a host) and saves
them as JSON for ``LinkModel.load``.

Bytes on the links, per method, for one transfer of ``n`` bytes from a sender on host
``s`` to receivers on ``m`` other hosts (and possibly on ``s``):

- ``broadcast``: a chain that enters every receiving host once: ``s`` sends ``n``, every
  receiving host takes in ``n`` and all but the last pass ``n`` on;
- ``send_recv``: ``s`` sends ``n`` to every remote receiver;
- ``send_recv_allgather``: ``s`` sends ``n`` to every remote host (in pieces, one per
  receiver there), which then all-gather inside the host.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..base import config as _config
from ..base.errors import InvalidArgumentError

METHODS = ("broadcast", "send_recv", "send_recv_allgather")


def chain_segment(n: int) -> int:
    """Default bytes per segment of the chain broadcast of ``n`` bytes: n/8 clamped to
    [64 KiB, 1 MiB] (64 MiB to 4 hosts at 1 Gbit/s, one run each: 16 MiB segments
    1.29 s, 4 MiB 1.19 s, 1 MiB 0.82 s, 512 KiB 0.78 s, 256 KiB 1.22 s)."""
    return min(1 << 20, max(64 << 10, n // 8))


@dataclass(frozen=True)
class LinkModel:
    """``bandwidth``, ``intra_bandwidth`` and ``aggregate_bandwidth`` in bytes/s,
    ``latency`` in seconds. ``aggregate_bandwidth``: what all links together carry at
    most (a switch's backplane; on the emulated cluster, the one machine's CPUs); 0 means
    no such limit (a non-blocking switch)."""

    bandwidth: float = 125e6  # 1 Gbit/s
    latency: float = 100e-6
    intra_bandwidth: float = 4e9
    aggregate_bandwidth: float = 0.0

    def __post_init__(self):
        for name in ("bandwidth", "intra_bandwidth"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"LinkModel: {name} must be > 0 bytes/s, got "
                                           f"{getattr(self, name)!r}")
        if not self.latency >= 0:
            raise InvalidArgumentError(f"LinkModel: latency must be >= 0 s, got {self.latency!r}")
        if not self.aggregate_bandwidth >= 0:
            raise InvalidArgumentError("LinkModel: aggregate_bandwidth must be >= 0 bytes/s "
                                       f"(0: no limit), got {self.aggregate_bandwidth!r}")

    @classmethod
    def load(cls, path: str) -> "LinkModel":
        with open(path) as f:
            d = json.load(f)
        keys = ("bandwidth", "latency", "intra_bandwidth", "aggregate_bandwidth")
        return cls(**{k: float(d[k]) for k in keys if k in d})

    @classmethod
    def from_env(cls) -> "LinkModel":
        """``MCRDL_RESHARD_LINK`` (a JSON file written by bench/resharding.py) or defaults."""
        path = _config.get("MCRDL_RESHARD_LINK")
        return cls.load(path) if path else cls()

    def to_dict(self) -> dict:
        return asdict(self)

    def link_bytes(self, method: str, n: int, s: int, remote: list) -> tuple[list, list]:
        """([(host, bytes out)], [(host, bytes in)]) on the links; ``remote``: the
        receiving hosts other than ``s``, in chain order."""
        if not remote or n == 0:
            return [], []
        m = len(remote)
        if method == "broadcast":
            return [(s, n)] + [(h, n) for h in remote[:-1]], [(h, n) for h in remote]
        if method == "send_recv_allgather":
            return [(s, n * m)], [(h, n) for h in remote]
        raise AssertionError(method)  # send_recv counts receivers: see planner

    def time(self, method: str, n: int, per_host: dict, s: int) -> float:
        """Seconds for one transfer of ``n`` bytes; ``per_host``: {host: receivers there}."""
        remote = [h for h in per_host if h != s]
        local = per_host.get(s, 0)
        m = len(remote)
        bw, ib, lat = self.bandwidth, self.intra_bandwidth, self.latency
        crowded = local > 0 or any(per_host[h] > 1 for h in remote)
        if method == "broadcast":
            if not m:  # inside one host: the backend's broadcast
                return lat + n / ib
            # a chain through every receiver; segments pipelined, so the hops after the
            # first add one segment each (at the link's rate between hosts, else intra)
            seg = min(n, chain_segment(n))
            hops = sum(per_host.values())
            return (lat * (hops + 1) + n / bw + (m - 1) * seg / bw
                    + ((hops - m) * seg / ib if crowded else 0.0))
        if method == "send_recv":
            r_remote = sum(per_host[h] for h in remote)
            return lat * (r_remote + local) + n * r_remote / bw + n * local / ib
        k_max = max(per_host.values())
        gather = n * (k_max - 1) / k_max / ib
        return lat * (m + 2) + n * m / bw + (n / ib if local else 0.0) + gather
