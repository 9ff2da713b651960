"""The planner: pure (no communication), deterministic, the same plan on every rank.

1. Units. Per dimension, every destination block is intersected with the source blocks
   by bisection over the source boundaries; a destination tile's units are the products
   of its per-dimension pieces. A unit is a box, its candidate senders (the replicas of
   the source tile that holds it) and its receivers (the replicas of the destination
   tile). Receivers that hold the source tile themselves copy the box locally; the
   others make one transfer.
2. Senders (``balance``). ``"lpt"``: transfers largest first, each to the candidate
   whose host has sent the fewest bytes over its link so far counting this one (ties:
   a sender on a receiver's host, then the lower host, then the lower rank);
   ``"least_load"``: the same rule in unit order; ``"first"``: always the lowest-ranked
   replica (no balancing).
3. Rounds (``order``). ``"rounds"``: largest first, each transfer into the first round
   in which none of its hosts (sender's and receivers') appears yet; ``"naive"``: one
   transfer per round, in unit order.
4. Prediction. Each round takes as long as its slowest transfer under the
   :class:`LinkModel`; the plan's time is the sum over rounds. The lower bound is the
   busiest host's bytes on its link (the larger of in and out) over the bandwidth.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from itertools import product

from .. import dtypes as _dt
from ..errors import InvalidArgumentError
from .layout import Layout
from .linkmodel import METHODS, LinkModel
from .plan import Plan, Transfer

BALANCES = ("lpt", "least_load", "first")
ORDERS = ("rounds", "naive")


def host_labels(hosts, ranks) -> dict:
    """{rank: host label} for ``ranks``. ``hosts``: None (one host per rank), an int
    (ranks per host, block placement: host ``rank // k``), a dict {rank: label} or a
    sequence indexed by global rank."""
    if hosts is None:
        return {r: f"r{r}" for r in ranks}
    if isinstance(hosts, bool):
        raise InvalidArgumentError(f"hosts={hosts!r}; pass ranks per host (int) or a map")
    if isinstance(hosts, int):
        if hosts < 1:
            raise InvalidArgumentError(f"hosts={hosts}: ranks per host must be >= 1")
        return {r: f"h{r // hosts}" for r in ranks}
    try:
        out = {r: str(hosts[r]) for r in ranks}
    except (KeyError, IndexError, TypeError):
        raise InvalidArgumentError(
            f"hosts does not name the host of every rank of the meshes ({ranks[:16]}...); pass "
            "a dict {rank: host}, a list indexed by rank, or ranks per host (int)") from None
    return out


def _check_choice(name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise InvalidArgumentError(f"{name}={value!r}; use one of {list(allowed)}")


def _pieces(S: list, D: list, j: int) -> list:
    """Pieces of destination block ``j`` (``[D[j], D[j+1])``) over source boundaries
    ``S``: [(source block, (lo, hi), hi - lo), ...] without empty ones."""
    lo, hi = D[j], D[j + 1]
    if lo >= hi:
        return []
    out = []
    i = bisect_right(S, lo) - 1
    k = len(S) - 1
    while i < k and S[i] < hi:
        a, b = max(lo, S[i]), min(hi, S[i + 1])
        if a < b:
            out.append((i, (a, b), b - a))
        i += 1
    return out


def make_plan(global_shape, dtype, src: Layout, dst: Layout, *, method: str = "broadcast",
              balance: str = "lpt", order: str = "rounds", hosts=None,
              link: LinkModel | None = None) -> Plan:
    """Plan moving a tensor of ``global_shape`` and ``dtype`` from layout ``src`` to
    ``dst``. See the module docstring; ``hosts`` as in :func:`host_labels`."""
    _check_choice("method", method, METHODS)
    _check_choice("balance", balance, BALANCES)
    _check_choice("order", order, ORDERS)
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise InvalidArgumentError("src and dst must be Layouts (mcrdl_core.reshard.Layout; "
                                   "convert JAX shardings with mcrdl_jax.layout and DTensor "
                                   "placements with mcrdl_torch.layout)")
    try:
        shape = tuple(int(n) for n in global_shape)
    except TypeError:
        raise InvalidArgumentError(f"global_shape={global_shape!r} must be a sequence of "
                                   "ints") from None
    if any(n < 0 for n in shape):
        raise InvalidArgumentError(f"global_shape {shape} has a negative size")
    dt = _dt.lookup(dtype)
    isz = dt.itemsize
    link = link or LinkModel()

    sb, db = src.bounds(shape), dst.bounds(shape)
    sidx, didx = src.tile_index(shape), dst.tile_index(shape)
    all_ranks = sorted(set(sidx) | set(didx))
    labels = host_labels(hosts, all_ranks)
    host_id = {lab: i for i, lab in enumerate(sorted(set(labels.values())))}
    hid = {r: host_id[labels[r]] for r in all_ranks}
    id_label = {i: lab for lab, i in host_id.items()}

    src_tiles: dict = {}
    for r in sorted(sidx):
        src_tiles.setdefault(sidx[r], []).append(r)
    src_tiles = {k: tuple(v) for k, v in src_tiles.items()}
    dst_tiles: dict = {}
    for r in sorted(didx):
        dst_tiles.setdefault(didx[r], []).append(r)
    src_sets = {k: frozenset(v) for k, v in src_tiles.items()}
    # candidate senders per source tile: the lowest rank of each host holding it
    src_by_host: dict = {}
    for k, rs in src_tiles.items():
        seen = {}
        for r in rs:
            seen.setdefault(hid[r], r)
        src_by_host[k] = sorted(seen.items())  # [(host, rank)]

    ndim = len(shape)
    piece_cache = [dict() for _ in range(ndim)]
    transfers, local = [], []
    tile_hosts = []  # per transfer: {host: receivers there} (shared by a tile's units)
    for tidx in sorted(dst_tiles):
        receivers = dst_tiles[tidx]
        all_need = tuple(receivers)
        ph_all = None
        per_dim = []
        for d in range(ndim):
            c = piece_cache[d]
            p = c.get(tidx[d])
            if p is None:
                p = c[tidx[d]] = _pieces(sb[d], db[d], tidx[d])
            per_dim.append(p)
        for combo in product(*per_dim):
            if combo:
                sid, box, lens = zip(*combo)
            else:  # a 0-d tensor: one unit, the empty box
                sid, box, lens = (), (), ()
            holders = src_sets[sid]
            if holders.isdisjoint(receivers):
                need = all_need
                if ph_all is None:
                    ph_all = _per_host(need, hid)
                ph = ph_all
            else:
                need = []
                for r in receivers:
                    if r in holders:
                        local.append((r, box))
                    else:
                        need.append(r)
                if not need:
                    continue
                need = tuple(need)
                ph = _per_host(need, hid)
            transfers.append(Transfer(len(transfers), box, -1, need, math.prod(lens) * isz, 0,
                                      sid))
            tile_hosts.append(ph)

    # --- senders ------------------------------------------------------------------------
    load: dict = {}
    seq = (sorted(transfers, key=lambda t: (-t.nbytes, t.id)) if balance == "lpt"
           else transfers)
    for t in seq:
        ph = tile_hosts[t.id]
        cands = src_by_host[t.candidates]
        if balance == "first" or len(cands) == 1:
            s = src_tiles[t.candidates][0]
            h = hid[s]
        else:
            best = None
            for h, r in cands:
                add = _egress(method, t.nbytes, ph, h)
                key = (load.get(h, 0) + add, 0 if h in ph else 1, h, r)
                if best is None or key < best:
                    best = key
            h, s = best[2], best[3]
        t.sender = s
        load[h] = load.get(h, 0) + _egress(method, t.nbytes, ph, h)
        t.candidates = src_tiles[t.candidates]
    recv_hosts = tile_hosts

    # --- rounds -------------------------------------------------------------------------
    if order == "naive":
        for i, t in enumerate(transfers):
            t.round = i
        nrounds = len(transfers)
    else:
        used: list = []  # per round, the hosts in it
        first_free: dict = {}  # host -> no round before this one is free for it
        for t in sorted(transfers, key=lambda t: (-t.nbytes, t.id)):
            hs = set(recv_hosts[t.id])
            hs.add(hid[t.sender])
            r = max(first_free.get(h, 0) for h in hs)
            while r < len(used) and not used[r].isdisjoint(hs):
                r += 1
            if r == len(used):
                used.append(set())
            used[r].update(hs)
            t.round = r
            for h in hs:
                f = first_free.get(h, 0)
                while f < len(used) and h in used[f]:
                    f += 1
                first_free[h] = f
        nrounds = len(used)
    transfers.sort(key=lambda t: (t.round, t.id))

    # --- bytes on the links, prediction -------------------------------------------------
    out_b: dict = {}
    in_b: dict = {}
    round_time = [0.0] * nrounds
    memo: dict = {}
    for t in transfers:
        ph = recv_hosts[t.id]
        s = hid[t.sender]
        key = (id(ph), s, t.nbytes)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = _link_use(method, link, t.nbytes, ph, s)
        outs, ins, tt = hit
        for h, b in outs:
            out_b[h] = out_b.get(h, 0) + b
        for h, b in ins:
            in_b[h] = in_b.get(h, 0) + b
        if tt > round_time[t.round]:
            round_time[t.round] = tt
    busiest = max([0] + list(out_b.values()) + list(in_b.values()))
    host_bytes = {id_label[h]: (out_b.get(h, 0), in_b.get(h, 0))
                  for h in sorted(set(out_b) | set(in_b))}
    return Plan(global_shape=shape, dtype=dt.name, itemsize=isz, src=src, dst=dst,
                hosts=labels, method=method, balance=balance, order=order, link=link,
                transfers=transfers, local=local, host_bytes=host_bytes, rounds=nrounds,
                predicted_s=sum(round_time), lower_bound_s=busiest / link.bandwidth)


def _link_use(method: str, link: LinkModel, n: int, ph: dict, s: int) -> tuple:
    """(bytes out per host, bytes in per host, predicted seconds) of one transfer."""
    if len(ph) == 1 and method != "send_recv_allgather":  # the common case, made quick
        (h, k), = ph.items()
        if h == s:
            if method == "broadcast":
                return (), (), link.latency + n / link.intra_bandwidth
            return (), (), k * (link.latency + n / link.intra_bandwidth)
        if k == 1:
            lat = link.latency * (2 if method == "broadcast" else 1)
            return ((s, n),), ((h, n),), lat + n / link.bandwidth
    remote = sorted(h for h in ph if h != s)
    if method == "send_recv":
        k = sum(ph[h] for h in remote)
        outs = [(s, n * k)] if k else []
        ins = [(h, n * ph[h]) for h in remote]
    else:
        outs, ins = link.link_bytes(method, n, s, remote)
    return outs, ins, link.time(method, n, ph, s)


def _per_host(receivers, hid) -> dict:
    ph: dict = {}
    for r in receivers:
        h = hid[r]
        ph[h] = ph.get(h, 0) + 1
    return ph


def _egress(method: str, n: int, per_host: dict, h: int) -> int:
    """Bytes host ``h`` would send over its link as the sender of this transfer."""
    if method == "broadcast":
        return n if any(x != h for x in per_host) else 0
    if method == "send_recv":
        return n * sum(c for x, c in per_host.items() if x != h)
    return n * sum(1 for x in per_host if x != h)
