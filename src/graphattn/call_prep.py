"""What the functional forward, its backward and the varlen calls share to prepare a call: the checks of
Q, K, V and the mask, the grouped (GQA) shapes, layout keys of the plan caches, USM detection, the given
output arrays' checks.  Every caller imports these by their public
names; none of them imports another caller.
"""
from __future__ import annotations

import secrets

import numpy as np

from . import _cpu, arguments, key_window, sycl_runtime
from .dtypes import DataType, numpy_dtype
from .ops.broadcast import broadcast_shapes
from .interop import is_torch_tensor
from .tensor import array_strides

KERNEL_FLOATS = frozenset(numpy_dtype(dt) for dt in (DataType.f32, DataType.bf16, DataType.f16))


def new_dropout_seed() -> int:
    """A fresh 63-bit seed from the OS's entropy (what dropout_seed=None uses)."""
    return secrets.randbits(63)


def layout_key(a) -> tuple:
    if type(a) is np.ndarray:  # byte strides pin the layout as well as element strides, and cost nothing
        return a.shape, a.strides if a.size else a.shape, a.dtype.str
    return tuple(a.shape), array_strides(a) if a.size else tuple(a.shape), a.dtype.str


def sycl_inputs(query, key, value, attn_mask):
    """(q, k, v, mask, queue) when the inputs are USM arrays (dpnp or usm_ndarray), else None."""
    arrays = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if all(type(a) is np.ndarray or is_torch_tensor(a) for a in arrays):  # host arrays: the common case, checked first
        return None
    on_device = [sycl_runtime.is_usm_array(a) for a in arrays]
    if not any(on_device):
        return None
    if not all(on_device):
        raise TypeError("query, key, value and attn_mask must all be USM arrays (dpnp) or all host arrays")
    queue = sycl_runtime.array_queue(query)
    for name, a in zip(("key", "value", "attn_mask"), arrays[1:]):
        if sycl_runtime.array_queue(a).sycl_context != queue.sycl_context:
            raise ValueError(f"{name} lives on another SYCL context than query")
    for name, a in zip(("query", "key", "value"), arrays[:3]):
        if a.dtype not in (np.float32, np.float16):
            raise TypeError(f"{name} dtype {a.dtype} is not supported on SYCL by the functional API (float32 or "
                            "float16; bf16 data runs through the graph API as uint16 bit patterns)")
    return query, key, value, attn_mask, queue


def check_inputs(q, k, v, mask, is_causal, enable_gqa, causal_alignment, kind="numpy"):
    """The rules of a new signature (shapes, dtypes, flags) on NumPy or USM arrays; kind is the caller's array
    kind, for messages in its terms.  Returns whether the call is grouped-query (enable_gqa with fewer K/V
    heads)."""
    operands = (("query", q), ("key", k), ("value", v)) + ((("attn_mask", mask),) if mask is not None else ())
    for name, a in operands:
        if isinstance(a, np.ndarray):
            arguments.check_host_array(a, name)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., seq, head_dim), got shape {a.shape}")
        if a.dtype not in KERNEL_FLOATS:
            raise arguments.unsupported_float(name, a.dtype, kind)
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {arguments.dtype_text(q.dtype, kind)}, "
                        f"{arguments.dtype_text(k.dtype, kind)}, {arguments.dtype_text(v.dtype, kind)}")
    if mask is not None and mask.dtype != np.bool_ and mask.dtype not in (q.dtype, np.float32):
        raise TypeError(f"attn_mask dtype {arguments.dtype_text(mask.dtype, kind)} is not supported; a mask is "
                        f"bool or float ({arguments.dtype_text(np.float32, kind)} or the query's "
                        f"{arguments.dtype_text(q.dtype, kind)})")
    arguments.check_head_sizes(q.shape, k.shape, v.shape)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head dims differ: query {q.shape} (E={q.shape[-1]}) vs key {k.shape} "
                         f"(E={k.shape[-1]})")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value sequence lengths differ: key {k.shape} vs value {v.shape}")
    if is_causal and mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both")
    key_window.checked_alignment(causal_alignment)
    hq, hkv = q.shape[-3], k.shape[-3]
    gqa = enable_gqa and hq != hkv
    if gqa:
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(f"key and value head counts differ: key {k.shape} vs value {v.shape}")
        if hq % hkv:
            raise ValueError(f"enable_gqa needs query heads divisible by key/value heads: Hq={hq}, Hkv={hkv} "
                             f"(query {q.shape}, key {k.shape})")
        batch_shapes = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    else:
        batch_shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    try:
        batch = broadcast_shapes(batch_shapes, "batch")
    except ValueError:
        hint = " (different head counts need enable_gqa=True)" if hq != hkv and not enable_gqa else ""
        raise ValueError(f"batch dims of query {q.shape}, key {k.shape} and value {v.shape} "
                         f"are not broadcastable{hint}") from None
    if gqa:
        batch = batch + (hq,)
    if mask is not None:
        target = batch + (q.shape[-2], k.shape[-2])
        try:
            if broadcast_shapes([target, mask.shape], "mask") != target:
                raise ValueError
        except ValueError:
            raise ValueError(f"attn_mask of shape {mask.shape} does not broadcast to {target} "
                             "(batch..., L, S)") from None
    return gqa


def normalize_mask(mask):
    """None, or an array of rank >= 2; a scalar zero float mask means no mask."""
    if mask is None:
        return None
    if mask.dtype != np.bool_ and mask.ndim == 0 and float(mask) == 0.0:
        return None
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    return mask


def grouped_shapes(q, k, v, mask, gqa: bool) -> tuple:
    """Q, K, V and the mask's shapes with a GQA group's heads as two dims, (..., Hkv, rep, rows, cols) for Q
    and (..., Hkv, 1, rows, cols) for K and V, so that K and V broadcast over the group (stride 0, no copy);
    the shapes themselves without GQA."""
    if not gqa:
        return q.shape, k.shape, v.shape, None if mask is None else mask.shape
    hq, hkv = q.shape[-3], k.shape[-3]
    shapes = (q.shape[:-3] + (hkv, hq // hkv) + q.shape[-2:], k.shape[:-3] + (hkv, 1) + k.shape[-2:],
              v.shape[:-3] + (hkv, 1) + v.shape[-2:])
    if mask is None:
        return shapes + (None,)
    full = (1,) * (q.ndim - mask.ndim) + tuple(mask.shape)
    heads = (hkv, hq // hkv) if full[-3] == hq else (1, 1)
    return shapes + (full[:-3] + heads + full[-2:],)


def grouped_origin(array_ndim: int, grouped: tuple) -> tuple:
    """Operand.origin of an array's view in its grouped shape (grouped_shapes): the array's dims, left-padded
    with size-1 dims to the query's rank (no array axis), its head dim (-3) split in two, (groups, rep), whose
    strides are the head's times rep and times 1; rep is the grouped shape's dim -3 (1 for K and V)."""
    pad = len(grouped) - 1 - array_ndim
    full = [(axis - pad, 1) if axis >= pad else None for axis in range(len(grouped) - 1)]
    head = full[-3]
    return tuple(full[:-3]) + (None if head is None else (head[0], grouped[-3]), head) + tuple(full[-2:])


def mask_fits(mask_shape: tuple | None, seq_q: int, seq_kv: int) -> bool:
    """Whether a mask of this shape (None: no mask) broadcasts to a replayed call's (seq_q, seq_kv) scores: the
    length rule a replay re-checks (the others held for its template)."""
    return mask_shape is None or (mask_shape[-2] in (1, seq_q) and mask_shape[-1] in (1, seq_kv))


def check_out_kind(out, query, name: str) -> None:
    """An output array given to write into must be a NumPy array, for NumPy inputs (torch and USM calls make
    their own results)."""
    if type(out) is not np.ndarray:
        raise TypeError(f"{name} must be a NumPy array, got {type(out).__name__}")
    if not isinstance(query, np.ndarray):
        raise TypeError(f"{name} takes NumPy inputs; a call on {type(query).__name__} returns new arrays")


def checked_out(out: np.ndarray, shape: tuple, dtype, inputs: dict, name: str) -> np.ndarray:
    """out as the kernel writes it: of the result's shape and dtype, writable and C-contiguous (the kernel
    writes it densely), sharing no memory with any of inputs (name -> array or None), which it reads meanwhile."""
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must have the result's shape {tuple(shape)} and dtype {np.dtype(dtype)}, got "
                         f"{out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be a writable C-contiguous array: the kernel writes it densely")
    shared = _cpu.first_shared_memory(tuple(inputs.values()) + (out,), len(inputs))
    if shared is not None:
        raise ValueError(f"{name} shares memory with {list(inputs)[shared[1]]}, which the kernel reads while it "
                         f"writes {name}")
    return out


def s64(value, name: str) -> int:
    value = arguments.integer(value, name)
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value
