"""The plan of a resharding: data you can print, serialize and compare across ranks.

A :class:`Plan` lists the transfers (who sends which box to whom, in which round, how
many bytes), the local copies (receivers that already hold a box copy it themselves),
the bytes each host moves over its link, the predicted time and the lower bound.
``to_json``/``from_json`` round-trip it; ``fingerprint()`` is a SHA-256 of its
canonical JSON, which every rank compares before executing.

JSON format (``"format": "mcrdl.reshard.plan"``, ``"version": 1``)::

    global_shape, dtype, itemsize        the tensor
    src, dst                             layouts: {"mesh": {"ranks", "axis_names"},
                                                    "spec", "chunking"}
    hosts                                [[rank, host label], ...] of the ranks involved
    method, balance, order               how it was planned
    link                                 {"bandwidth" B/s, "latency" s, "intra_bandwidth" B/s}
    transfers                            [{"id", "round", "box": [[lo, hi], ...],
                                           "sender", "receivers": [...], "nbytes"}, ...]
                                         sorted by (round, id)
    local                                [[rank, box], ...]
    host_bytes                           {label: [bytes out, bytes in]} on the links
    rounds, predicted_s, lower_bound_s   seconds; predicted_s for the executor's default
                                         (overlap), the lower bound: the busiest link
    predicted_waited_s                   seconds, rounds one after the other (overlap=False)
"""
from __future__ import annotations

import hashlib
import json

from .layout import Layout
from .linkmodel import LinkModel
from ..base.errors import InvalidArgumentError

FORMAT, VERSION = "mcrdl.reshard.plan", 1


class Transfer:
    """One box sent by one sender to a set of receivers. ``box`` is in global
    coordinates, ``((lo, hi), ...)`` per dimension; ``nbytes`` in bytes."""

    __slots__ = ("id", "box", "sender", "receivers", "nbytes", "round", "candidates")

    def __init__(self, id: int, box: tuple, sender: int, receivers: tuple, nbytes: int,
                 round: int = 0, candidates: tuple = ()):
        self.id = id
        self.box = box
        self.sender = sender
        self.receivers = receivers
        self.nbytes = nbytes
        self.round = round
        self.candidates = candidates

    def ranks(self) -> tuple:
        return (self.sender,) + self.receivers

    def to_dict(self) -> dict:
        return {"id": self.id, "round": self.round, "box": [list(b) for b in self.box],
                "sender": self.sender, "receivers": list(self.receivers), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict) -> "Transfer":
        return cls(d["id"], tuple(tuple(b) for b in d["box"]), d["sender"],
                   tuple(d["receivers"]), d["nbytes"], d["round"])

    def __repr__(self) -> str:
        box = "x".join(f"[{lo}:{hi})" for lo, hi in self.box) or "()"
        return (f"Transfer#{self.id}(round {self.round}: {box} {self.nbytes} B "
                f"{self.sender} -> {list(self.receivers)})")


class Plan:
    """The result of :func:`mcrdl_core.plan_reshard`; see the module docstring."""

    def __init__(self, *, global_shape, dtype, itemsize, src: Layout, dst: Layout, hosts: dict,
                 method: str, balance: str, order: str, link: LinkModel, transfers: list,
                 local: list, host_bytes: dict, rounds: int, predicted_s: float,
                 lower_bound_s: float, predicted_waited_s: float | None = None):
        self.global_shape = tuple(global_shape)
        self.dtype = dtype
        self.itemsize = itemsize
        self.src = src
        self.dst = dst
        self.hosts = hosts  # {rank: host label}
        self.method = method
        self.balance = balance
        self.order = order
        self.link = link
        self.transfers = transfers
        self.local = local  # [(rank, box)]
        self.host_bytes = host_bytes  # {label: [out, in]}
        self.rounds = rounds
        self.predicted_s = predicted_s  # the executor's default, overlap=True
        self.predicted_waited_s = (predicted_s if predicted_waited_s is None
                                   else predicted_waited_s)  # overlap=False
        self.lower_bound_s = lower_bound_s
        self._fp = None
        self._by_rank = None
        self.cache: dict = {}  # executors keep per-plan state here (groups, tiles)

    # --- per-rank views -----------------------------------------------------------------
    def for_rank(self, rank: int) -> tuple[list, list]:
        """(the transfers ``rank`` sends or receives, in round order; its local copies)."""
        if self._by_rank is None:
            by = {}
            for t in self.transfers:
                for r in t.ranks():
                    by.setdefault(r, ([], []))[0].append(t)
            for r, box in self.local:
                by.setdefault(r, ([], []))[1].append(box)
            self._by_rank = by
        return self._by_rank.get(rank, ([], []))

    def ranks(self) -> list[int]:
        """Every rank of either mesh, sorted."""
        return sorted(set(self.src.mesh.rank_list()) | set(self.dst.mesh.rank_list()))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    # --- serialization ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION,
            "global_shape": list(self.global_shape), "dtype": self.dtype,
            "itemsize": self.itemsize, "src": self.src.to_dict(), "dst": self.dst.to_dict(),
            "hosts": [[r, h] for r, h in sorted(self.hosts.items())],
            "method": self.method, "balance": self.balance, "order": self.order,
            "link": self.link.to_dict(),
            "transfers": [t.to_dict() for t in self.transfers],
            "local": [[r, [list(b) for b in box]] for r, box in self.local],
            "host_bytes": {str(h): list(v) for h, v in sorted(self.host_bytes.items(),
                                                               key=lambda kv: str(kv[0]))},
            "rounds": self.rounds, "predicted_s": self.predicted_s,
            "predicted_waited_s": self.predicted_waited_s,
            "lower_bound_s": self.lower_bound_s,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise InvalidArgumentError(f"not a resharding plan of version {VERSION} (format "
                                       f"{d.get('format')!r}, version {d.get('version')!r}); "
                                       "plan again with mcrdl_core.plan_reshard")
        return cls(global_shape=d["global_shape"], dtype=d["dtype"], itemsize=d["itemsize"],
                   src=Layout.from_dict(d["src"]), dst=Layout.from_dict(d["dst"]),
                   hosts={int(r): h for r, h in d["hosts"]}, method=d["method"],
                   balance=d["balance"], order=d["order"], link=LinkModel(**d["link"]),
                   transfers=[Transfer.from_dict(t) for t in d["transfers"]],
                   local=[(r, tuple(tuple(b) for b in box)) for r, box in d["local"]],
                   host_bytes={h: tuple(v) for h, v in d["host_bytes"].items()},
                   rounds=d["rounds"], predicted_s=d["predicted_s"],
                   predicted_waited_s=d.get("predicted_waited_s"),
                   lower_bound_s=d["lower_bound_s"])

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical JSON: equal on every rank iff the plans are."""
        if self._fp is None:
            self._fp = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._fp

    # --- printing -----------------------------------------------------------------------
    def summary(self) -> str:
        return (f"reshard plan {self.fingerprint()[:12]}: {self.dtype}{list(self.global_shape)}, "
                f"{self.method}, balance={self.balance}, order={self.order}: "
                f"{len(self.transfers)} transfers in {self.rounds} rounds, "
                f"{self.total_bytes} B, {len(self.local)} local copies; predicted "
                f"{self.predicted_s * 1e3:.3f} ms (round by round "
                f"{self.predicted_waited_s * 1e3:.3f} ms), lower bound "
                f"{self.lower_bound_s * 1e3:.3f} ms")

    def __str__(self) -> str:
        lines = [self.summary(), f"  src {self.src!r}", f"  dst {self.dst!r}"]
        for t in self.transfers[:64]:
            lines.append(f"  {t!r}")
        if len(self.transfers) > 64:
            lines.append(f"  ... {len(self.transfers) - 64} more transfers")
        if self.host_bytes:
            lines.append("  link bytes per host (out, in): " + ", ".join(
                f"{h}: {o}/{i}" for h, (o, i) in sorted(self.host_bytes.items(),
                                                        key=lambda kv: str(kv[0]))))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self.summary()}>"
