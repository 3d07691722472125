"""GenIndex: the index along `axis` of every element of its input (s32)."""
from __future__ import annotations

import numpy as np

from ..dtypes import DataType
from .kinds import OpKind
from .schema import Attr, OpSchema, normalize_axis, register


def infer(attrs, shapes, where):
    normalize_axis(attrs["axis"], len(shapes[0]), where)
    return [shapes[0]]


def check_dtypes(attrs, ins, outs, where):
    if outs[0] != DataType.s32:
        raise TypeError(f"{where}: output must be s32, got {outs[0].value}")


def reference(attrs, ins, outs):
    shape = ins[0].shape
    axis = normalize_axis(attrs["axis"], len(shape), "GenIndex")
    index_shape = [1] * len(shape)
    index_shape[axis] = shape[axis]
    index = np.arange(shape[axis], dtype=np.int32).reshape(index_shape)
    return [np.broadcast_to(index, shape).copy()]


register(OpSchema(OpKind.GenIndex, (1, 1), (1, 1), {"axis": Attr(int, required=True)}, infer, check_dtypes, reference))
