"""ReduceSum over `axes`, with or without keep_dims."""
from __future__ import annotations

import numpy as np

from ..dtypes import FLOAT_TYPES
from .kinds import OpKind
from .schema import Attr, OpSchema, cast_output, normalize_axis, register, to_compute


def _axes(attrs, rank, where):
    axes = sorted({normalize_axis(a, rank, where, "axes entry") for a in attrs["axes"]})
    if not axes:
        raise ValueError(f"{where}: axes must name at least one axis")
    return axes


def infer(attrs, shapes, where):
    shape = shapes[0]
    axes = _axes(attrs, len(shape), where)
    if attrs["keep_dims"]:
        return [tuple(1 if i in axes else d for i, d in enumerate(shape))]
    return [tuple(d for i, d in enumerate(shape) if i not in axes)]


def check_dtypes(attrs, ins, outs, where):
    if ins[0] not in FLOAT_TYPES or outs[0] not in FLOAT_TYPES:
        raise TypeError(f"{where}: input and output must be float, got {ins[0].value} -> {outs[0].value}")


def reference(attrs, ins, outs):
    axes = tuple(_axes(attrs, ins[0].ndim, "ReduceSum"))
    return [cast_output(np.sum(to_compute(ins[0]), axis=axes, keepdims=attrs["keep_dims"]), outs[0])]


register(OpSchema(OpKind.ReduceSum, (1, 1), (1, 1),
                  {"axes": Attr(list, required=True), "keep_dims": Attr(bool, default=False)},
                  infer, check_dtypes, reference))
