"""Operations and reduction operators."""
from __future__ import annotations

import enum

from .errors import InvalidArgumentError


class Op(enum.Enum):
    SEND = "send"
    RECV = "recv"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    GATHER = "gather"
    SCATTER = "scatter"
    BARRIER = "barrier"

    def __str__(self) -> str:
        return self.value

    __hash__ = object.__hash__  # as ReduceOp's, below


#: ops whose result depends on a ReduceOp
REDUCING = frozenset({Op.REDUCE, Op.ALL_REDUCE, Op.REDUCE_SCATTER})


class ReduceOp(enum.Enum):
    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __str__(self) -> str:
        return self.value

    # members are singletons compared by identity: hash them so too, in C (Enum's own
    # __hash__ is Python code, about 0.4 µs a dict lookup on the fast path)
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, value) -> "ReduceOp":
        """Accept a ReduceOp, its name ('sum', 'SUM'), or any object whose ``name`` or
        string form ends in one (torch.distributed.ReduceOp.SUM prints as
        'RedOpType.SUM')."""
        if isinstance(value, cls):
            return value
        text = str(getattr(value, "name", value)).rsplit(".", 1)[-1].lower()
        if text == "prod":
            text = "product"
        try:
            return cls(text)
        except ValueError:
            raise InvalidArgumentError(
                f"unknown reduce op {value!r}; use one of {[o.name for o in cls]}") from None


#: reduce ops that only make sense on integers (bitwise)
BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
