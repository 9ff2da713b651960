"""Transforms and observers of the call pipeline, registered by name and loaded on
first use.

A transform takes over the calls it applies to instead of the backend's own collective:
the compressed variants (``compression``: ``mcrdl_core.compress.entry:TRANSFORM``) and
the two-level all-reduce (``hierarchical``: ``mcrdl_core.algorithms.hier:TRANSFORM``,
``backend="hier"``). The api looks a transform up here by name, so it imports none
of them (a transform may import the api: it is above it), and a program that never
allows compression never loads that package. ``register_transform`` replaces one, as
``register_backend`` does for backends (a test's stand-in, another implementation).
"""
from __future__ import annotations

from ..base.errors import InvalidArgumentError
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


#: name -> "module:attribute" of an observer (``observe/observer.py``), or the object
OBSERVERS: dict[str, object] = {
    "debug": "mcrdl_core.observe.debug:OBSERVER",
}


def register_observer(name: str, target) -> None:
    """Register an observer (or a "module:attribute" string) under ``name``, for
    ``Runtime.watch(name)``."""
    OBSERVERS[name] = target


def observer(name: str):
    """The observer registered as ``name``, imported at its first use and kept."""
    try:
        target = OBSERVERS[name]
    except KeyError:
        raise InvalidArgumentError(f"no observer is registered as {name!r}: known are "
                                   f"{sorted(OBSERVERS)} (hooks.register_observer adds one)"
                                   ) from None
    if isinstance(target, str):
        target = OBSERVERS[name] = load_attr(target)
    return target
