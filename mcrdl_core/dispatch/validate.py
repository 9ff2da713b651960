"""Argument checks run before anything is sent. Each raises a clear error."""
from __future__ import annotations

from ..base import dtypes as _dt
from ..memory import alloc
from ..memory.buffer import Buffer, as_buffer
from ..base.errors import DtypeError, InvalidArgumentError, UnsupportedError
from ..base.ops import BITWISE, ReduceOp
from ..memory import cuda


def output(obj, what: str) -> Buffer:
    """A Buffer the call will write: must be contiguous and writable."""
    buf = as_buffer(obj)
    if buf.readonly:
        raise InvalidArgumentError(f"{what} is read-only ({buf.describe()}); pass a writable "
                                   "array (e.g. a copy) to receive the result")
    if not buf.is_contiguous:
        raise InvalidArgumentError(f"{what} is not contiguous ({buf.describe()}); pass "
                                   "tensor.contiguous() and copy the result back")
    dtype(buf, what)
    return buf


def input(obj, what: str) -> Buffer:
    """A Buffer the call only reads. A non-contiguous input is copied to a contiguous
    one (documented; torch.distributed would refuse it)."""
    buf = as_buffer(obj)
    dtype(buf, what)
    if not buf.is_contiguous:
        if buf.device.kind == "cuda":
            return contiguous_cuda_copy(buf)
        import numpy as np

        copy = Buffer.from_numpy(np.ascontiguousarray(buf.host()))
        copy.dtype = buf.dtype
        return copy
    return buf


def contiguous_cuda_copy(buf: Buffer) -> Buffer:
    """A contiguous copy of a strided CUDA buffer, made on its producer stream (after
    the producer's pending writes, never on whatever stream CuPy happens to have
    current), in memory allocated on that stream; the copy is stamped with it, so
    whoever reads the copy waits there."""
    tmp = alloc.empty(buf.shape, buf.dtype, buf.device, like=buf)
    with cuda.copies_into([tmp], [buf]):
        tmp.cuda()[...] = buf.cuda()
    return tmp


def dtype(buf: Buffer, what: str) -> None:
    if buf.dtype not in _dt.SUPPORTED:
        raise DtypeError(f"{what} has dtype {buf.dtype.name}, which MCR-DL does not communicate; "
                         f"use one of {[d.name for d in _dt.SUPPORTED]}")


def same_kind(bufs, what: str) -> None:
    """All buffers of one call share dtype and device."""
    first = bufs[0]
    for b in bufs[1:]:
        if b.dtype is not first.dtype:
            raise InvalidArgumentError(f"{what}: dtypes differ ({first.dtype.name} vs "
                                       f"{b.dtype.name}); use one dtype for every tensor")
        if b.device != first.device:
            raise InvalidArgumentError(f"{what}: devices differ ({first.device} vs {b.device}); "
                                       "put every tensor of the call on one device")


def numel(buf: Buffer, expected: int, what: str, why: str) -> None:
    if buf.numel != expected:
        raise InvalidArgumentError(f"{what} has {buf.numel} elements ({buf.describe()}) but "
                                   f"{expected} are needed: {why}")


def reduce_op(op: ReduceOp, dt: _dt.DType) -> None:
    if op is ReduceOp.AVG and not dt.is_floating:
        raise UnsupportedError(f"ReduceOp.AVG needs a floating dtype, got {dt.name}; use SUM "
                               "and divide, or cast to a float type")
    if op in BITWISE and not dt.is_integral:
        raise UnsupportedError(f"ReduceOp.{op.name} is bitwise and needs an integer dtype, got "
                               f"{dt.name}")


def same_list(bufs, what: str) -> None:
    """Tensors of a list argument must all have the same number of elements."""
    if not bufs:
        raise InvalidArgumentError(f"{what} is empty")
    n = bufs[0].numel
    for i, b in enumerate(bufs):
        if b.numel != n:
            raise InvalidArgumentError(f"{what}[{i}] has {b.numel} elements but {what}[0] has "
                                       f"{n}; every tensor in the list must be the same size")


def splits(sizes, buf: Buffer, n: int, what: str) -> list[int]:
    """Element counts per peer from torch-style split sizes along dim 0 (None = even)."""
    rows = buf.shape[0] if buf.shape else 1
    per_row = buf.numel // rows if rows else 0
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise InvalidArgumentError(f"{what}: dim 0 ({rows}) is not divisible by the group "
                                       f"size {n}; pass split sizes for uneven all-to-all")
        return [rows // n * per_row] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise InvalidArgumentError(f"{what}: {len(sizes)} split sizes for a group of {n}; give "
                                   "one per rank")
    if any(s < 0 for s in sizes):
        raise InvalidArgumentError(f"{what}: negative split size in {sizes}")
    if sum(sizes) != rows:
        raise InvalidArgumentError(f"{what}: split sizes {sizes} sum to {sum(sizes)} but dim 0 of "
                                   f"the tensor is {rows}; they must add up to it")
    return [s * per_row for s in sizes]


def own_block(out_counts, in_counts, rank: int, what: str) -> None:
    """All-to-all: the block a rank sends itself is the block it receives from itself,
    so both split lists must give it the same element count (else the local copy would
    overrun one buffer). Raised before anything is launched."""
    if in_counts[rank] != out_counts[rank]:
        raise InvalidArgumentError(
            f"{what}: rank {rank} sends itself {in_counts[rank]} elements but expects "
            f"{out_counts[rank]} from itself (input_split_sizes[{rank}] vs "
            f"output_split_sizes[{rank}]); make the two split sizes of its own block equal")


def blocks(out: Buffer, inp: Buffer, out_counts, in_counts, rank: int, even: bool,
           what: str) -> None:
    """All-to-all: the blocks this rank exchanges fit, as torch requires, checked for
    every backend before anything is sent: without split sizes (``even``), an output as
    large as the input (every rank sends and receives equal blocks: a larger output
    would keep a part never written, a smaller one overrun); and the block this rank
    sends itself as large as the one it expects from itself (``own_block``). A check of
    this rank's own arguments: the api runs it after the debug checks (MCRDL_DEBUG),
    which see every rank's counts and name the ranks that disagree; the fast path never
    sends what fails here (it leaves such calls to the general path)."""
    if even and out.numel != inp.numel:
        raise InvalidArgumentError(
            f"{what}: output has {out.numel} elements ({out.describe()}) but input has "
            f"{inp.numel} ({inp.describe()}); without split sizes every rank sends and "
            "receives equal blocks, so the two must be the same size: pass "
            "output_split_sizes and input_split_sizes for an uneven exchange")
    own_block(out_counts, in_counts, rank, what)
