"""Algorithms built from collectives of the layers below, loaded as transforms
through ``dispatch.hooks``: the two-level (hierarchical) all-reduce and all-to-all.
The compressed collectives (``mcrdl_core.compress``) and resharding
(``mcrdl_core.reshard``) sit at the same level."""
