"""MatMul with transpose_a / transpose_b and broadcast batch dims."""
from __future__ import annotations

import numpy as np

from ..dtypes import DataType, FLOAT_TYPES
from .broadcast import broadcast_shapes
from .schema import Attr, OpSchema, cast_output, register, to_compute
from .kinds import OpKind


def _matrix_shape(shape, transpose):
    return shape[:-2] + (shape[-1], shape[-2]) if transpose else shape


def infer(attrs, shapes, where):
    a, b = shapes
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"{where}: inputs need rank >= 2, got shapes {a} and {b}")
    a = _matrix_shape(a, attrs["transpose_a"])
    b = _matrix_shape(b, attrs["transpose_b"])
    if a[-1] != b[-2]:
        raise ValueError(f"{where}: contraction dims differ: src {a} and weights {b} "
                         f"(after transpose_a={attrs['transpose_a']}, transpose_b={attrs['transpose_b']})")
    batch = broadcast_shapes([a[:-2], b[:-2]], where)
    return [batch + (a[-2], b[-1])]


def check_dtypes(attrs, ins, outs, where):
    if ins[0] not in FLOAT_TYPES or ins[0] != ins[1]:
        raise TypeError(f"{where}: inputs must share one float dtype (f32, bf16, f16), got {[d.value for d in ins]}")
    if outs[0] not in (ins[0], DataType.f32):
        raise TypeError(f"{where}: output dtype must be {ins[0].value} or f32, got {outs[0].value}")


def reference(attrs, ins, outs):
    a, b = (to_compute(x) for x in ins)
    if attrs["transpose_a"]:
        a = np.swapaxes(a, -1, -2)
    if attrs["transpose_b"]:
        b = np.swapaxes(b, -1, -2)
    return [cast_output(np.matmul(a, b), outs[0])]


register(OpSchema(OpKind.MatMul, (2, 2), (1, 1),
                  {"transpose_a": Attr(bool, default=False), "transpose_b": Attr(bool, default=False)},
                  infer, check_dtypes, reference))
