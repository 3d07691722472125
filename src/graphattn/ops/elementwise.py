"""Element-wise ops: arithmetic, comparisons, Select, Exp and TypeCast."""
from __future__ import annotations

import numpy as np

from ..dtypes import DataType, FLOAT_TYPES, INTEGER_TYPES
from .broadcast import broadcast_shapes
from .kinds import OpKind
from .schema import Attr, OpSchema, cast_output, register, to_compute

BROADCAST_ATTR = {"auto_broadcast": Attr(str, default="numpy", choices=("numpy", "none"))}


def infer_broadcast(attrs, shapes, where):
    return [broadcast_shapes(shapes, where, attrs["auto_broadcast"])]


def infer_same(attrs, shapes, where):
    return [shapes[0]]


def _same_class(ins, where):
    if all(d in FLOAT_TYPES for d in ins):
        return FLOAT_TYPES
    if all(d in INTEGER_TYPES for d in ins):
        return INTEGER_TYPES
    raise TypeError(f"{where}: inputs must be all float or all integer, got {[d.value for d in ins]}")


def check_arithmetic(attrs, ins, outs, where):
    family = _same_class(ins, where)
    if family is FLOAT_TYPES and outs[0] not in set(ins) | {DataType.f32}:
        raise TypeError(f"{where}: output dtype must be f32 or an input dtype, got {outs[0].value}")
    if family is INTEGER_TYPES and outs[0] not in INTEGER_TYPES:
        raise TypeError(f"{where}: integer inputs need an s32 or s64 output, got {outs[0].value}")


def check_compare(attrs, ins, outs, where):
    _same_class(ins, where)
    if outs[0] != DataType.boolean:
        raise TypeError(f"{where}: output must be boolean, got {outs[0].value}")


def check_select(attrs, ins, outs, where):
    if ins[0] != DataType.boolean:
        raise TypeError(f"{where}: input 0 (cond) must be boolean, got {ins[0].value}")
    check_arithmetic(attrs, ins[1:], outs, where)


def check_float_unary(attrs, ins, outs, where):
    if ins[0] not in FLOAT_TYPES or outs[0] not in FLOAT_TYPES:
        raise TypeError(f"{where}: input and output must be float, got {ins[0].value} -> {outs[0].value}")


def _binary(fn):
    def reference(attrs, ins, outs):
        with np.errstate(all="ignore"):
            return [cast_output(fn(to_compute(ins[0]), to_compute(ins[1])), outs[0])]
    return reference


def _divide(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return np.floor_divide(a, b)
    return a / b


def reference_select(attrs, ins, outs):
    return [cast_output(np.where(ins[0], to_compute(ins[1]), to_compute(ins[2])), outs[0])]


def _unary(fn):
    def reference(attrs, ins, outs):
        with np.errstate(all="ignore"):
            return [cast_output(fn(to_compute(ins[0])), outs[0])]
    return reference


def reference_typecast(attrs, ins, outs):
    return [cast_output(to_compute(ins[0]), outs[0])]


for kind, fn in ((OpKind.Add, np.add), (OpKind.Subtract, np.subtract), (OpKind.Multiply, np.multiply),
                 (OpKind.Divide, _divide)):
    register(OpSchema(kind, (2, 2), (1, 1), BROADCAST_ATTR, infer_broadcast, check_arithmetic, _binary(fn)))

for kind, fn in ((OpKind.GreaterEqual, np.greater_equal), (OpKind.GreaterThan, np.greater)):
    register(OpSchema(kind, (2, 2), (1, 1), BROADCAST_ATTR, infer_broadcast, check_compare, _binary(fn)))

register(OpSchema(OpKind.Select, (3, 3), (1, 1), BROADCAST_ATTR, infer_broadcast, check_select, reference_select))
for kind, fn in ((OpKind.Exp, np.exp), (OpKind.Tanh, np.tanh)):
    register(OpSchema(kind, (1, 1), (1, 1), {}, infer_same, check_float_unary, _unary(fn)))
register(OpSchema(OpKind.TypeCast, (1, 1), (1, 1), {}, infer_same, check_float_unary, reference_typecast))
