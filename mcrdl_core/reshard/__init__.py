"""Cross-mesh resharding: move a sharded tensor from one mesh of ranks to another.

- :mod:`.layout`: :class:`Mesh` (N-d array of global ranks, named axes) and
  :class:`Layout` (per tensor dimension, the mesh axes that split it);
- :mod:`.planner`: :func:`plan_reshard`, pure and deterministic, returns a :class:`Plan`
  (:mod:`.plan`) you can print, serialize and compare across ranks;
- :mod:`.execute`: the executors (broadcast, send/recv, send/recv + all-gather) on any
  backend, through the core's calls;
- :mod:`.api`: :func:`reshard`.

See docs/resharding.md.
"""
from .layout import Layout, Mesh
from .linkmodel import METHODS, LinkModel
from .plan import Plan, Transfer
from .planner import BALANCES, ORDERS

__all__ = ["Layout", "Mesh", "LinkModel", "Plan", "Transfer", "METHODS", "BALANCES", "ORDERS"]
