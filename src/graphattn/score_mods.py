"""The score modifiers of the functional API: softcap, ALiBi slopes and attention sinks (the rule, in the kernels'
terms: native/cpu/include/graphattn/score_mods.hpp).  Their argument checks and their views as kernel operands live
here, shared by the forward and the backward.

    s = scale * q.k -> softcap: s = c * tanh(s / c) -> ALiBi: s -= slope_h * |i' - j| -> mask, window, causal
    -> softmax with the sink: p_ij = exp(s_ij) / (exp(sigma_h) + sum_k exp(s_ik))

The slopes and sinks are per query head: (H_q,), or (N, H_q) for the slopes.  As kernel operands they take one
element per batch index: their shape with two trailing dims of 1, the heads split into (H_kv, group) under GQA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import arguments, sycl_runtime
from .interop import is_torch_tensor, to_numpy
from .tensor import array_strides

# The per-head operands and their kernel roles.
PER_HEAD = ("alibi_slopes", "sinks")


@dataclass(frozen=True)
class ScoreMods:
    """A call's modifiers, checked: softcap (0.0: none) and the f32 host arrays of the slopes and sinks (None:
    none)."""
    softcap: float = 0.0
    alibi_slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None

    def signature(self) -> tuple:
        """What of the modifiers fixes a plan: the softcap and the per-head arrays' shapes."""
        return (self.softcap, *(None if a is None else a.shape for a in (self.alibi_slopes, self.sinks)))

    def arrays(self, queue=None) -> dict:
        """role -> array, for the per-head operands the call has: the host arrays, or their copies on a SYCL
        queue."""
        arrays = {role: a for role, a in zip(PER_HEAD, (self.alibi_slopes, self.sinks)) if a is not None}
        if queue is None:
            return arrays
        return {role: sycl_runtime.to_device(a, queue) for role, a in arrays.items()}


def softcap_value(value) -> float:
    """softcap as a float: None is 0.0 (no softcap), else a finite value > 0."""
    if value is None:
        return 0.0
    c = arguments.real_number(value, "softcap")
    if not (c > 0.0 and math.isfinite(c)):
        raise ValueError(f"softcap must be a finite float > 0 (None: no softcap), got {c}")
    return c


def checked(softcap, alibi_slopes, sinks, query) -> ScoreMods | None:
    """The modifiers of a call with this query (..., H_q, L, E), or None where it has none.  The slopes and sinks
    become contiguous f32 host arrays (tiny: one value per head); errors speak query's framework."""
    if softcap is None and alibi_slopes is None and sinks is None:
        return None
    query_shape, kind = tuple(query.shape), "torch" if is_torch_tensor(query) else "numpy"
    if len(query_shape) < 3:
        raise ValueError(f"softcap, alibi_slopes and sinks need a query with a heads dim (..., H, L, E), got shape "
                         f"{tuple(query_shape)}")
    heads = query_shape[-3]
    allowed = {"alibi_slopes": [(heads,)] + ([(query_shape[-4], heads)] if len(query_shape) >= 4 else []),
               "sinks": [(heads,)]}
    arrays = {}
    for name, value in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if value is None:
            arrays[name] = None
            continue
        array = sycl_runtime.to_host(value) if sycl_runtime.is_usm_array(value) else to_numpy(value, name)[0]
        if array.dtype != np.float32:
            raise TypeError(f"{name} dtype {arguments.dtype_text(array.dtype, kind)} is not supported; it must be "
                            f"{arguments.dtype_text(np.float32, kind)}")
        if tuple(array.shape) not in allowed[name]:
            shapes = " or ".join(str(s) for s in allowed[name])
            raise ValueError(f"{name} must have shape {shapes} (one value per query head), got {tuple(array.shape)}")
        arrays[name] = np.ascontiguousarray(array)
    return ScoreMods(softcap_value(softcap), arrays["alibi_slopes"], arrays["sinks"])


def per_head_view(array: np.ndarray, query_grouped: tuple, gqa: bool) -> tuple:
    """(shape, element strides) of a per-head array as a kernel operand beside a query of grouped shape
    query_grouped ((..., H_kv, group, L, E) under GQA, else (..., H_q, L, E)): the array's dims (its heads split
    in two under GQA), then (1, 1)."""
    shape = tuple(array.shape)
    if gqa:
        shape = shape[:-1] + tuple(query_grouped[-4:-2])
    shape = shape + (1, 1)
    view = array.reshape(shape)
    return shape, array_strides(view)
