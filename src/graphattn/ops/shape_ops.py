"""StaticReshape and StaticTranspose: layout-only ops (the fused kernels fold them into strides)."""
from __future__ import annotations

import numpy as np

from .kinds import OpKind
from .schema import Attr, OpSchema, normalize_axis, register


def reshape_target(in_shape, target, special_zero, where):
    """The concrete output shape of StaticReshape (0 copies a dim with special_zero, one -1 is inferred)."""
    out = []
    for axis, dim in enumerate(target):
        if dim == 0 and special_zero:
            if axis >= len(in_shape):
                raise ValueError(f"{where}: shape entry 0 at axis {axis} has no input dim to copy (input {in_shape})")
            out.append(in_shape[axis])
        elif dim < -1:
            raise ValueError(f"{where}: shape entries must be >= -1, got {list(target)}")
        else:
            out.append(dim)
    total = int(np.prod(in_shape, dtype=np.int64))
    if out.count(-1) > 1:
        raise ValueError(f"{where}: at most one shape entry may be -1, got {list(target)}")
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        if known == 0 or total % known:
            raise ValueError(f"{where}: cannot infer the -1 entry of {list(target)} for input {in_shape}")
        out[out.index(-1)] = total // known
    if int(np.prod(out, dtype=np.int64)) != total:
        raise ValueError(f"{where}: cannot reshape {in_shape} ({total} elements) to {tuple(out)}")
    return tuple(out)


def infer_reshape(attrs, shapes, where):
    return [reshape_target(shapes[0], attrs["shape"], attrs["special_zero"], where)]


def check_same_dtype(attrs, ins, outs, where):
    if ins[0] != outs[0]:
        raise TypeError(f"{where}: output dtype {outs[0].value} must equal the input's {ins[0].value}")


def reference_reshape(attrs, ins, outs):
    target = reshape_target(ins[0].shape, attrs["shape"], attrs["special_zero"], "StaticReshape")
    return [np.reshape(ins[0], target)]


def transpose_order(order, rank, where):
    perm = [normalize_axis(a, rank, where, "order entry") for a in order]
    if sorted(perm) != list(range(rank)):
        raise ValueError(f"{where}: order {list(order)} is not a permutation of {rank} axes")
    return perm


def infer_transpose(attrs, shapes, where):
    perm = transpose_order(attrs["order"], len(shapes[0]), where)
    return [tuple(shapes[0][a] for a in perm)]


def reference_transpose(attrs, ins, outs):
    return [np.transpose(ins[0], transpose_order(attrs["order"], ins[0].ndim, "StaticTranspose"))]


register(OpSchema(OpKind.StaticReshape, (1, 1), (1, 1),
                  {"shape": Attr(list, required=True), "special_zero": Attr(bool, default=False)},
                  infer_reshape, check_same_dtype, reference_reshape))
register(OpSchema(OpKind.StaticTranspose, (1, 1), (1, 1), {"order": Attr(list, required=True)},
                  infer_transpose, check_same_dtype, reference_transpose))
