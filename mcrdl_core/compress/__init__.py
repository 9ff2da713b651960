"""Compression-assisted all-gather, reduce-scatter, all-reduce and all-to-all.

Lossy compression is never used unless allowed: ``compression="int8"`` (or fp16, bf16,
fp8, int4, zfp:RATE, none; ``@ring``/``@p2p``/``@a2a`` picks the algorithm) on
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``,
``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single`` and ``all_to_all``, or
``MCRDL_COMPRESSION`` for the process (all-to-all only under its own ``all_to_all=``
key). See docs/compression.md.

- ``codecs``: fixed-size encodings (size known from the element count alone);
- ``algorithms``: ring all-gather / reduce-scatter with collective-level compression,
  the point-to-point-compression baseline, all-to-all reduce-scatter, the compressed
  all-to-all, over any backend's send/recv or all-to-all, as generators;
- ``schedule``: runs those generators as Works of the progress engine;
- ``spec``: what was allowed, and the plan of a call (pure data: ``plan(...)``,
  ``plan_all_to_all(...)``).
"""
from .codecs import Codec, NonFiniteError
from .spec import (ALGORITHMS, A2APlan, Compression, Plan, env_default, make_codec, parse, plan,
                   plan_all_to_all, resolve)

CODECS = ("none", "bf16", "fp16", "int8", "fp8", "int4", "zfp:8", "zfp:16", "zfp:24")

__all__ = ["ALGORITHMS", "A2APlan", "CODECS", "Codec", "Compression", "NonFiniteError", "Plan",
           "env_default", "make_codec", "parse", "plan", "plan_all_to_all", "resolve"]
