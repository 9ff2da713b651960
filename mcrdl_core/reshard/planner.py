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
4. Prediction, for the executor's default (``overlap=True``: every rank posts its
   sends and final receives of all rounds at once): the local copies (at the intra-host
   bandwidth), then the busiest host's link (the larger of its bytes in and out over the
   bandwidth; or, if longer, all links' bytes at the aggregate bandwidth, or one rank's
   transfers inside a host one after the other),
   plus the most any single transfer adds to its bytes on the link (the latencies of its
   messages and the chain's pipeline fill: one segment per hop after the first). For
   ``overlap=False`` (each transfer waited for before the next) ``predicted_waited_s``:
   each round as long as its slowest transfer, the rounds one after the other. The
   lower bound is the busiest host's link alone.
"""
from __future__ import annotations

import gc
import math

import numpy as np

from ..base import dtypes as _dt
from ..base.errors import InvalidArgumentError
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
        q = (np.asarray(ranks, np.int64) // hosts).tolist()
        names = {k: f"h{k}" for k in set(q)}
        return dict(zip(ranks, map(names.__getitem__, q)))
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


def _dim_pieces(S: list, D: list) -> tuple:
    """The pieces of every destination block of one dimension over the source blocks.

    ``S``, ``D``: source and destination block boundaries. Block ``j`` (``[D[j],
    D[j+1])``) meets source blocks ``i0 .. i1-1`` (bisection of its ends over ``S``);
    the non-empty intersections are its pieces, in source order. Returns int64 arrays
    (first piece of each block, pieces per block, and per piece: source block, lo, hi)."""
    S = np.asarray(S, np.int64)
    D = np.asarray(D, np.int64)
    k = len(S) - 1
    lo, hi = D[:-1], D[1:]
    i0 = np.searchsorted(S, lo, "right") - 1
    i1 = np.minimum(np.searchsorted(S, hi, "left"), k)
    span = np.where(lo < hi, np.maximum(i1 - i0, 0), 0)
    j = np.repeat(np.arange(len(lo)), span)
    i = i0[j] + np.arange(len(j)) - np.repeat(np.cumsum(span) - span, span)
    a = np.maximum(lo[j], S[i])
    b = np.minimum(hi[j], S[i + 1])
    keep = a < b  # empty source blocks give empty intersections
    j, i, a, b = j[keep], i[keep], a[keep], b[keep]
    count = np.bincount(j, minlength=len(lo))
    return np.cumsum(count) - count, count, i, a, b


def _boxes(lo: np.ndarray, hi: np.ndarray, n: int) -> list:
    """``n`` boxes ``((lo, hi), ...)`` of Python ints from (units, dims) arrays."""
    if lo.shape[1] == 0:
        return [()] * n
    return list(zip(*[zip(lo[:, d].tolist(), hi[:, d].tolist()) for d in range(lo.shape[1])]))


def make_plan(global_shape, dtype, src: Layout, dst: Layout, *, method: str = "broadcast",
              balance: str = "lpt", order: str = "rounds", hosts=None,
              link: LinkModel | None = None) -> Plan:
    """Plan moving a tensor of ``global_shape`` and ``dtype`` from layout ``src`` to
    ``dst``. See the module docstring; ``hosts`` as in :func:`host_labels`.

    The units, their sizes, the default senders, the bytes on the links and the
    prediction of the common transfers (one receiver on another host) are computed with
    NumPy over all units at once; the greedy steps (balancing, rounds) stay sequential
    loops over plain lists, and the rest is per-tile, not per-unit, Python. The garbage
    collector is paused meanwhile: the plan's many small tuples are no cycles, and its
    passes over every object of the process cost more than the planning."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _make_plan(global_shape, dtype, src, dst, method, balance, order, hosts, link)
    finally:
        if paused:
            gc.enable()


def _make_plan(global_shape, dtype, src, dst, method, balance, order, hosts, link) -> Plan:
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
    ndim = len(shape)

    sb, db = src.bounds(shape), dst.bounds(shape)
    s_ranks = src.mesh.ranks.reshape(-1)
    d_ranks = dst.mesh.ranks.reshape(-1)
    s_nblk = [len(b) - 1 for b in sb]
    d_nblk = [len(b) - 1 for b in db]
    s_flat = _flat(src.tile_index_array(shape), s_nblk)  # source tile id of every rank
    d_flat = _flat(dst.tile_index_array(shape), d_nblk)
    all_ranks = np.union1d(s_ranks, d_ranks).tolist()
    labels = host_labels(hosts, all_ranks)
    host_id = {lab: i for i, lab in enumerate(sorted(set(labels.values())))}
    id_label = {i: lab for lab, i in host_id.items()}
    nhosts = len(host_id)
    hid_arr = np.zeros(all_ranks[-1] + 1, np.int64)
    hid_arr[all_ranks] = list(map(host_id.__getitem__, map(labels.__getitem__, all_ranks)))
    hid = hid_arr.tolist()  # host id by rank

    # source tiles (every id 0 .. ns-1 has a holder): holders ascending, candidate
    # senders (the lowest rank of each host holding the tile, by host)
    ns = math.prod(s_nblk)
    o = np.lexsort((s_ranks, s_flat))
    sr, sf = s_ranks[o], s_flat[o]
    if len(sr) == ns:  # no replicas: one holder per tile
        src_tiles = [(r,) for r in sr.tolist()]
        cand_hosts = [(h,) for h in hid_arr[sr].tolist()]
        cand_ranks = src_tiles
    else:
        src_tiles = _groups(sr.tolist(), sf, ns)
        sh = hid_arr[sr]
        o = np.lexsort((sr, sh, sf))
        f2, h2, r2 = sf[o], sh[o], sr[o]
        lead = np.ones(len(o), bool)
        lead[1:] = (f2[1:] != f2[:-1]) | (h2[1:] != h2[:-1])
        cand_hosts = _groups(h2[lead].tolist(), f2[lead], ns)
        cand_ranks = _groups(r2[lead].tolist(), f2[lead], ns)

    # destination tiles in index order: receivers (ascending), receivers per host
    o = np.lexsort((d_ranks, d_flat))
    t_ids = np.unique(d_flat)
    recv_l = _groups(d_ranks[o].tolist(), np.searchsorted(t_ids, d_flat[o]), len(t_ids))
    if len(t_ids) == len(d_ranks):  # no replicas: one receiver per tile
        ph_l = [{h: 1} for h in hid_arr[d_ranks[o]].tolist()]
    else:
        ph_l = [_per_host(rs, hid) for rs in recv_l]
    t_nrecv = np.array([len(rs) for rs in recv_l], np.int64)
    t_nrh = np.array([len(ph) for ph in ph_l], np.int64)
    t_h0 = np.array([next(iter(ph)) for ph in ph_l], np.int64)

    # --- units: every destination tile x the product of its per-dimension pieces ------
    pieces = [_dim_pieces(sb[d], db[d]) for d in range(ndim)]
    tidx = np.array(np.unravel_index(t_ids, d_nblk)).reshape(ndim, -1) if ndim else \
        np.zeros((0, len(t_ids)), np.int64)
    counts = [pieces[d][1][tidx[d]] for d in range(ndim)]
    per_tile = np.prod(np.array(counts).reshape(ndim, -1), axis=0).astype(np.int64) if ndim \
        else np.ones(len(t_ids), np.int64)
    ut = np.repeat(np.arange(len(t_ids)), per_tile)  # tile of each unit (position in t_ids)
    rem = np.arange(len(ut)) - np.repeat(np.cumsum(per_tile) - per_tile, per_tile)
    pidx = [None] * ndim
    for d in range(ndim - 1, -1, -1):  # itertools.product order: the last dimension fastest
        c = counts[d][ut]
        pidx[d] = pieces[d][0][tidx[d][ut]] + rem % c
        rem = rem // c
    lo = np.stack([pieces[d][3][pidx[d]] for d in range(ndim)], axis=1) if ndim else \
        np.zeros((len(ut), 0), np.int64)
    hi = np.stack([pieces[d][4][pidx[d]] for d in range(ndim)], axis=1) if ndim else lo
    sid = _flat(np.array([pieces[d][2][pidx[d]] for d in range(ndim)]).reshape(ndim, -1),
                s_nblk) if ndim else np.zeros(len(ut), np.int64)
    nbytes = np.prod(hi - lo, axis=1).astype(np.int64) * isz

    # units some receivers already hold: local copies (ranks in both meshes)
    in_both = np.isin(d_ranks, s_ranks)
    local: list = []
    special: dict = {}  # unit -> (receivers that need it, their hosts)
    local_b: dict = {}  # rank -> bytes it copies locally
    keep = np.ones(len(ut), bool)
    if in_both.any():
        pos_of = {int(k): i for i, k in enumerate(t_ids.tolist())}
        s_of = dict(zip(s_ranks.tolist(), s_flat.tolist()))
        pairs = np.array(sorted({pos_of[int(t)] * ns + s_of[int(r)]
                                 for r, t in zip(d_ranks[in_both], d_flat[in_both])}), np.int64)
        hit = np.flatnonzero(np.isin(ut * ns + sid, pairs))
        hit_boxes = _boxes(lo[hit], hi[hit], len(hit))
        for u, box in zip(hit.tolist(), hit_boxes):
            holders = src_tiles[int(sid[u])]
            need = []
            for r in recv_l[int(ut[u])]:
                if r in holders:
                    local.append((r, box))
                    local_b[r] = local_b.get(r, 0) + int(nbytes[u])
                else:
                    need.append(r)
            if need:
                need = tuple(need)
                special[u] = (need, _per_host(need, hid))
            else:
                keep[u] = False
    tu = np.flatnonzero(keep)  # the units that make a transfer, in unit order: ids 0..
    nt = len(tu)
    t_tile = ut[tu]
    t_sid = sid[tu]
    t_n = nbytes[tu]
    tl = t_tile.tolist()
    recv = list(map(recv_l.__getitem__, tl))
    phs = list(map(ph_l.__getitem__, tl))
    for i, u in enumerate(tu.tolist()) if special else ():
        if u in special:
            recv[i], phs[i] = special[u]

    # --- senders ------------------------------------------------------------------------
    first = np.array([rs[0] if rs else -1 for rs in src_tiles], np.int64)
    ncand = np.array([len(c) for c in cand_hosts], np.int64)
    sender = first[t_sid]
    if balance != "first" and nt and ncand[t_sid].max() > 1:
        seq = (np.lexsort((np.arange(nt), -t_n)) if balance == "lpt" else np.arange(nt))
        sender = _balance(method, seq.tolist(), t_sid.tolist(), t_n.tolist(), phs,
                          list(map(len, recv)), cand_hosts, cand_ranks, sender.tolist(),
                          hid, nhosts)
        sender = np.array(sender, np.int64)
    shost = hid_arr[sender] if nt else np.zeros(0, np.int64)
    snd0 = sender.tolist()
    shost_l = shost.tolist()

    # --- rounds -------------------------------------------------------------------------
    if order == "naive":
        rnd = np.arange(nt)
        nrounds = nt
    else:
        seq = np.lexsort((np.arange(nt), -t_n)).tolist()
        rnd = np.array(_rounds(seq, phs, shost_l, nhosts) if nt else [], np.int64)
        nrounds = int(rnd.max()) + 1 if nt else 0

    # --- bytes on the links, prediction -------------------------------------------------
    n_recv, n_rhost, rhost0 = t_nrecv[t_tile], t_nrh[t_tile], t_h0[t_tile]
    for i, u in enumerate(tu.tolist()) if special else ():
        if u in special:
            ph = phs[i]
            n_recv[i], n_rhost[i], rhost0[i] = len(recv[i]), len(ph), next(iter(ph))
    simple = (n_rhost == 1) & (n_recv == 1) & (rhost0 != shost)
    if method == "send_recv_allgather":
        simple[:] = False
    out_b = np.zeros(nhosts, np.int64)
    in_b = np.zeros(nhosts, np.int64)
    tt = np.zeros(nt, np.float64)
    lat = link.latency * (2 if method == "broadcast" else 1)
    tt[simple] = lat + t_n[simple] / link.bandwidth
    np.add.at(out_b, shost[simple], t_n[simple])
    np.add.at(in_b, rhost0[simple], t_n[simple])
    extra = 0.0  # the most any transfer between hosts adds to its bytes on the link
    if simple.any():
        extra = lat
    intra: dict = {}  # rank -> seconds of its transfers inside one host
    memo: dict = {}
    t_n_l = t_n.tolist()
    for i in np.flatnonzero(~simple).tolist():
        ph = phs[i]
        sh = shost_l[i]
        key = (id(ph), sh, t_n_l[i])
        use = memo.get(key)
        if use is None:
            use = memo[key] = _link_use(method, link, t_n_l[i], ph, sh)
        outs, ins, tt[i] = use
        mine = 0
        for h, b in outs:
            out_b[h] += b
            if h == sh:
                mine += b
        for h, b in ins:
            in_b[h] += b
        if mine:
            extra = max(extra, tt[i] - mine / link.bandwidth)
        else:
            for r in (snd0[i],) + recv[i]:
                intra[r] = intra.get(r, 0.0) + tt[i]
    round_time = np.zeros(nrounds, np.float64)
    np.maximum.at(round_time, rnd, tt)
    busiest = int(max(out_b.max(initial=0), in_b.max(initial=0)))
    # overlapped execution (the executor's default): local copies, then the busiest link
    # (or all links' bytes at the aggregate rate, or the longest run of transfers inside
    # a host), plus the latencies and chain fill of the transfer that adds the most
    total = int(out_b.sum())
    agg = total / link.aggregate_bandwidth if link.aggregate_bandwidth else 0.0
    predicted = (max(local_b.values(), default=0) / link.intra_bandwidth
                 + max(busiest / link.bandwidth, agg, max(intra.values(), default=0.0))
                 + extra)
    used = np.flatnonzero((out_b > 0) | (in_b > 0)).tolist()
    ob, ib = out_b.tolist(), in_b.tolist()
    host_bytes = {id_label[h]: (ob[h], ib[h]) for h in used}

    # --- the transfers, by (round, id) --------------------------------------------------
    o = np.lexsort((np.arange(nt), rnd)).tolist()
    boxes = _boxes(lo[tu], hi[tu], nt)
    snd, rl, nl, sl = sender.tolist(), rnd.tolist(), t_n_l, t_sid.tolist()
    transfers = [Transfer(i, boxes[i], snd[i], recv[i], nl[i], rl[i], src_tiles[sl[i]])
                 for i in o]
    return Plan(global_shape=shape, dtype=dt.name, itemsize=isz, src=src, dst=dst,
                hosts=labels, method=method, balance=balance, order=order, link=link,
                transfers=transfers, local=local, host_bytes=host_bytes, rounds=nrounds,
                predicted_s=predicted, predicted_waited_s=sum(round_time.tolist()),
                lower_bound_s=busiest / link.bandwidth)


def _groups(values: list, keys: np.ndarray, n: int) -> list:
    """Tuples of ``values`` (sorted by ``keys``, ints in ``[0, n)``), one per key."""
    cut = np.searchsorted(keys, np.arange(n + 1)).tolist()
    return [tuple(values[a:b]) for a, b in zip(cut[:-1], cut[1:])]


def _flat(idx: np.ndarray, nblk: list) -> np.ndarray:
    """Mixed-radix number of per-dimension block indices (dims, n): the first major."""
    out = np.zeros(idx.shape[1], np.int64)
    for d, k in enumerate(nblk):
        out = out * k + idx[d]
    return out


def _balance(method, seq, sid, n, phs, nrecv, cand_hosts, cand_ranks, sender, hid, nhosts):
    """Choose a sender per transfer, visiting them in ``seq`` order: the candidate host
    with the fewest bytes out so far counting this transfer (ties: a host that also
    receives it, then the lower host); its lowest-ranked replica sends."""
    load = [0] * nhosts
    for i in seq:
        ch = cand_hosts[sid[i]]
        ph = phs[i]
        if method == "broadcast":
            dflt = n[i]
        elif method == "send_recv":
            dflt = n[i] * nrecv[i]
        else:
            dflt = n[i] * len(ph)
        if len(ch) == 1:
            h = ch[0]
            load[h] += dflt if h not in ph else _egress(method, n[i], ph, h)
            continue
        if ph.keys().isdisjoint(ch):  # the usual case: every candidate adds the same
            h = min(ch, key=load.__getitem__)  # the first minimum: the lowest host
            sender[i] = cand_ranks[sid[i]][ch.index(h)]
            load[h] += dflt
            continue
        best = None
        for h, r in zip(ch, cand_ranks[sid[i]]):
            add = _egress(method, n[i], ph, h) if h in ph else dflt
            key = (load[h] + add, 0 if h in ph else 1, h, r)
            if best is None or key < best:
                best = key
        sender[i] = best[3]
        load[best[2]] = best[0]
    return sender


def _rounds(seq, phs, shost, nhosts) -> list:
    """First fit, visiting transfers in ``seq`` order: each goes into the first round in
    which none of its hosts appears yet. Each host's rounds are the bits of an int."""
    busy = [0] * nhosts
    rnd = [0] * len(shost)
    for i in seq:
        sh = shost[i]
        ph = phs[i]
        occ = busy[sh]
        for h in ph:
            occ |= busy[h]
        r = (~occ & (occ + 1)).bit_length() - 1  # the lowest free round
        bit = 1 << r
        busy[sh] |= bit
        for h in ph:
            busy[h] |= bit
        rnd[i] = r
    return rnd


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
