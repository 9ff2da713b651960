"""The facts the fast path needs of a tensor, read in one call where it can be.

``one(t)``: ``(address, numel)`` of a strided, contiguous CPU tensor that is not nested,
else None (a nested tensor of strided layout has an address and an element count but no
one shape: the general path refuses it, the same on every call).
``two(out, inp)``: ``(address, numel, dim 0)`` of each of two such tensors of one dtype
(dim 0 is 1 for a 0-d tensor), else None.
``many(ts, like, types, writes)``: the *list facts* of a list or tuple of such tensors,
each of a type in ``types`` (exactly: ``tensors.PLAIN``) and of ``like``'s dtype:
``(addresses, element counts, the common count or -1, run, lo, hi, spans)`` (``run``:
each starts where the previous one ends, in list order; ``[lo, hi)``: the span of the
non-empty ones, (0, 0) if none; ``spans``: each one's ``(lo, hi, writes)``), else None
(``fastpath``'s list forms).
None sends the frontend to its general path,
which checks everything and raises its errors. The caller has checked that the
arguments are plain tensors (``tensors.PLAIN``).

Where ``tensor_facts`` (``facts.cpp``, built by ``python -m mcrdl_torch.build``) is
built for the torch in use, these are its functions: one C call reads the at::Tensor
behind the Python object, about 0.1 µs, where the same reads from Python are one torch
call per fact (0.3 µs for one tensor, 1.2 for two). Otherwise they are the Python forms below,
which give the same results (tests/test_torch_facts.py holds the two together).
"""
from __future__ import annotations

import torch

_STRIDED = torch.strided


def _one(t):
    if t.layout is _STRIDED and not t.is_nested and t.is_cpu and t.is_contiguous():
        return t.data_ptr(), t.numel()
    return None


def _two(out, inp):
    if (out.layout is _STRIDED and inp.layout is _STRIDED and not out.is_nested
            and not inp.is_nested and out.is_cpu and inp.is_cpu and out.dtype is inp.dtype and out.is_contiguous() and inp.is_contiguous()):
        return (out.data_ptr(), out.numel(), out.shape[0] if out.dim() else 1,
                inp.data_ptr(), inp.numel(), inp.shape[0] if inp.dim() else 1)
    return None


def _many(ts, like, types, writes):
    if type(ts) not in (list, tuple) or not isinstance(like, torch.Tensor):
        return None
    kind = like.dtype
    ptrs, counts, spans = [], [], []
    run, nxt, lo, hi = bool(ts), None, 0, 0
    for t in ts:
        if type(t) not in types or t.dtype is not kind or _one(t) is None:
            return None
        p, c = t.data_ptr(), t.numel()
        ptrs.append(p)
        counts.append(c)
        if nxt is not None and p != nxt:
            run = False
        nxt = p + c * t.element_size()
        spans.append((p, nxt, bool(writes)))
        if c:
            lo, hi = (p, nxt) if lo == hi else (min(lo, p), max(hi, nxt))
    common = counts[0] if counts and counts.count(counts[0]) == len(counts) else -1
    return tuple(ptrs), tuple(counts), common, run, lo, hi, tuple(spans)


def _load():
    """(the compiled module or None, why): refused where built for another torch or
    from another version of facts.cpp."""
    try:
        from . import tensor_facts as compiled_facts
    except ImportError as exc:
        return None, f"not built ({exc}): run python -m mcrdl_torch.build"
    if getattr(compiled_facts, "VERSION", None) != 4:  # 4: many (list facts, spans)
        return None, "built from another version of facts.cpp: rerun python -m mcrdl_torch.build"
    if compiled_facts.TORCH_VERSION != torch.__version__:
        return None, (f"built for torch {compiled_facts.TORCH_VERSION}, this is "
                      f"{torch.__version__}: rerun python -m mcrdl_torch.build")
    return compiled_facts, "built"


_COMPILED = _load()


def compiled():
    """(the compiled module or None, why not) (``mcrdl info`` reports it)."""
    return _COMPILED


one, two, many = ((_one, _two, _many) if _COMPILED[0] is None else
                  (_COMPILED[0].one, _COMPILED[0].two, _COMPILED[0].many))
