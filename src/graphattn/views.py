"""Shape rules for strided views: when a reshape or transpose needs no copy, and the strides it gives.

The fused kernels fold StaticReshape / StaticTranspose chains into strides
with these functions, in both directions (inputs forward, outputs backward).
"""
from __future__ import annotations

from typing import Sequence

from .logical_tensor import dense_strides


def reshape_groups(shape: Sequence[int], new_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The dims of size two or more of shape and new_shape (same element count, none 0) paired into groups
    that a reshape merges or splits into each other: (old axes, new axes), outermost group first."""
    old_axes = [i for i, d in enumerate(shape) if d != 1]
    new_axes = [i for i, d in enumerate(new_shape) if d != 1]
    groups = []
    oi = ni = 0
    while oi < len(old_axes) and ni < len(new_axes):
        oj, nj = oi + 1, ni + 1
        old_size, new_size = shape[old_axes[oi]], new_shape[new_axes[ni]]
        while old_size != new_size:
            if new_size < old_size:
                new_size *= new_shape[new_axes[nj]]
                nj += 1
            else:
                old_size *= shape[old_axes[oj]]
                oj += 1
        groups.append((old_axes[oi:oj], new_axes[ni:nj]))
        oi, ni = oj, nj
    return groups


def reshape_strides(shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Strides of a view of (shape, strides) reshaped to new_shape, or None if that needs a copy.

    Groups of old dims that merge or split into new dims must be laid out
    contiguously relative to each other; size-1 dims never constrain.
    """
    if any(d == 0 for d in shape):
        return dense_strides(new_shape)
    result = [0] * len(new_shape)
    for old, new in reshape_groups(shape, new_shape):
        # merged dims: each outer stride is the next inner one times that dim's size
        if any(strides[a] != shape[b] * strides[b] for a, b in zip(old, old[1:])):
            return None
        stride = strides[old[-1]]
        for axis in reversed(new):
            result[axis] = stride
            stride *= new_shape[axis]
    return tuple(result)


def reshape_origin(shape: Sequence[int], origin: Sequence, new_shape: Sequence[int]) -> tuple[tuple, tuple]:
    """reshape_strides on stride sources instead of strides: origin gives each dim of shape as (array axis,
    multiplier) of some array's strides, None for a size-1 dim.  Returns new_shape's origin and the folds the
    array's strides must keep for the reshape to need no copy: (outer source, inner source, inner size), the
    outer stride being the inner one times that size."""
    result: list = [None] * len(new_shape)
    folds = []
    for old, new in reshape_groups(shape, new_shape):
        folds.extend((origin[a], origin[b], shape[b]) for a, b in zip(old, old[1:]))
        axis, multiplier = origin[old[-1]]
        for k in reversed(new):
            result[k] = (axis, multiplier)
            multiplier *= new_shape[k]
    return tuple(result), tuple(folds)


def transpose_strides(strides: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides after StaticTranspose(order): output axis k is input axis order[k]."""
    return tuple(strides[a] for a in order)


def untranspose_strides(strides: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The input strides that StaticTranspose(order) maps to the given output strides."""
    result = [0] * len(order)
    for k, axis in enumerate(order):
        result[axis] = strides[k]
    return tuple(result)


def overlaps_itself(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two indices of a tensor of this shape and strides (any unit) may reach one location.

    The dims of size two or more, in increasing |stride|, must each step over everything the dims before it
    reach: |stride| > the sum of |stride| * (size - 1) over them.  Every dense, transposed, sliced or negative
    stride layout passes; a broadcast (stride 0) does not.  Exotic interleavings that never collide fail it too,
    which only costs a copy.
    """
    if 0 in shape:
        return False
    reach = 0
    for stride, size in sorted([(abs(s), d) for d, s in zip(shape, strides) if d > 1]):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False
