"""The straggler view of the comm logger: collectives that compare this rank's median
latency per logged call with every other rank's (``stragglers``), and that say on which
ranks the stale-table report flags an entry (``stale_ranks``).

It lives apart from ``logger.py`` because it communicates: the logger is imported by the
runtime, and a logger that imported the api (which imports the runtime) made an import
cycle inside the core.
"""
from __future__ import annotations

import numpy as np

from ..dispatch.api import all_gather_into_tensor
from ..observe.logger import CommLogger, logger
from ..dispatch.runtime import get_runtime


def stragglers(group=None, log: CommLogger | None = None) -> list[dict]:
    """Collective over ``group`` (world by default): per (op, bytes, backend) logged,
    this rank's median latency (``own_s``, seconds) against the fastest (``min_s``) and
    slowest (``max_s``) rank's, and the slowest rank's global rank. Every rank must have
    logged the same calls; the view's own all-gather is not logged."""
    log = log or logger()
    rows = log.rows()
    mine = np.array([r["median_s"] for r in rows], dtype=np.float64)
    g = get_runtime().group(group)
    table = np.zeros((g.size, mine.size), dtype=np.float64)
    was, log.enabled = log.enabled, False
    try:
        all_gather_into_tensor(table, mine, group=group)
    finally:
        log.enabled = was
    return [{"op": r["op"], "bytes": r["bytes"], "backend": r["backend"],
             "own_s": r["median_s"], "min_s": float(table[:, i].min()),
             "max_s": float(table[:, i].max()),
             "slowest_rank": int(g.ranks[int(table[:, i].argmax())])}
            for i, r in enumerate(rows)]


def stale_ranks(group=None, log: CommLogger | None = None, table=None) -> list[dict]:
    """Collective over ``group`` (world by default): the stale-table report
    (``CommLogger.stale``) of every member, merged. One row per entry flagged on some
    rank: the first flagging rank's row, plus ``flagged_on`` (the global ranks that
    flag it) and ``ratios`` ({rank: its median / verified}). Ranks may have logged different
    calls; the exchange itself is not logged."""
    log = log or logger()
    rt = get_runtime()
    g = rt.group(group)
    mine = log.stale(table)
    was, log.enabled = log.enabled, False
    try:
        every = rt.bootstrap.group_allgather(mine, list(g.ranks)) if g.size < rt.world_size \
            else rt.bootstrap.allgather(mine)
    finally:
        log.enabled = was
    merged: dict = {}
    for rank, rows in zip(g.ranks, every):
        for r in rows:
            key = (r["op"], r["bytes"], r["backend"], r["ranks"])
            m = merged.setdefault(key, dict(r, flagged_on=[], ratios={}))
            m["flagged_on"].append(int(rank))
            m["ratios"][int(rank)] = r["ratio"]
    return list(merged.values())
