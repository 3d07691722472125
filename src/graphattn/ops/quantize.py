"""DynamicDequantize (oneDNN Graph): quantized values to floats by scales and zero points given as inputs.

    dst = (src - zps) * scales

with one scale (and zero point) for the whole tensor (qtype "per_tensor": shape (1,)), one per index of dim
`axis` ("per_channel": shape (src.shape[axis],)), or one per group ("per_group": shape src.shape divided
element-wise by `group_shape`, whose entries are 1 but in one of the last two dims, the group size there).
src is u8, s8, u4 or s4; scales f32, bf16 or f16, the output's dtype; zps (optional, else 0) u8, s8, s32, u4
or s4.  The compressed-KV patterns that fuse it into SDPA are in graphattn.kv_quant's reach, not here.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import FLOAT_TYPES, QUANTIZED_TYPES, DataType
from .kinds import OpKind
from .schema import Attr, OpSchema, cast_output, normalize_axis, register

ZERO_POINT_TYPES = QUANTIZED_TYPES | {DataType.s32}


def _params_shape(attrs: dict, src: tuple, where: str) -> tuple:
    """The shape scales and zps must have for this src and these attributes."""
    qtype = attrs["qtype"]
    if qtype == "per_tensor":
        return (1,)
    if qtype == "per_channel":
        return (src[normalize_axis(attrs["axis"], len(src), where)],)
    group = list(attrs["group_shape"] or [])
    if len(group) != len(src):
        raise ValueError(f"{where}: group_shape {group} must have src's rank {len(src)}")
    grouped = [d for d, g in enumerate(group) if g != 1]
    if len(grouped) > 1 or (grouped and grouped[0] < len(src) - 2) or any(g < 1 for g in group):
        raise ValueError(f"{where}: group_shape {group} must be 1 but in one of the last two dims")
    for d, g in enumerate(group):
        if src[d] % g:
            raise ValueError(f"{where}: group_shape {group} does not divide src's shape {src} (dim {d}: the group "
                             f"size {g} must divide {src[d]})")
    return tuple(s // g for s, g in zip(src, group))


def infer(attrs, shapes, where):
    want = _params_shape(attrs, tuple(shapes[0]), where)
    for name, shape in zip(("scales", "zps"), shapes[1:]):
        if tuple(shape) != want:
            raise ValueError(f"{where}: {name} must have shape {want} for qtype {attrs['qtype']}, got {tuple(shape)}")
    return [tuple(shapes[0])]


def check_dtypes(attrs, ins, outs, where):
    if ins[0] not in QUANTIZED_TYPES:
        raise TypeError(f"{where}: src must be u8, s8, u4 or s4, got {ins[0].value}")
    if ins[1] not in FLOAT_TYPES:
        raise TypeError(f"{where}: scales must be f32, bf16 or f16, got {ins[1].value}")
    if outs[0] != ins[1]:
        raise TypeError(f"{where}: the output's dtype must be the scales' ({ins[1].value}), got {outs[0].value}")
    if len(ins) > 2 and ins[2] not in ZERO_POINT_TYPES:
        raise TypeError(f"{where}: zps must be u8, s8, s32, u4 or s4, got {ins[2].value}")


def _expanded(params: np.ndarray, attrs: dict, src_shape: tuple) -> np.ndarray:
    """Scales or zero points broadcast to src's shape by the qtype's rule."""
    qtype = attrs["qtype"]
    if qtype == "per_tensor":
        return params.reshape(())
    if qtype == "per_channel":
        axis = normalize_axis(attrs["axis"], len(src_shape), "DynamicDequantize")
        return params.reshape([-1 if d == axis else 1 for d in range(len(src_shape))])
    out = params
    for d, g in enumerate(attrs["group_shape"]):
        if g != 1:
            out = np.repeat(out, g, axis=d)
    return out


def reference(attrs, ins, outs):
    src = ins[0].astype(np.float64)
    scales = _expanded(ins[1].astype(np.float64), attrs, src.shape)
    zps = 0.0 if len(ins) < 3 else _expanded(ins[2].astype(np.float64), attrs, src.shape)
    return [cast_output((src - zps) * scales, outs[0])]


register(OpSchema(
    OpKind.DynamicDequantize, (2, 3), (1, 1),
    {"qtype": Attr(str, default="per_tensor", choices=("per_tensor", "per_channel", "per_group")),
     "axis": Attr(int, default=1), "group_shape": Attr(list, default=None)},
    infer, check_dtypes, reference))
