"""LogicalTensor: the id, dtype, shape and layout of a tensor, with no data."""
from __future__ import annotations

import enum
from typing import Sequence

from .dtypes import DataType, as_data_type


class Layout(enum.Enum):
    strided = "strided"
    any = "any"


class Property(enum.Enum):
    variable = "variable"
    constant = "constant"


UNKNOWN_DIM = -1


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a dense tensor of this shape."""
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(int(dim), 1)
    return tuple(reversed(strides))


def _enum_value(kind, value, what):
    if isinstance(value, kind):
        return value
    name = str(value).rsplit(".", 1)[-1] if isinstance(value, enum.Enum) else value
    try:
        return kind(name)
    except ValueError:
        raise ValueError(f"{what} must be one of {[m.value for m in kind]}, got {value!r}") from None


class LogicalTensor:
    """A tensor's metadata.  Shapes may hold -1 (unknown) until compilation.

    ``strides`` are in elements; None means dense row-major (computed once the
    shape is known).
    """

    __slots__ = ("id", "dtype", "shape", "_strides", "layout", "property")

    def __init__(self, id: int, dtype, shape: Sequence[int], strides: Sequence[int] | None = None,
                 layout="strided", property="variable"):
        if not isinstance(id, int) or isinstance(id, bool) or id < 0:
            raise TypeError(f"logical tensor id must be a non-negative int, got {id!r}")
        self.id = id
        self.dtype: DataType = as_data_type(dtype)
        try:
            self.shape = tuple(int(d) for d in shape)
        except TypeError:
            raise TypeError(f"logical tensor {id}: shape must be a sequence of ints, got {shape!r}") from None
        if any(d < UNKNOWN_DIM for d in self.shape):
            raise ValueError(f"logical tensor {id}: dims must be >= 0 or -1 (unknown), got {self.shape}")
        if strides is not None:
            strides = tuple(int(s) for s in strides)
            if len(strides) != len(self.shape):
                raise ValueError(f"logical tensor {id}: {len(strides)} strides for a rank-{len(self.shape)} shape")
        self._strides = strides
        self.layout: Layout = _enum_value(Layout, layout, f"logical tensor {id}: layout")
        self.property: Property = _enum_value(Property, property, f"logical tensor {id}: property")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strides(self) -> tuple[int, ...] | None:
        if self._strides is not None:
            return self._strides
        if self.is_shape_known():
            return dense_strides(self.shape)
        return None

    @property
    def has_explicit_strides(self) -> bool:
        return self._strides is not None

    def is_shape_known(self) -> bool:
        """True when no dimension is -1 (unknown)."""
        return all(d != UNKNOWN_DIM for d in self.shape)

    def numel(self) -> int:
        """Number of elements (the shape must be known)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def with_shape(self, shape: Sequence[int], strides: Sequence[int] | None = None) -> "LogicalTensor":
        """A copy with this concrete shape (and strides, dense row-major if None)."""
        return LogicalTensor(self.id, self.dtype, shape, strides, self.layout, self.property)

    def concrete(self, shape: tuple, strides: tuple) -> "LogicalTensor":
        """A copy with this shape and these element strides, tuples of ints the caller took from an array
        (nothing is checked: a replayed compile's fast path)."""
        lt = LogicalTensor.__new__(LogicalTensor)
        lt.id, lt.dtype, lt.shape, lt._strides, lt.layout, lt.property = (self.id, self.dtype, shape, strides,
                                                                          self.layout, self.property)
        return lt

    def __repr__(self) -> str:
        strides = f", strides={self._strides}" if self._strides is not None else ""
        return f"LogicalTensor(id={self.id}, dtype={self.dtype.value}, shape={self.shape}{strides})"
