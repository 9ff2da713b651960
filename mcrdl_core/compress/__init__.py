"""Compression-assisted all-gather, reduce-scatter and all-reduce (issue 12).

Lossy compression is never used unless allowed: ``compression="int8"`` (or fp16, bf16,
int4, zfp:RATE, none; ``@ring``/``@p2p``/``@a2a`` picks the algorithm) on
``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter``,
``reduce_scatter_tensor`` and ``all_reduce``, or ``MCRDL_COMPRESSION`` for the process.
See docs/compression.md.

- ``codecs``: fixed-size encodings (size known from the element count alone);
- ``algorithms``: ring all-gather / reduce-scatter with collective-level compression,
  the point-to-point-compression baseline, all-to-all reduce-scatter, over any
  backend's send/recv, as generators;
- ``schedule``: runs those generators as Works of the progress engine;
- ``spec``: what was allowed, and the plan of a call (pure data: ``plan(...)``).
"""
from .codecs import Codec, NonFiniteError
from .spec import ALGORITHMS, Compression, Plan, env_default, make_codec, parse, plan, resolve

CODECS = ("none", "bf16", "fp16", "int8", "int4", "zfp:8", "zfp:16", "zfp:24")

__all__ = ["ALGORITHMS", "CODECS", "Codec", "Compression", "NonFiniteError", "Plan",
           "env_default", "make_codec", "parse", "plan", "resolve"]
