"""Transforms of the call pipeline, registered by name and loaded on first use.

A transform takes over the calls it applies to instead of the backend's own collective:
the compressed variants (``compression``: ``mcrdl_core.compress.entry:TRANSFORM``) and
the two-level all-reduce (``hierarchical``: ``mcrdl_core.algorithms.hier:TRANSFORM``,
``backend="hier"``). The api looks a transform up here by name, so it imports none
of them (a transform may import the api: it is above it), and a program that never
allows compression never loads that package. ``register_transform`` replaces one, as
``register_backend`` does for backends (a test's stand-in, another implementation).
"""
from __future__ import annotations

from ..world.backend import load_attr

#: name -> "module:attribute" of the transform object (or the object once loaded)
TRANSFORMS: dict[str, object] = {
    "compression": "mcrdl_core.compress.entry:TRANSFORM",
    "hierarchical": "mcrdl_core.algorithms.hier:TRANSFORM",
}


def register_transform(name: str, target) -> None:
    """Register a transform object (or a "module:attribute" string) under ``name``."""
    TRANSFORMS[name] = target


def transform(name: str):
    """The transform registered as ``name``, imported at its first use and kept."""
    target = TRANSFORMS[name]
    if isinstance(target, str):
        target = TRANSFORMS[name] = load_attr(target)
    return target
