"""Types of the IR: named tensor dimensions, tensor types and shardings.

A :class:`TensorType` is the *global, logical* type of a tensor (the shape the
single-device model would see); a :class:`Sharding` says how that tensor lives on the
device mesh, in the style of Mesh-TensorFlow layouts and JAX ``PartitionSpec``: each
tensor dim may be split over one mesh axis or over several nested ones (JAX's
``P(("cp", "tp"))``: ``seq`` over cp, each cp rank's part again over tp, as
Megatron-Core's sequence parallelism with context parallelism keeps the residual
stream), and a set of axes may still hold partial sums. Sharding never changes the
type; :meth:`Sharding.local_type` derives the per-rank type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from parcompile.core.dtypes import DTYPE_BYTES

#: how one dim is split: one mesh axis (``"tp"``), or several nested, outermost first
#: (``("cp", "tp")``: cp rank i holds its part of the dim, split again over tp; the local
#: size is ``size / (cp * tp)``). A one-axis split is always the plain string.
SplitAxes = str | tuple[str, ...]


def split_axes(a: SplitAxes | None) -> tuple[str, ...]:
    """The axes of a dim's split, outermost first: ``"tp"`` -> ``("tp",)``, None -> ``()``."""
    if a is None:
        return ()
    return (a,) if isinstance(a, str) else tuple(a)


def _split_value(axes: tuple[str, ...]) -> SplitAxes:
    return axes[0] if len(axes) == 1 else tuple(axes)


class ShardingError(ValueError):
    """A sharding does not fit a tensor: a dim does not divide, or an axis is used twice.

    ``axis`` names the mesh axis at fault (for diagnostics at the user's ``parallel.<axis>``).
    """

    def __init__(self, message: str, axis: str | None = None):
        super().__init__(message)
        self.axis = axis


@dataclass(frozen=True)
class Dim:
    """A named tensor dimension of ``size`` elements.

    ``unit`` is the granularity a split must respect: a ``q`` dim of ``heads * head_dim``
    elements has ``unit = head_dim``, so it only splits into whole heads.
    """

    name: str
    size: int
    unit: int = 1

    def __str__(self) -> str:
        return f"{self.name}={self.size}"


@dataclass(frozen=True)
class TensorType:
    """A tensor's global type: ordered named dims and a dtype (``fp32``, ``bf16``, ``int64`` ...)."""

    dims: tuple[Dim, ...]
    dtype: str

    def __hash__(self) -> int:
        # computed once: types key the local-type memo, hashed many times per compile
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dims, self.dtype))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # the cached hash depends on the process's string hashing: never pickle it
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate dim names in {names}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Size in bytes: ``numel * itemsize``."""
        return self.numel * self.itemsize

    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(f"no dim {name!r} in {self}")

    def has_dim(self, name: str) -> bool:
        return any(d.name == name for d in self.dims)

    def replace_dim(self, name: str, new: Dim) -> "TensorType":
        """The same type with dim ``name`` replaced by ``new``."""
        return TensorType(tuple(new if d.name == name else d for d in self.dims), self.dtype)

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.dims, dtype)

    def __str__(self) -> str:
        return "[" + ", ".join(str(d) for d in self.dims) + f"] {self.dtype}"


@dataclass(frozen=True)
class Sharding:
    """How a tensor lives on the mesh: ``split`` maps dim name -> mesh axis, or a tuple
    of nested axes (:data:`SplitAxes`; stored as sorted pairs so the object hashes),
    ``partial`` is the set of axes whose ranks hold partial sums. An axis splits at most
    one dim (once) and is never both split and partial.

    Build one with :meth:`make`; :data:`REPLICATED` is the empty sharding.
    """

    split: tuple[tuple[str, str], ...] = ()
    partial: frozenset[str] = field(default_factory=frozenset)

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.split, self.partial))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # the cached hash depends on the process's string hashing: never pickle it
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __post_init__(self) -> None:
        axes = [a for _, v in self.split for a in split_axes(v)]
        if len(set(axes)) != len(axes):
            raise ShardingError(f"a mesh axis splits two dims in {self}")
        dims = [d for d, _ in self.split]
        if len(set(dims)) != len(dims):
            raise ShardingError(f"a dim is split twice in {self}")
        both = set(axes) & set(self.partial)
        if both:
            raise ShardingError(f"axis {sorted(both)[0]} is both split and partial in {self}")

    @classmethod
    def make(cls, split: Mapping[str, SplitAxes] | None = None, partial: Iterable[str] = ()) -> "Sharding":
        """``Sharding.make({"seq": "tp"}, partial={"dp"})``; ``{"seq": ("cp", "tp")}``
        splits seq over cp and then over tp (a one-axis tuple is the plain axis)."""
        items = ((d, _split_value(split_axes(a))) for d, a in (split or {}).items() if split_axes(a))
        return cls(tuple(sorted(items)), frozenset(partial))

    @property
    def split_map(self) -> dict[str, SplitAxes]:
        """dim name -> axis (a tuple for a nested split)."""
        return dict(self.split)

    def axis_of(self, dim: str) -> SplitAxes | None:
        """The axis splitting ``dim`` (a tuple, outermost first, when nested), or None."""
        return self.split_map.get(dim)

    def axes_of(self, dim: str) -> tuple[str, ...]:
        """The axes splitting ``dim``, outermost first (``()``: not split)."""
        return split_axes(self.split_map.get(dim))

    def dim_of(self, axis: str) -> str | None:
        """The dim that ``axis`` splits (alone or nested with others), or None."""
        for d, a in self.split:
            if axis in split_axes(a):
                return d
        return None

    def outer_axes(self, axis: str) -> tuple[str, ...]:
        """The axes a nested split puts outside ``axis`` on its dim (``seq: cp*tp``:
        ``("cp",)`` for tp, ``()`` for cp); ``()`` when ``axis`` splits nothing."""
        d = self.dim_of(axis)
        if d is None:
            return ()
        axes = self.axes_of(d)
        return axes[:axes.index(axis)]

    @property
    def axes(self) -> set[str]:
        """Every axis this sharding mentions (split or partial)."""
        return {a for _, v in self.split for a in split_axes(v)} | set(self.partial)

    def with_split(self, dim: str, axis: str) -> "Sharding":
        """This sharding with ``dim`` split over ``axis`` too: a dim not split yet is split
        over ``axis``; a dim already split over other axes is split again inside them
        (``{seq:cp}.with_split("seq", "tp")`` is ``seq: cp*tp``, tp innermost); a dim
        already split over ``axis`` stays as it is."""
        key = (self, 0, dim, axis)
        got = _DERIVED.get(key)
        if got is None:
            m = self.split_map
            have = split_axes(m.get(dim))
            m[dim] = have if axis in have else have + (axis,)
            got = _derived(key, Sharding.make(m, self.partial))
        return got

    def without_split(self, dim: str) -> "Sharding":
        key = (self, 1, dim)
        got = _DERIVED.get(key)
        if got is None:
            m = self.split_map
            m.pop(dim, None)
            got = _derived(key, Sharding.make(m, self.partial))
        return got

    def with_partial(self, axis: str) -> "Sharding":
        key = (self, 2, axis)
        got = _DERIVED.get(key)
        if got is None:
            got = _derived(key, Sharding.make(self.split_map, set(self.partial) | {axis}))
        return got

    def without_partial(self) -> "Sharding":
        key = (self, 3)
        got = _DERIVED.get(key)
        if got is None:
            got = _derived(key, Sharding.make(self.split_map, ()))
        return got

    def restricted_to(self, dims: Iterable[str]) -> "Sharding":
        """Keep only the splits of ``dims`` (partial axes kept)."""
        keep = set(dims)
        return Sharding.make({d: a for d, a in self.split if d in keep}, self.partial)

    def local_type(self, ttype: TensorType, degrees: Mapping[str, int]) -> TensorType:
        """The per-rank type of ``ttype`` under this sharding on a mesh of ``degrees``.

        Raises:
            ShardingError: a split dim does not divide by its axis degree (message names
                both numbers), or a split names a dim the type lacks.
        """
        if not self.split:
            return ttype
        key = (self, ttype, tuple(degrees.get(a, 1) for _, v in self.split for a in split_axes(v)))
        got = _LOCAL_TYPES.get(key)
        if got is None:
            got = self._local_type(ttype, degrees)
            if len(_LOCAL_TYPES) > 200_000:
                _LOCAL_TYPES.clear()
            _LOCAL_TYPES[key] = got
        return got

    def _local_type(self, ttype: TensorType, degrees: Mapping[str, int]) -> TensorType:
        """:meth:`local_type` without the cache."""
        smap = self.split_map
        for d in smap:
            if not ttype.has_dim(d):
                raise ShardingError(f"sharding {self} splits dim {d!r}, which {ttype} lacks", smap[d])
        dims = []
        for d in ttype.dims:
            axes = [a for a in split_axes(smap.get(d.name)) if degrees.get(a, 1) > 1]
            n = math.prod(degrees[a] for a in axes)
            if n == 1:
                dims.append(d)
                continue
            units = d.size // d.unit
            if d.size % d.unit or units % n:
                what = f"{units} units of {d.unit}" if d.unit > 1 else f"{d.size}"
                by = " * ".join(f"{a} = {degrees[a]}" for a in axes)
                if len(axes) > 1:
                    by += f" ({n})"
                # the axis at fault: the innermost whose cumulative split no longer divides
                cum, bad = 1, axes[-1]
                for a in axes:
                    cum *= degrees[a]
                    if d.size % d.unit or units % cum:
                        bad = a
                        break
                raise ShardingError(f"dim {d.name} of size {what} does not divide by {by}", bad)
            dims.append(Dim(d.name, d.size // n, d.unit))
        return TensorType(tuple(dims), ttype.dtype)

    def __str__(self) -> str:
        parts = [f"{d}:{'*'.join(split_axes(a))}" for d, a in self.split]
        parts += [f"partial:{a}" for a in sorted(self.partial)]
        return "{" + ",".join(parts) + "}" if parts else "R"


REPLICATED = Sharding()

#: (sharding, type, degrees of its split axes) -> local type: every pass and analysis
#: asks the same few questions thousands of times (memoised; failures are not cached)
#: memo of Sharding.with_split / without_split / with_partial / without_partial (the
#: passes derive the same few layouts thousands of times); bounded like _LOCAL_TYPES
_DERIVED: dict[tuple, "Sharding"] = {}


def _derived(key: tuple, value: "Sharding") -> "Sharding":
    if len(_DERIVED) > 100_000:
        _DERIVED.clear()
    _DERIVED[key] = value
    return value


_LOCAL_TYPES: dict[tuple, TensorType] = {}
