"""Compressed all-gather and reduce-scatter over any backend's point-to-point calls.

Each algorithm is a generator run by :class:`~.schedule.ScheduleWork`: it yields the
Works it must see completed and returns True, or False when a block could not be
carried (zfp on NaN/Inf). ``P`` ranks, this rank ``r``; ``next = r+1``, ``prev = r-1``
(mod P). Every rank's block of ``n`` elements is cut into chunks (``Layout``): each
chunk is encoded, sent and decoded on its own, so the codec's work on one chunk overlaps
the transfer of another. All receives are posted up front (each into its own slot), so
a message never waits for its receive to be posted.

- ``ring_all_gather`` (the seed paper's collective compression): encode the own block
  once; at step s forward the bytes of block (r-s-1) unchanged; decode every block once,
  the own one too from its own bytes, so every rank ends with bit-identical results and
  the error does not grow with P. With ``per_hop`` (the paper's point-to-point baseline)
  each received block is decoded and re-encoded before it is forwarded, and the own
  block is kept exact.
- ``ring_reduce_scatter``: at step s receive the encoded partial sum of block (r-s-2),
  decode, add the own contribution in full precision, re-encode and forward; the last
  step's sum (this rank's own block) is never re-encoded. P-1 quantizations of partial
  sums reach each result.
- ``a2a_reduce_scatter`` (ZeRO++ qgZ style): encode the P blocks once, one all-to-all
  of the bytes, decode and sum in full precision: one quantization per contribution.
- ``coll_all_gather`` (qwZ style): encode once, one backend all-gather of the bytes,
  decode every block.
The uncompressed ring is ``ring_*`` with the ``none`` codec (same code, raw bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Layout:
    """Element and byte offsets of the chunks of one block."""

    counts: tuple
    codec: object

    def __post_init__(self):
        self.offs = np.concatenate(([0], np.cumsum(self.counts))).astype(int).tolist()
        self.enc = [self.codec.encoded_nbytes(c) for c in self.counts]
        self.eoffs = np.concatenate(([0], np.cumsum(self.enc))).astype(int).tolist()
        self.n = self.offs[-1]
        self.nbytes = self.eoffs[-1]
        self.chunks = len(self.counts)

    def part(self, arr, c: int, block: int = 0):
        """Chunk ``c`` of block ``block`` of a flat array of values."""
        base = block * self.n
        return arr[base + self.offs[c]:base + self.offs[c + 1]]

    def epart(self, arr, c: int, slot: int = 0):
        """Encoded chunk ``c`` in slot ``slot`` of a byte array (or Buffer)."""
        lo = slot * self.nbytes + self.eoffs[c]
        if hasattr(arr, "flat") and not hasattr(arr, "ndim"):  # a Buffer: a flat view
            return arr.flat(lo, self.enc[c])
        return arr[lo:lo + self.enc[c]]


def ring_all_gather(ch, lay: Layout, x, res, per_hop: bool = False, tag0: int = 0):
    """``x``: this rank's n values; ``res``: P*n values out (work dtype)."""
    codec, P, r, C = lay.codec, ch.size, ch.rank, lay.chunks
    enc = ch.staging(P * lay.nbytes)
    A = enc.array()
    ok = True
    recvs = {}
    for s in range(P - 1):
        k = (r - s - 1) % P
        for c in range(C):
            recvs[s, c] = ch.recv(lay.epart(enc, c, k), ch.prev, tag0 + s * C + c)
    sends = []
    for c in range(C):
        codec.encode(lay.part(x, c), lay.epart(A, c, r))
        if P > 1:
            sends.append(ch.send(lay.epart(enc, c, r), ch.next, tag0 + c))
    for c in range(C):
        if per_hop:
            lay.part(res, c, r)[...] = lay.part(x, c)
        else:
            ok &= codec.decode(lay.epart(A, c, r), lay.part(res, c, r))
    for s in range(P - 1):
        k = (r - s - 1) % P
        for c in range(C):
            yield recvs[s, c]
            out = lay.part(res, c, k)
            if per_hop or s == P - 2:
                ok &= codec.decode(lay.epart(A, c, k), out)
            if s < P - 2:
                if per_hop:
                    codec.encode(out, lay.epart(A, c, k))
                sends.append(ch.send(lay.epart(enc, c, k), ch.next, tag0 + (s + 1) * C + c))
                if not per_hop:
                    ok &= codec.decode(lay.epart(A, c, k), out)
    yield sends
    return bool(ok)


def ring_reduce_scatter(ch, lay: Layout, x, res, tag0: int = 0):
    """``x``: P*n values in; ``res``: this rank's n summed values out (work dtype)."""
    codec, P, r, C = lay.codec, ch.size, ch.rank, lay.chunks
    if P == 1:
        res[...] = x
        return True
    rbuf, sbuf = ch.staging((P - 1) * lay.nbytes), ch.staging((P - 1) * lay.nbytes)
    R, S = rbuf.array(), sbuf.array()
    recvs = {(s, c): ch.recv(lay.epart(rbuf, c, s), ch.prev, tag0 + s * C + c)
             for s in range(P - 1) for c in range(C)}
    sends = []
    for c in range(C):
        codec.encode(lay.part(x, c, (r - 1) % P), lay.epart(S, c, 0))
        sends.append(ch.send(lay.epart(sbuf, c, 0), ch.next, tag0 + c))
    tmp = np.empty(0)
    ok = True
    for s in range(P - 1):
        k = (r - s - 2) % P
        last = s == P - 2
        for c in range(C):
            yield recvs[s, c]
            if last:
                acc = lay.part(res, c)
            else:
                if tmp.shape[0] < lay.counts[c]:
                    tmp = _empty_like(res, lay.counts[0])
                acc = tmp[:lay.counts[c]]
            intact = codec.decode(lay.epart(R, c, s), acc)
            acc += lay.part(x, c, k)
            if last:
                ok &= intact
            else:
                codec.encode(acc, lay.epart(S, c, s + 1))
                sends.append(ch.send(lay.epart(sbuf, c, s + 1), ch.next, tag0 + (s + 1) * C + c))
    yield sends
    return bool(ok)


def a2a_reduce_scatter(ch, lay: Layout, x, res, tag0: int = 0):
    """One all-to-all of encoded blocks; the own block enters the sum exact."""
    codec, P, r = lay.codec, ch.size, ch.rank
    sbuf, rbuf = ch.staging(P * lay.nbytes), ch.staging(P * lay.nbytes)
    S, R = sbuf.array(), rbuf.array()
    for k in range(P):
        if k != r:
            for c in range(lay.chunks):
                codec.encode(lay.part(x, c, k), lay.epart(S, c, k))
    if P > 1:
        yield ch.all_to_all(rbuf, sbuf)
    res[...] = x[r * lay.n:(r + 1) * lay.n]
    tmp = _empty_like(res, lay.n)
    ok = True
    for k in range(P):
        if k != r:
            for c in range(lay.chunks):
                t = lay.part(tmp, c)
                ok &= codec.decode(lay.epart(R, c, k), t)
                lay.part(res, c)[...] += t
    return bool(ok)


def coll_all_gather(ch, lay: Layout, x, res, tag0: int = 0):
    """Encode once, one backend all-gather of the bytes, decode all P blocks."""
    codec, P = lay.codec, ch.size
    sbuf, rbuf = ch.staging(lay.nbytes), ch.staging(P * lay.nbytes)
    S, R = sbuf.array(), rbuf.array()
    for c in range(lay.chunks):
        codec.encode(lay.part(x, c), lay.epart(S, c))
    if P > 1:
        yield ch.all_gather(rbuf, sbuf)
    else:
        R[...] = S
    ok = True
    for k in range(P):
        for c in range(lay.chunks):
            ok &= codec.decode(lay.epart(R, c, k), lay.part(res, c, k))
    return bool(ok)


def all_reduce(ch, lay: Layout, x, res, algorithm: str):
    """Reduce-scatter then all-gather of the reduced blocks. ``x``: P*n values (padded),
    ``res``: P*n values out. The all-gather phase uses its own tag range."""
    mine = _empty_like(res, lay.n)
    if algorithm == "a2a":
        ok = yield from a2a_reduce_scatter(ch, lay, x, mine)
        ok &= yield from coll_all_gather(ch, lay, mine, res)
    else:
        ok = yield from ring_reduce_scatter(ch, lay, x, mine)
        ok &= yield from ring_all_gather(ch, lay, mine, res, per_hop=algorithm == "p2p",
                                         tag0=512)
    return bool(ok)


def _empty_like(arr, n: int):
    xp = np if isinstance(arr, np.ndarray) else __import__("cupy")
    return xp.empty(n, arr.dtype)
