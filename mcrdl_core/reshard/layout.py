"""Layouts: where each piece of a global tensor lives.

A :class:`Mesh` is an N-d array of global ranks with one name per axis (JAX's ``Mesh``,
torch's ``DeviceMesh``). A :class:`Layout` says, for every dimension of the tensor,
which mesh axes split it (JAX ``PartitionSpec`` style: ``None`` or ``()`` = not split,
``"x"`` or ``("x", "y")`` = split over those axes, the first one major); mesh axes that
split no dimension replicate the data.

Uneven sizes are allowed, as in JAX and DTensor: a dimension of ``n`` elements split
``k`` ways gets blocks of ``ceil(n / k)``, the last ones shorter or empty.
``chunking`` says how a dimension split over several axes is cut:

- ``"flat"`` (JAX): one cut into ``k = prod(axis sizes)`` blocks of ``ceil(n / k)``;
- ``"nested"`` (DTensor): cut over the first axis (``torch.chunk``), then each piece
  over the next axis, and so on.

Both give, per dimension, ordered intervals (``bounds``) indexed by the mixed-radix
position of a rank on the splitting axes, which is what the planner bisects.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..base.errors import InvalidArgumentError


class Mesh:
    """An N-d array of distinct global ranks with named axes.

    ``ranks``: nested lists or an integer array; ``axis_names``: one name per axis
    (default ``("d0", "d1", ...)``)."""

    __slots__ = ("ranks", "axis_names", "shape", "_coords", "_key")

    def __init__(self, ranks, axis_names: Sequence[str] | None = None):
        arr = np.asarray(ranks)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"Mesh: ranks must be integers, got dtype {arr.dtype}; "
                                       "pass an integer array of global ranks")
        arr = arr.astype(np.int64)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        names = tuple(axis_names) if axis_names is not None else tuple(
            f"d{i}" for i in range(arr.ndim))
        if len(names) != arr.ndim:
            raise InvalidArgumentError(f"Mesh: {len(names)} axis names {names} for a mesh of "
                                       f"{arr.ndim} axes (shape {arr.shape}); give one per axis")
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"Mesh: axis names {names} repeat; make them distinct")
        if arr.size == 0:
            raise InvalidArgumentError("Mesh: a mesh needs at least one rank")
        flat = arr.reshape(-1)
        if (flat < 0).any():
            raise InvalidArgumentError(f"Mesh: negative ranks in {arr.tolist()}")
        if len(np.unique(flat)) != flat.size:
            raise InvalidArgumentError(f"Mesh: ranks {arr.tolist()} repeat; a rank may appear "
                                       "once in a mesh")
        self.ranks = arr
        self.axis_names = names
        self.shape = tuple(arr.shape)
        self._coords = None
        self._key = None

    @property
    def size(self) -> int:
        return int(self.ranks.size)

    def rank_list(self) -> list[int]:
        """The ranks in row-major order."""
        return self.ranks.reshape(-1).tolist()

    def coords(self) -> dict:
        """{rank: its coordinates (a tuple of ints)}."""
        if self._coords is None:
            idx = np.array(np.unravel_index(np.arange(self.size), self.shape)).T.tolist()
            self._coords = dict(zip(self.rank_list(), map(tuple, idx)))
        return self._coords

    def axis_size(self, name: str) -> int:
        try:
            return self.shape[self.axis_names.index(name)]
        except ValueError:
            raise InvalidArgumentError(f"mesh axis {name!r} is not one of {self.axis_names}; "
                                       "name an axis of the mesh") from None

    def key(self) -> tuple:
        if self._key is None:
            self._key = (self.shape, self.axis_names, tuple(self.rank_list()))
        return self._key

    def to_dict(self) -> dict:
        return {"ranks": self.ranks.tolist(), "axis_names": list(self.axis_names)}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        return cls(d["ranks"], d["axis_names"])

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"Mesh({axes}; ranks {self.ranks.tolist()})"


def _norm_entry(entry, dim: int) -> tuple:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    try:
        out = tuple(entry)
    except TypeError:
        raise InvalidArgumentError(f"spec entry {entry!r} for dimension {dim} must be None, an "
                                   "axis name or a tuple of axis names") from None
    for a in out:
        if not isinstance(a, str):
            raise InvalidArgumentError(f"spec entry {entry!r} for dimension {dim} holds "
                                       f"{a!r}; use mesh axis names (strings)")
    return out


def chunk_bounds(n: int, sizes: Sequence[int], chunking: str) -> list[int]:
    """Boundaries (``prod(sizes) + 1`` non-decreasing ints from 0 to ``n``) of the blocks
    of a dimension of ``n`` elements split over axes of ``sizes`` (first major)."""
    k = math.prod(sizes)
    if chunking == "flat" or len(sizes) <= 1:
        step = -(-n // k) if k else 0
        return [min(i * step, n) for i in range(k + 1)]
    bounds = [0, n]
    for s in sizes:  # nested: cut every current piece into s pieces (torch.chunk)
        nxt = [0]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            step = -(-(hi - lo) // s)
            nxt.extend(min(lo + (i + 1) * step, hi) for i in range(s))
        bounds = nxt
    return bounds


class Layout:
    """A mesh plus, per tensor dimension, the mesh axes that split it.

    ``spec``: one entry per tensor dimension (``None``, an axis name, or a tuple of axis
    names, the first major); shorter specs are padded with ``None``. ``chunking``:
    ``"flat"`` (JAX) or ``"nested"`` (DTensor), which differ only for uneven sizes split
    over more than one axis."""

    __slots__ = ("mesh", "spec", "chunking", "_key")

    def __init__(self, mesh: Mesh, spec: Sequence = (), chunking: str = "flat"):
        if not isinstance(mesh, Mesh):
            raise InvalidArgumentError(f"Layout: mesh must be a mcrdl_core.reshard.Mesh, got "
                                       f"{type(mesh).__name__} (convert JAX/torch meshes with "
                                       "mcrdl_jax.layout / mcrdl_torch.layout)")
        if chunking not in ("flat", "nested"):
            raise InvalidArgumentError(f"Layout: chunking={chunking!r}; use 'flat' (JAX) or "
                                       "'nested' (DTensor)")
        spec = tuple(_norm_entry(e, d) for d, e in enumerate(spec))
        used = [a for e in spec for a in e]
        for a in used:
            mesh.axis_size(a)  # raises for unknown axes
        if len(set(used)) != len(used):
            raise InvalidArgumentError(f"Layout: spec {spec} uses a mesh axis twice; each axis "
                                       "may split one dimension at most")
        self.mesh = mesh
        self.spec = spec
        self.chunking = chunking
        self._key = None

    @classmethod
    def replicated(cls, mesh: Mesh) -> "Layout":
        return cls(mesh, ())

    def dim_spec(self, ndim: int) -> tuple:
        """The spec padded (with ``()``) to ``ndim`` dimensions; error if longer."""
        if len(self.spec) > ndim:
            if any(self.spec[ndim:]):
                raise InvalidArgumentError(f"layout spec {self.spec} has {len(self.spec)} entries "
                                           f"for a tensor of {ndim} dimensions; give at most one "
                                           "per dimension")
            return self.spec[:ndim]
        return self.spec + ((),) * (ndim - len(self.spec))

    def bounds(self, shape: Sequence[int]) -> list[list[int]]:
        """Per dimension, the block boundaries (see :func:`chunk_bounds`)."""
        spec = self.dim_spec(len(shape))
        return [chunk_bounds(int(n), [self.mesh.axis_size(a) for a in e], self.chunking)
                for n, e in zip(shape, spec)]

    def tile_index_array(self, shape: Sequence[int]) -> np.ndarray:
        """Per dimension, the block index of every rank of the mesh in row-major order:
        an int64 array (tensor dimensions, mesh size)."""
        spec = self.dim_spec(len(shape))
        axes = self.mesh.axis_names
        sizes = self.mesh.shape
        coords = np.indices(sizes).reshape(len(sizes), -1)  # (mesh axes, ranks)
        idx = np.zeros((len(spec), coords.shape[1]), dtype=np.int64)
        for d, e in enumerate(spec):  # mixed radix over the axes, the first major
            for a in e:
                i = axes.index(a)
                idx[d] = idx[d] * sizes[i] + coords[i]
        return idx

    def tile_index(self, shape: Sequence[int]) -> dict:
        """{rank: per-dimension block index (a tuple)}; ranks with equal tuples are replicas."""
        idx = self.tile_index_array(shape)
        return dict(zip(self.mesh.rank_list(), map(tuple, idx.T.tolist())))

    def tile(self, shape: Sequence[int], rank: int) -> tuple | None:
        """The box ``((lo, hi), ...)`` that ``rank`` holds, or None if not in the mesh."""
        idx = self.tile_index(shape).get(int(rank))
        if idx is None:
            return None
        b = self.bounds(shape)
        return tuple((bd[i], bd[i + 1]) for bd, i in zip(b, idx))

    def key(self) -> tuple:
        if self._key is None:
            self._key = (self.mesh.key(), self.spec, self.chunking)
        return self._key

    def to_dict(self) -> dict:
        return {"mesh": self.mesh.to_dict(), "spec": [list(e) for e in self.spec],
                "chunking": self.chunking}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(Mesh.from_dict(d["mesh"]), [tuple(e) for e in d["spec"]], d["chunking"])

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        spec = ", ".join("None" if not e else (e[0] if len(e) == 1 else str(e)) for e in self.spec)
        return f"Layout({self.mesh!r}, spec=({spec}), {self.chunking})"


def box_shape(box) -> tuple:
    return tuple(hi - lo for lo, hi in box)
