"""Groups of ranks.

A Group is a set of global ranks with this process's position in it. It lazily holds
one communicator per backend (MPI sub-communicator, Gloo process group, NCCL
communicator), created on first use by the group's members and then cached: never one
per call. As in torch.distributed, ``new_group`` is called by every rank of the world,
in the same order, with the same ranks, or (``use_local_synchronization``) by the
members only; either way the members agree on the group's ``key``, which does not
depend on calls that other ranks make or skip.

Broken groups. When a wait on the group's work runs past the runtime's timeout
(``MCRDL_TIMEOUT``; not a shorter deadline the caller passed to ``Work.wait``), the
group is marked broken: its communicators may hold operations that will never be
matched, so every later call on it raises :class:`BrokenGroupError` at once, quoting
the timeout, instead of queueing behind them (torch does the same after an NCCL
timeout). Other groups stay usable. The mark lasts until the runtime is destroyed.
"""
from __future__ import annotations

from ..base.errors import BrokenGroupError, InvalidArgumentError


class Group:
    """``id``: this process's index of the group (local caches use it); ``key``: the
    group's identity that every member agrees on (the member list in order and how many
    groups of that list the member made before, or a name the caller gives, such as
    torch's group name), which communicator creation exchanges and compares."""

    def __init__(self, gid: int, ranks, my_global_rank: int, name: str | None = None,
                 key: str | None = None):
        self.id = gid
        self.ranks = tuple(int(r) for r in ranks)
        self.key = key or ("world" if gid == 0 else f"{','.join(map(str, self.ranks))}#0")
        self.size = len(self.ranks)
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.rank = self._index.get(my_global_rank, -1)  # -1: not a member
        self.name = name or ("world" if gid == 0 else f"group{gid}")
        self.comms: dict = {}  # backend name -> that backend's communicator
        self.backend: str | None = None  # default backend of calls on this group
        self.broken: BaseException | None = None  # the fault that made it unusable
        self.timeout: float | None = None  # waits that pass none use it (a torch group's
        # timeout=); None: the runtime's (MCRDL_TIMEOUT)
        self.seq = 0  # compressed calls made on the group: every member counts alike
        self.trace_seq = 0  # collectives the flight recorder saw (observe/recorder.py)
        self.trace_p2p = 0  # its sends and receives on the group
        self.tag_slots: dict = {}  # tag slot -> the call in flight on it (mcrdl_core.base.tags)

    def next_seq(self) -> int:
        """The sequence number of the next call on the group that sends on tags of its
        own (compressed collectives): the same on every member, since every member makes
        the group's collectives in the same order."""
        self.seq += 1
        return self.seq - 1

    def mark_broken(self, error: BaseException) -> None:
        """Record the first fault; later calls on the group raise at once."""
        if self.broken is None:
            self.broken = error

    def broken_error(self) -> BrokenGroupError:
        """The BrokenGroupError for a call on (or a wait for work of) this broken group."""
        err = BrokenGroupError(
            f"{self.describe()} is unusable since an earlier call on it failed: "
            f"{self.broken}. Its communicators may hold unmatched operations, so nothing "
            "more is sent on it: end the job (every rank gets an error)")
        err.__cause__ = self.broken
        return err

    def raise_broken(self):
        """Raise BrokenGroupError for a call on this broken group."""
        raise self.broken_error()

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Position of a global rank in this group; clear error if it is not in it."""
        try:
            return self._index[int(global_rank)]
        except (KeyError, TypeError, ValueError):
            raise InvalidArgumentError(
                f"{what} {global_rank!r} is not in {self.describe()}; ranks are global ranks, "
                "as in torch.distributed (use get_global_rank(group, i) to convert)") from None

    def global_rank(self, group_rank: int) -> int:
        if not 0 <= group_rank < self.size:
            raise InvalidArgumentError(f"group rank {group_rank} is outside {self.describe()}")
        return self.ranks[group_rank]

    def describe(self) -> str:
        shown = list(self.ranks) if self.size <= 16 else f"{self.size} ranks"
        return f"group '{self.name}' (ranks {shown})"

    def __repr__(self) -> str:
        return f"<Group {self.name} ranks={list(self.ranks)} rank={self.rank}>"


_ROUNDS: dict = {}  # rendezvous key -> how many this process made under it


def next_round(key) -> int:
    """The number of rendezvous this process made under ``key`` before this one (0 the
    first time), counted for the whole process, not per runtime: a store's keys outlive
    the groups that wrote them, and names come back -- torch names its groups afresh
    after ``destroy_process_group`` + ``init_process_group``, on the same torchrun agent
    store, and a runtime made again numbers its groups alike -- so a rendezvous that
    read the keys of an earlier one would connect to peers long gone and hang. Each
    rendezvous of a key (a group's name and its ranks) puts this number in its store
    prefix; every member counts alike, since the members make the same groups in the
    same order (non-members of a group never count it)."""
    n = _ROUNDS.get(key, 0)
    _ROUNDS[key] = n + 1
    return n

