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

from . import _cpu, arguments, sycl_runtime
from .interop import is_torch_tensor, to_numpy
from .tensor import array_strides

_LOG2E = math.log2(math.e)

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
    """softcap as a float: None is 0.0 (no softcap), else a value within _cpu.softcap_range(), checked as given
    (before float32 would round it to 0, a subnormal or inf)."""
    if value is None:
        return 0.0
    c = arguments.real_number(value, "softcap")
    least, largest = _cpu.softcap_range()
    if not least <= c <= largest:
        raise ValueError(f"softcap must be within [{least:.9g}, {largest:.9g}] (float32 normal numbers the kernels "
                         f"hold in base-2 units; None: no softcap), got {value!r}")
    return c


def refuse_slopes_grad(alibi_slopes) -> None:
    """A ValueError for torch slopes that require grad (with grad mode on): the kernels give the slopes no
    gradient, and a result that silently left them out would train nothing."""
    if getattr(alibi_slopes, "requires_grad", False):
        import torch

        if torch.is_grad_enabled():
            raise ValueError("alibi_slopes requires grad, but graphattn computes no gradient for ALiBi slopes: pass "
                             "alibi_slopes.detach() (BLOOM's and MPT's slopes are fixed)")


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


def call_scale(scale, mods: ScoreMods | None, query, key):
    """The scale a functional call runs at: as given (None: the default), checked, and saturated under a
    softcap (saturating_scale)."""
    if mods is None or not mods.softcap or scale is None:
        return scale
    return saturating_scale(arguments.scale_value(scale), mods.softcap, query, key)


def saturating_scale(scale: float, softcap: float, query, key) -> float:
    """The scale a call with a softcap runs at: scale itself, or for an infinite one a finite one of its sign at
    which c * tanh(scale * q.k / c) is +-c (tanh rounds to +-1) for all but scores of q.k within ~1e-36 of 0 of
    this query and key, as the limit gives, and the kernels' scaled Q and scores stay finite (an infinite scale
    would make Q's elements +-inf and their dot products NaN)."""
    if not softcap or scale not in (math.inf, -math.inf):
        return scale
    host = [sycl_runtime.to_host(a) if sycl_runtime.is_usm_array(a) else to_numpy(a, name)[0]
            for a, name in ((query, "query"), (key, "key"))]
    if any(a.size == 0 for a in host):
        return scale
    q_max, k_max = (float(np.max(np.abs(a.astype(np.float32, copy=False)))) for a in host)
    bound = 4.0 * _LOG2E * host[0].shape[-1] * q_max * k_max  # |scaled q.k| in the kernels' base-2 units, x4
    if not 0.0 < bound < math.inf:  # zero, infinite or NaN data: the infinite scale gives what the math does
        return scale
    return math.copysign(float(np.finfo(np.float32).max) / bound, scale)


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
