"""SoftMax (with the optional f32 logsumexp `stats` output) and SoftMaxBackward.

SoftMax modes: "none" follows the formula literally, so a row whose inputs
are all -inf gives NaN; "inf_as_zero" gives 0 for such a row and stats -inf.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import DataType, FLOAT_TYPES
from .kinds import OpKind
from .schema import Attr, OpSchema, cast_output, normalize_axis, register, to_compute


def infer_softmax(attrs, shapes, where):
    shape = shapes[0]
    axis = normalize_axis(attrs["axis"], len(shape), where)
    stats = shape[:axis] + (1,) + shape[axis + 1:]
    return [shape, stats]


def check_softmax(attrs, ins, outs, where):
    if ins[0] not in FLOAT_TYPES or outs[0] not in FLOAT_TYPES:
        raise TypeError(f"{where}: src and dst must be float, got {ins[0].value} -> {outs[0].value}")
    if len(outs) > 1 and outs[1] != DataType.f32:
        raise TypeError(f"{where}: output 1 (stats) must be f32, got {outs[1].value}")


def reference_softmax(attrs, ins, outs):
    x = to_compute(ins[0])
    axis = attrs["axis"]
    with np.errstate(all="ignore"):
        row_max = np.max(x, axis=axis, keepdims=True)
        if attrs["mode"] == "inf_as_zero":
            all_masked = np.isneginf(row_max)
            shifted = np.exp(x - np.where(all_masked, 0.0, row_max))
            total = np.sum(shifted, axis=axis, keepdims=True)
            dst = np.where(all_masked, 0.0, shifted / np.where(all_masked, 1.0, total))
            stats = np.where(all_masked, -np.inf, row_max + np.log(total))
        else:
            shifted = np.exp(x - row_max)
            total = np.sum(shifted, axis=axis, keepdims=True)
            dst = shifted / total
            stats = row_max + np.log(total)
    results = [cast_output(dst, outs[0])]
    if len(outs) > 1:
        results.append(cast_output(stats, outs[1]))
    return results


def infer_softmax_backward(attrs, shapes, where):
    if shapes[0] != shapes[1]:
        raise ValueError(f"{where}: diff_dst {shapes[0]} and dst {shapes[1]} must have the same shape")
    normalize_axis(attrs["axis"], len(shapes[0]), where)
    return [shapes[0]]


def check_softmax_backward(attrs, ins, outs, where):
    if any(d not in FLOAT_TYPES for d in list(ins) + list(outs)):
        raise TypeError(f"{where}: diff_dst, dst and diff_src must be float")


def reference_softmax_backward(attrs, ins, outs):
    diff_dst, dst = (to_compute(x) for x in ins)
    dot = np.sum(diff_dst * dst, axis=attrs["axis"], keepdims=True)
    return [cast_output(dst * (diff_dst - dot), outs[0])]


register(OpSchema(OpKind.SoftMax, (1, 1), (1, 2),
                  {"axis": Attr(int, default=1), "mode": Attr(str, default="none", choices=("none", "inf_as_zero"))},
                  infer_softmax, check_softmax, reference_softmax))
register(OpSchema(OpKind.SoftMaxBackward, (2, 2), (1, 1), {"axis": Attr(int, default=1)},
                  infer_softmax_backward, check_softmax_backward, reference_softmax_backward))
