"""Exact unless asked: what a user saves or reads back whole never passes a lossy codec.

``MCRDL_COMPRESSION=all_gather=int8`` is what FSDP training wants, and a checkpoint made
meanwhile must still hold the parameters' own values. ``mcrdl_torch.exact()`` (the
core's ``mcrdl_core.exact``: per thread, nests) is a scope in which no codec applies to
any call, from mcrdl_torch and from torch.distributed on an "mcrdl" process group
alike. It is entered by itself around:

- ``torch.distributed.checkpoint``: ``save``, ``async_save``, ``load`` (and the older
  ``save_state_dict``/``load_state_dict``), in the package and in its
  ``state_dict_saver``/``state_dict_loader`` modules;
- ``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict``,
  ``get_optimizer_state_dict``, ``get_state_dict`` and their ``set_*`` twins (the full
  state dict gathers through ``DTensor.full_tensor``);
- ``DTensor.full_tensor`` everywhere: a tensor asked for whole is asked for as it is.

Each is wrapped once, when its module is imported (an import hook for the ones not
imported yet, so importing mcrdl_torch does not import them); calls made through a
reference taken before that are not covered -- use ``with mcrdl_torch.exact():``
there. Training-time collectives (FSDP2's own all-gathers, DDP's all-reduces) are not
touched: they go on using the codec the user allowed.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

from mcrdl_core.base.exact import active, exact  # noqa: F401  (public: mcrdl_torch.exact)

#: module -> the functions (or "Class.method") that run inside ``exact()``
TARGETS = {
    "torch.distributed.checkpoint.state_dict_saver": ("save", "async_save", "save_state_dict"),
    "torch.distributed.checkpoint.state_dict_loader": ("load", "load_state_dict"),
    "torch.distributed.checkpoint": ("save", "async_save", "load", "save_state_dict",
                                     "load_state_dict"),
    "torch.distributed.checkpoint.state_dict": (
        "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
        "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"),
    "torch.distributed.tensor._api": ("DTensor.full_tensor",),
}


def exactly(fn):
    """``fn`` run inside ``exact()`` (marked, so it is wrapped once)."""
    if getattr(fn, "__mcrdl_exact__", False):
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with exact():
            return fn(*args, **kwargs)
    run.__mcrdl_exact__ = True
    return run


def _patch(module) -> None:
    for name in TARGETS.get(module.__name__, ()):
        owner, _, attr = name.rpartition(".")
        holder = getattr(module, owner) if owner else module
        fn = getattr(holder, attr, None)
        if callable(fn):
            setattr(holder, attr, exactly(fn))


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the targets of a module of ``TARGETS`` right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            _patch(module)
        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Wrap the targets of the modules already imported; hook the others' imports
    (idempotent)."""
    for name in TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
