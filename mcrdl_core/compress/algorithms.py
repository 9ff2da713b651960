"""Compressed all-gather and reduce-scatter over any backend's point-to-point calls.

Each algorithm is a generator run by :class:`~.schedule.ScheduleWork`: it yields the
Works it must see completed and returns True, or False when a block could not be
carried (zfp on NaN/Inf). ``P`` ranks, this rank ``r``; ``next = r+1``, ``prev = r-1``
(mod P). Every rank's block of ``n`` elements is cut into chunks (``Layout``): each
chunk is encoded, sent and decoded on its own, so the codec's work on one chunk overlaps
the transfer of another. On host backends (MPI, Gloo) all receives are posted up front
(each into its own slot), so a message never waits for its receive to be posted; on a
stream-ordered one (NCCL, which has ``batch_p2p``) each receive is issued in one group
with the send of the same step, since a receive queued ahead of a send on the
communicator's stream would block it (``_Posts``).

- ``ring_all_gather`` (the seed paper's collective compression): encode the own block
  once; at step s forward the bytes of block (r-s-1) unchanged; decode every block once,
  the own one too from its own bytes, so every rank ends with bit-identical results and
  the error does not grow with P. With ``per_hop`` (the paper's point-to-point baseline)
  each received block is decoded and re-encoded before it is forwarded, and the own
  block is kept exact.
- ``ring_reduce_scatter``: at step s receive the encoded partial sum of block (r-s-2),
  decode, add the own contribution in full precision, re-encode and forward; the last
  step's sum (this rank's own block) is never re-encoded. It is decoded into a
  temporary and summed into the result, so the result may be a view of the input's
  own block (in-place reduce-scatter, as NCCL, Megatron and FSDP1 call it). P-1 quantizations of partial
  sums reach each result.
- ``a2a_reduce_scatter`` (ZeRO++ qgZ style): encode the P blocks once, one all-to-all
  of the bytes, decode and sum in full precision: one quantization per contribution.
- ``coll_all_gather`` (qwZ style): encode once, one backend all-gather of the bytes,
  decode every block.
- ``all_to_all`` (even and uneven splits): encode each destination's block once, send
  it on its own (host backends) or in one backend all-to-all of the encoded bytes
  (byte counts per peer computed by every rank from its own splits,
  ``spec.plan_all_to_all``), decode each received block in place as it arrives.
The uncompressed ring is ``ring_*`` with the ``none`` codec (same code, raw bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schedule import AnyOf, Ordered


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


class _Posts:
    """The sends and receives of a ring: ``send(s, c, buf)`` sends chunk c of step s to
    the next rank; ``recv(s, c)`` is the Work receiving chunk c of step s from the
    previous rank into ``rslot(s, c)``."""

    def __init__(self, ch, steps: int, chunks: int, rslot, tag0: int):
        self.ch, self.rslot, self.tag0, self.chunks = ch, rslot, tag0, chunks
        self.steps = steps
        self.recvs, self.sends = {}, []
        if ch.prepost:
            for s in range(steps):
                for c in range(chunks):
                    self.recvs[s, c] = ch.recv(rslot(s, c), ch.prev, self.tag(s, c))

    def tag(self, s: int, c: int) -> int:
        return self.tag0 + s * self.chunks + c

    def send(self, s: int, c: int, buf) -> None:
        ch = self.ch
        if ch.prepost:
            self.sends.append(ch.send(buf, ch.next, self.tag(s, c)))
        else:
            w = ch.sendrecv(buf, ch.next, self.rslot(s, c), ch.prev, self.tag(s, c))
            self.sends.append(w)
            self.recvs[s, c] = w

    def recv(self, s: int, c: int):
        """What to yield for the receive of chunk c of step s: on the paired schedule,
        before a later step's send, an ``Ordered`` wait (that send is matched by order on
        the stream: ``schedule.Ordered``)."""
        w = self.recvs[s, c]
        return w if self.ch.prepost or s == self.steps - 1 else Ordered((w,))


def ring_all_gather(ch, lay: Layout, x, res, per_hop: bool = False, tag0: int = 0):
    """``x``: this rank's n values; ``res``: P*n values out (work dtype)."""
    codec, P, r, C = lay.codec, ch.size, ch.rank, lay.chunks
    enc = ch.staging(P * lay.nbytes)
    A = enc.array()
    ok = True
    ring = _Posts(ch, P - 1, C, lambda s, c: lay.epart(enc, c, (r - s - 1) % P), tag0)
    for c in range(C):
        codec.encode(lay.part(x, c), lay.epart(A, c, r))
        if P > 1:
            ring.send(0, c, lay.epart(enc, c, r))
    for c in range(C):
        if per_hop:
            lay.part(res, c, r)[...] = lay.part(x, c)
        else:
            ok &= codec.decode(lay.epart(A, c, r), lay.part(res, c, r))
    for s in range(P - 1):
        k = (r - s - 1) % P
        for c in range(C):
            yield ring.recv(s, c)
            out = lay.part(res, c, k)
            if per_hop or s == P - 2:
                ok &= codec.decode(lay.epart(A, c, k), out)
            if s < P - 2:
                if per_hop:
                    codec.encode(out, lay.epart(A, c, k))
                ring.send(s + 1, c, lay.epart(enc, c, k))
                if not per_hop:
                    ok &= codec.decode(lay.epart(A, c, k), out)
    yield ring.sends
    return bool(ok)


def ring_reduce_scatter(ch, lay: Layout, x, res, tag0: int = 0):
    """``x``: P*n values in; ``res``: this rank's n summed values out (work dtype)."""
    codec, P, r, C = lay.codec, ch.size, ch.rank, lay.chunks
    if P == 1:
        res[...] = x
        return True
    rbuf, sbuf = ch.staging((P - 1) * lay.nbytes), ch.staging((P - 1) * lay.nbytes)
    R, S = rbuf.array(), sbuf.array()
    ring = _Posts(ch, P - 1, C, lambda s, c: lay.epart(rbuf, c, s), tag0)
    for c in range(C):
        codec.encode(lay.part(x, c, (r - 1) % P), lay.epart(S, c, 0))
        ring.send(0, c, lay.epart(sbuf, c, 0))
    tmp = _empty_like(res, 0)  # (res's dtype: an integer sum stays integer, 0 elements too)
    ok = True
    for s in range(P - 1):
        k = (r - s - 2) % P
        last = s == P - 2
        for c in range(C):
            yield ring.recv(s, c)
            if tmp.shape[0] < lay.counts[c]:
                tmp = _empty_like(res, lay.counts[0])
            acc = tmp[:lay.counts[c]]
            intact = codec.decode(lay.epart(R, c, s), acc)
            if last:  # into the result only now: it may be a view of x's own block
                ok &= intact
                xp_add(acc, lay.part(x, c, k), out=lay.part(res, c))
            else:
                acc += lay.part(x, c, k)
                codec.encode(acc, lay.epart(S, c, s + 1))
                ring.send(s + 1, c, lay.epart(sbuf, c, s + 1))
    yield ring.sends
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


def all_to_all(ch, codec, p, x, res):
    """``x``: the ``sum(p.in_counts)`` values this rank sends, block k for rank k;
    ``res``: the ``sum(p.out_counts)`` values it receives (work dtype; ``p``: the
    ``A2APlan`` made with ``codec``). Each block for another rank is encoded once and
    decoded once by its receiver; blocks the plan marks exact (same-host peers, where
    the group spans hosts; then the own block too) travel as their raw bytes. The own
    block, when not exact, is encoded and decoded here, so it is the same round trip
    as every other and never moves. On a host backend with tagged point-to-point
    (MPI, Gloo: ``Channel.direct_p2p``) and host arrays, ``_p2p_all_to_all`` moves
    the blocks; else (NCCL's ordered streams, CUDA arrays) one backend all-to-all
    (Alltoallv over the encoded bytes) does. Every read of ``x`` comes before the first
    write of ``res``, so the two may share memory (``all_to_all_single(x, x)``)."""
    if ch.direct_p2p() and isinstance(x, np.ndarray) and isinstance(res, np.ndarray):
        return (yield from _p2p_all_to_all(ch, codec, p, x, res))
    P, r = ch.size, ch.rank
    exact = p.exact or (False,) * P
    ioff, ooff = _offsets(p.in_counts), _offsets(p.out_counts)
    send, recv = list(p.send_bytes), list(p.recv_bytes)
    if not any(send) and not any(recv):
        # A rank with nothing to send or receive sends itself 8 bytes: with all its
        # counts equal, the mpi backend would issue Alltoall where its peers issue
        # Alltoallv (it decides from the local counts), and the group would hang. With
        # the own block's count at 0, a rank that moves anything never looks even.
        send[r] = recv[r] = 8
    soff, roff = _offsets(send), _offsets(recv)
    sbuf, rbuf = ch.staging(soff[-1]), ch.staging(roff[-1])
    S, R = sbuf.array(), rbuf.array()
    for k in range(P):
        if k != r and send[k]:
            _pack(codec, exact[k], x[ioff[k]:ioff[k + 1]], S[soff[k]:soff[k + 1]])
    work = ch.all_to_all(rbuf, sbuf, recv, send) if P > 1 else None
    ok = _own_block(ch, codec, exact[r], x[ioff[r]:ioff[r + 1]], res[ooff[r]:ooff[r + 1]])
    if work is not None:
        yield work
    for k in range(P):
        if k != r and recv[k]:
            ok &= _unpack(codec, exact[k], R[roff[k]:roff[k + 1]], res[ooff[k]:ooff[k + 1]])
    return bool(ok)


def _p2p_all_to_all(ch, codec, p, x, res):
    """``all_to_all`` as one tagged send and receive per peer (host backends). Every
    receive is posted first; then each block is encoded and its send posted at once,
    so the first is on the wire while the next is encoded; each received block is
    decoded as soon as it is in (``schedule.AnyOf``), while the others still arrive.
    Peers are served in ring order from an offset set by this rank's place among the
    ranks of its host, so that at each step of two or more hosts every rank sends to
    a different peer rather than all of a host's ranks to the same one first. Raw
    (exact) blocks go straight from ``x`` to ``res`` where they do not overlap
    (``_direct``), else through staging copies like the encoded ones. At 1 Gbit/s
    (4 MiB per rank, 2 hosts x 2 ranks and 4 x 1) this is 7-11% faster than one
    backend Alltoallv of the same bytes, and no slower on one host or at 10 Gbit/s
    (docs/compression.md, "All-to-all on 2 hosts x 2 ranks")."""
    P, r = ch.size, ch.rank
    exact = p.exact or (False,) * P
    ioff, ooff = _offsets(p.in_counts), _offsets(p.out_counts)
    straight = any(exact[k] for k in range(P) if k != r) and _direct(x, res)
    raw = [k != r and exact[k] and straight for k in range(P)]
    send = [0 if k == r or raw[k] else b for k, b in enumerate(p.send_bytes)]
    recv = [0 if k == r or raw[k] else b for k, b in enumerate(p.recv_bytes)]
    soff, roff = _offsets(send), _offsets(recv)
    S, R = ch.staging(soff[-1]).array(), ch.staging(roff[-1]).array()
    receives = []  # (peer, Work)
    for k in range(P):
        if k == r or not p.recv_bytes[k]:
            continue
        into = res[ooff[k]:ooff[k + 1]] if raw[k] else R[roff[k]:roff[k + 1]]
        receives.append((k, ch.a2a_p2p(False, into, k, 1)))
    sends = []
    for k in _send_order(P, r, exact):
        if not p.send_bytes[k]:
            continue
        if raw[k]:
            sends.append(ch.a2a_p2p(True, x[ioff[k]:ioff[k + 1]], k, 1))
        else:
            _pack(codec, exact[k], x[ioff[k]:ioff[k + 1]], S[soff[k]:soff[k + 1]])
            sends.append(ch.a2a_p2p(True, S[soff[k]:soff[k + 1]], k, 1))
    ok = _own_block(ch, codec, exact[r], x[ioff[r]:ioff[r + 1]], res[ooff[r]:ooff[r + 1]])
    while receives:
        if not any(w.done for _, w in receives):
            yield AnyOf([w for _, w in receives], [k for k, _ in receives])
        left = []
        for k, w in receives:
            if not w.done:
                left.append((k, w))
            elif w.error is not None:
                raise w.error
            elif not raw[k]:
                ok &= _unpack(codec, exact[k], R[roff[k]:roff[k + 1]],
                              res[ooff[k]:ooff[k + 1]])
        receives = left
    if sends:
        yield sends
    return bool(ok)


def _send_order(P: int, r: int, exact) -> list:
    """The peers this rank sends to, in ring order (r+1, r+2, ...) with the encoded
    ones (other hosts') rotated by this rank's place among the exact ones (its host's),
    then the exact ones: on hosts of contiguous ranks, each rank's first encoded block
    goes to a different peer."""
    ring = [(r + j) % P for j in range(1, P)]
    enc = [k for k in ring if not exact[k]]
    local = sum(1 for k in range(r) if exact[k])  # this rank's place on its host
    if enc:
        i = local % len(enc)
        enc = enc[i:] + enc[:i]
    return enc + [k for k in ring if exact[k]]


def _pack(codec, exact: bool, block, out) -> None:
    """A block into its bytes for the wire: raw where exact, else encoded."""
    if exact:
        out[...] = block.view(out.dtype)
    else:
        codec.encode(block, out)


def _unpack(codec, exact: bool, data, block) -> bool:
    """The inverse of ``_pack`` into ``block``; False where the codec could not
    carry it (zfp on NaN/Inf)."""
    if exact:
        block.view(data.dtype)[...] = data
        return True
    return codec.decode(data, block)


def _own_block(ch, codec, exact: bool, block, out) -> bool:
    """This rank's own block into ``out``: copied where exact (NumPy's assignment
    buffers overlapping memory; CuPy's may not), else its codec round trip."""
    if exact:
        out[...] = block if isinstance(out, np.ndarray) else block.copy()
        return True
    own = ch.staging(codec.encoded_nbytes(block.shape[0])).array()
    codec.encode(block, own)
    return codec.decode(own, out)


def _direct(x, res) -> bool:
    """Whether the raw blocks of a per-peer all-to-all (host arrays on a backend with
    tagged point-to-point: ``all_to_all`` checked both) can go straight from ``x`` to
    ``res``: C-contiguous, in memory that does not overlap (an in-place call reads
    every block before it writes one, which only the staging copies allow)."""
    return (x.flags.c_contiguous and res.flags.c_contiguous
            and not np.may_share_memory(x, res))


def _offsets(counts) -> list:
    """Start of each block, and the total at the end."""
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64))).tolist()


def all_reduce(ch, lay: Layout, x, res, algorithm: str):
    """Reduce-scatter then all-gather of the reduced blocks. ``x``: P*n values (padded),
    ``res``: P*n values out. The all-gather phase uses its own tag range. Where it
    starts with a call matched by order (a2a's backend all-gather; the paired ring's
    first send), every wait of the reduce-scatter before it is ``Ordered``: the
    all-gather is issued inside the call, at its place among the group's calls."""
    mine = _empty_like(res, lay.n)
    if algorithm == "a2a":
        ok = yield from _before_ordered(a2a_reduce_scatter(ch, lay, x, mine))
        ok &= yield from coll_all_gather(ch, lay, mine, res)
    else:
        rs = ring_reduce_scatter(ch, lay, x, mine)
        ok = yield from (rs if ch.prepost else _before_ordered(rs))
        ok &= yield from ring_all_gather(ch, lay, mine, res, per_hop=algorithm == "p2p",
                                         tag0=512)
    return bool(ok)


def _before_ordered(gen):
    """``gen``'s schedule with every wait marked ``Ordered``: what comes after it starts
    with a call matched by order."""
    while True:
        try:
            w = next(gen)
        except StopIteration as stop:
            return stop.value
        yield w if isinstance(w, Ordered) else Ordered(w if isinstance(w, (list, tuple))
                                                       else (w,))


def xp_add(a, b, out):
    """``out = a + b`` with the array module of ``out`` (NumPy or CuPy)."""
    (np if isinstance(out, np.ndarray) else __import__("cupy")).add(a, b, out=out)


def _empty_like(arr, n: int):
    xp = np if isinstance(arr, np.ndarray) else __import__("cupy")
    return xp.empty(n, arr.dtype)
