"""The point-to-point tags the core reserves on a group's communicators.

Algorithms the core builds from point-to-point messages (compressed rings, resharding)
send on the user's groups, so their tags must never match each other's or a user's
receive. Everything reserved lies in ``[RESERVED_BASE, 32768)``: below the smallest tag
bound MPI guarantees (32767), so it holds on every MPI library; user tags below
``RESERVED_BASE`` never meet the core's messages.

- ``RESHARD``/``RESHARD_GO``: resharding's data and its chains' go messages.
- ``[COMPRESS_BASE, COMPRESS_BASE + COMPRESS_SPAN)``: compressed collectives, cut into
  ``SLOTS`` slots of ``SLOT_TAGS`` tags. Each compressed call on a group takes the
  group's next sequence number (``Group.next_seq``: every member counts the same calls,
  since collectives are called in the same order on every rank) and sends only on the
  tags of slot ``seq % SLOTS``; a call whose slot is still held by an earlier call in
  flight waits for that call first (``claim_slot`` in ``compress.schedule``), so two
  calls in flight never share a tag. Inside one call a tag may repeat: its messages
  between one pair of ranks are sent and received in the same order, and MPI and Gloo
  match messages of one tag between one pair in order.
"""
from __future__ import annotations

RESERVED_BASE = 31740
RESHARD = 31740
RESHARD_GO = 31741
COMPRESS_BASE = 31744
COMPRESS_SPAN = 1024
SLOTS = 16
SLOT_TAGS = COMPRESS_SPAN // SLOTS


def compress_tag(slot: int, tag: int) -> int:
    """The wire tag of a compressed call's local ``tag`` in slot ``slot``."""
    return COMPRESS_BASE + (slot % SLOTS) * SLOT_TAGS + tag % SLOT_TAGS
