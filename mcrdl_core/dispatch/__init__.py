"""The call pipeline: the Runtime (groups, backends, selection memo), selection from
tuning tables, validation, the memoized fast path, transforms by name (``hooks``) and
the public collective and point-to-point calls (``api``, ``p2p``)."""
