"""Dropout(src, seed, offset; p) -> dst[, mask]: Philox keep-mask, kept values scaled by 1/(1-p)."""
from __future__ import annotations

import numpy as np

from ..dtypes import DataType, FLOAT_TYPES
from .kinds import OpKind
from .philox import dropout_keep_mask
from .schema import Attr, OpSchema, cast_output, register, to_compute


def infer(attrs, shapes, where):
    if not 0.0 <= attrs["p"] < 1.0:
        raise ValueError(f"{where}: p must be in [0, 1), got {attrs['p']}")
    for name, shape in (("seed", shapes[1]), ("offset", shapes[2])):
        if int(np.prod(shape, dtype=np.int64)) != 1:
            raise ValueError(f"{where}: {name} must hold exactly one element, got shape {shape}")
    return [shapes[0], shapes[0]]


def check_dtypes(attrs, ins, outs, where):
    if ins[0] not in FLOAT_TYPES or outs[0] != ins[0]:
        raise TypeError(f"{where}: src must be float and dst of the same dtype, got {ins[0].value} -> {outs[0].value}")
    if ins[1] != DataType.s64 or ins[2] != DataType.s64:
        raise TypeError(f"{where}: seed and offset must be s64, got {ins[1].value} and {ins[2].value}")
    if len(outs) > 1 and outs[1] not in FLOAT_TYPES | {DataType.boolean}:
        raise TypeError(f"{where}: mask must be f32, bf16, f16 or boolean, got {outs[1].value}")


def reference(attrs, ins, outs):
    src = to_compute(ins[0])
    p = attrs["p"]
    keep = dropout_keep_mask(src.shape, p, int(ins[1].reshape(-1)[0]), int(ins[2].reshape(-1)[0]))
    results = [cast_output(np.where(keep, src / (1.0 - p), 0.0), outs[0])]
    if len(outs) > 1:
        results.append(cast_output(keep, outs[1]))
    return results


register(OpSchema(OpKind.Dropout, (3, 3), (1, 2), {"p": Attr(float, required=True)}, infer, check_dtypes, reference))
