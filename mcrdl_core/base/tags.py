"""The point-to-point tags the core reserves on a group's communicators.

Algorithms the core builds from point-to-point messages (compressed rings, resharding)
send on the user's groups, so their tags must never match each other's or a user's
receive. Everything reserved lies in ``[RESERVED_BASE, 32768)``: below the smallest tag
bound MPI guarantees (32767), so it holds on every MPI library.

Users name tags in ``[0, USER_TAG_LIMIT)`` only (``USER_TAG_LIMIT == RESERVED_BASE``):
every public point-to-point entry (``send``/``recv`` of the core and the frontends,
``P2POp``, the JAX frontend's, under ``jit`` too) refuses any other tag with
InvalidArgumentError before anything is sent (``user_tag``; the fast path defers such a
call to the general path, ``is_user_tag``), so a user's message can never match the
core's, nor a user's receive take one of the core's messages. The core's own algorithms
send on the reserved tags through ``mcrdl_core.dispatch.api.core_send``/``core_recv``.

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

import operator

from .errors import InvalidArgumentError

RESERVED_BASE = 31740
USER_TAG_LIMIT = RESERVED_BASE
RESHARD = 31740
RESHARD_GO = 31741
COMPRESS_BASE = 31744
COMPRESS_SPAN = 1024
SLOTS = 16
SLOT_TAGS = COMPRESS_SPAN // SLOTS


def compress_tag(slot: int, tag: int) -> int:
    """The wire tag of a compressed call's local ``tag`` in slot ``slot``."""
    return COMPRESS_BASE + (slot % SLOTS) * SLOT_TAGS + tag % SLOT_TAGS


def is_user_tag(tag) -> bool:
    """Whether ``tag`` is a plain int a user may name (the fast path's test: anything
    else takes the general path, where ``user_tag`` says what is wrong)."""
    return tag.__class__ is int and 0 <= tag < USER_TAG_LIMIT


def user_tag(tag, call: str) -> int:
    """``tag`` of a user's point-to-point ``call`` as an int; InvalidArgumentError where
    it is not an integer in ``[0, USER_TAG_LIMIT)`` (negative tags are refused as MPI
    refuses them; the tags above are the core's)."""
    try:
        value = operator.index(tag)
    except TypeError:
        raise InvalidArgumentError(f"{call}: tag must be an integer, got {type(tag).__name__}")
    if not 0 <= value < USER_TAG_LIMIT:
        raise InvalidArgumentError(
            f"{call}: tag {value} is outside the user range [0, {USER_TAG_LIMIT}); tags from "
            f"{USER_TAG_LIMIT} up are reserved for the core's own messages (compressed "
            "collectives, resharding), so a user message can never match one of them: "
            "pick a tag below it")
    return value
