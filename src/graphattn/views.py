"""Shape rules for strided views: when a reshape or transpose needs no copy, and the strides it gives.

The fused kernels fold StaticReshape / StaticTranspose chains into strides
with these functions, in both directions (inputs forward, outputs backward).
"""
from __future__ import annotations

from typing import Sequence

from .logical_tensor import dense_strides


def reshape_strides(shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Strides of a view of (shape, strides) reshaped to new_shape, or None if that needs a copy.

    Groups of old dims that merge or split into new dims must be laid out
    contiguously relative to each other; size-1 dims never constrain.
    """
    if any(d == 0 for d in shape):
        return dense_strides(new_shape)
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    new_axes = [i for i, d in enumerate(new_shape) if d != 1]
    new_dims = [new_shape[i] for i in new_axes]
    result = [0] * len(new_shape)
    oi = ni = 0
    while oi < len(old) and ni < len(new_dims):
        oj, nj = oi + 1, ni + 1
        old_size, new_size = old[oi][0], new_dims[ni]
        while old_size != new_size:
            if new_size < old_size:
                new_size *= new_dims[nj]
                nj += 1
            else:
                old_size *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        stride = old[oj - 1][1]
        for k in range(nj - 1, ni - 1, -1):
            result[new_axes[k]] = stride
            stride *= new_dims[k]
        oi, ni = oj, nj
    return tuple(result)


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
    if any(d == 0 for d in shape):
        return False
    reach = 0
    for size, stride in sorted(((d, abs(s)) for d, s in zip(shape, strides) if d > 1), key=lambda x: x[1]):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False
