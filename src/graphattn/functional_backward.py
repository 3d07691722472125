"""The one-call backward: scaled_dot_product_attention_backward, the gradients of
scaled_dot_product_attention with the same arguments and broadcasting rules.

It recomputes the attention probabilities from the forward's stats (the f32
log-sum-exp that scaled_dot_product_attention(..., return_stats=True) returns),
so nothing of size L x S is stored between the passes.  The heads of a GQA
group reduce into dK/dV inside the kernel; only operands broadcast in other
ways (5D batch broadcasting) are summed here after the kernel.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _cpu
from .dtypes import DTYPES, from_numpy as dtype_of
from . import sycl_runtime
from .functional import _check_inputs, _normalize_mask, _s64, _strides, _sycl_inputs
from .interop import from_numpy, to_numpy
from .ops.broadcast import broadcast_shapes

KERNEL_BATCH_DIMS = 3


def _split_heads(x: np.ndarray, hkv: int, members: int) -> np.ndarray:
    """(..., H, rows, cols) -> (..., Hkv, H // Hkv, rows, cols) for the query side, (..., Hkv, 1, ...) for K/V."""
    return x.reshape(x.shape[:-3] + (hkv, members) + x.shape[-2:])


def _merge_batch_dims(batch: tuple, strides: list[list[int]]) -> tuple[tuple, list[list[int]]]:
    """Merges adjacent batch dims that every view walks as one (or drops size-1 dims) until at most 3 remain."""
    dims = [(size, [s[i] for s in strides]) for i, size in enumerate(batch) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, st in dims:
        if merged and len(dims) > KERNEL_BATCH_DIMS:
            prev_size, prev_st = merged[-1]
            if all(p == s * size for p, s in zip(prev_st, st)):
                merged[-1] = (prev_size * size, st)
                continue
        merged.append((size, st))
    if len(merged) > KERNEL_BATCH_DIMS:
        raise NotImplementedError(f"batch shape {batch} folds into {len(merged)} dims; the kernel takes 3")
    pad = KERNEL_BATCH_DIMS - len(merged)
    out_batch = (1,) * pad + tuple(size for size, _ in merged)
    out_strides = [[0] * pad + [st[t] for _, st in merged] for t in range(len(strides))]
    return out_batch, out_strides


def _reduce_to(full: np.ndarray, shape: tuple) -> np.ndarray:
    """Sums a gradient of broadcast shape back to the operand's own shape (f32 accumulation)."""
    lead = full.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and full.shape[lead + i] != 1)
    if not axes:
        return full.reshape(shape)
    return full.astype(np.float32).sum(axis=axes, keepdims=True).reshape(shape)


def scaled_dot_product_attention_backward(grad_out, query, key, value, out, stats, attn_mask=None,
                                          dropout_p: float = 0.0, is_causal: bool = False,
                                          scale: float | None = None, enable_gqa: bool = False, *,
                                          causal_alignment: str = "top_left", dropout_seed: int | None = None,
                                          dropout_offset: int = 0, return_mask_grad: bool = False):
    """Gradients (dq, dk, dv) of scaled_dot_product_attention, fused.

    grad_out and out have the forward output's shape (..., L, Ev); stats is
    the forward's f32 log-sum-exp (..., L, 1) (return_stats=True).  The other
    arguments are the forward's.  dk and dv have key's and value's own shapes
    (Hkv heads under enable_gqa).  return_mask_grad=True appends the gradient
    of a float attn_mask, of the mask's shape (None for a bool mask).
    With dropout, pass the forward's dropout_p, dropout_seed and
    dropout_offset: the kernel regenerates the same keep-mask.
    """
    on_sycl = _sycl_inputs(query, key, value, attn_mask)
    if on_sycl is not None:  # dpnp / usm_ndarray in: the same steps with dpnp, the SYCL kernels, USM out
        import dpnp as xp

        q, k, v, user_mask, queue = on_sycl
        kind = "usm"
        if not all(sycl_runtime.is_usm_array(a) for a in (out, grad_out, stats)):
            raise TypeError("out, grad_out and stats must be USM arrays like query")
        o, do, st = out, grad_out, stats
    else:
        xp, queue = np, None
        q, kind = to_numpy(query, "query")
        k, _ = to_numpy(key, "key")
        v, _ = to_numpy(value, "value")
        o, _ = to_numpy(out, "out")
        do, _ = to_numpy(grad_out, "grad_out")
        st, _ = to_numpy(stats, "stats")
        user_mask = None if attn_mask is None else to_numpy(attn_mask, "attn_mask")[0]

    def empty(shape, dtype):
        return np.empty(shape, dtype) if queue is None else xp.empty(shape, dtype=dtype, sycl_queue=queue)
    mask = _normalize_mask(user_mask)
    gqa = _check_inputs(q, k, v, mask, float(dropout_p), is_causal, enable_gqa, causal_alignment)
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs the forward's dropout_seed (and dropout_offset) to rebuild its mask")
    hq, hkv = q.shape[-3], k.shape[-3]
    lead = [q.shape[:-3], k.shape[:-3], v.shape[:-3]] if gqa else [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    out_shape = broadcast_shapes(lead, "batch") + ((hq,) if gqa else ()) + (q.shape[-2], v.shape[-1])
    for name, a in (("out", o), ("grad_out", do)):
        if tuple(a.shape) != out_shape:
            raise ValueError(f"{name} must have the forward output's shape {out_shape}, got {a.shape}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} dtype {a.dtype} differs from query's {q.dtype}")
    if tuple(st.shape) != out_shape[:-1] + (1,) or st.dtype != np.float32:
        raise ValueError(f"stats must be float32 of shape {out_shape[:-1] + (1,)} (the forward's return_stats), "
                         f"got {st.dtype} {st.shape}")

    if gqa:
        members = hq // hkv
        q2, o2, do2, st2 = (_split_heads(a, hkv, members) for a in (q, o, do, st))
        k2, v2 = _split_heads(k, hkv, 1), _split_heads(v, hkv, 1)
    else:
        q2, k2, v2, o2, do2, st2 = q, k, v, o, do, st
    m2 = None
    if mask is not None:
        m2 = mask
        if gqa:
            full = (1,) * (q.ndim - mask.ndim) + mask.shape
            heads = (hkv, hq // hkv) if full[-3] == hq else (1, 1)
            m2 = mask.reshape(full[:-3] + heads + full[-2:])
    shapes = [a.shape[:-2] for a in (q2, k2, v2, o2, do2, st2) + ((m2,) if m2 is not None else ())]
    batch = broadcast_shapes(shapes, "batch")

    def full_view(a):
        return xp.broadcast_to(a, batch + tuple(a.shape[-2:]))

    def is_broadcast(a) -> list[bool]:
        padded = (1,) * (len(batch) - (a.ndim - 2)) + a.shape[:-2]
        return [p == 1 and b > 1 for p, b in zip(padded, batch)]

    # The kernel reduces dK/dV over dims where K and V are both broadcast; any
    # other broadcast operand is given to it in full and its gradient summed here.
    q_in = xp.ascontiguousarray(full_view(q2)) if any(is_broadcast(q2)) else q2
    kv_alike = is_broadcast(k2) == is_broadcast(v2)
    k_in = k2 if kv_alike else xp.ascontiguousarray(full_view(k2))
    v_in = v2 if kv_alike else xp.ascontiguousarray(full_view(v2))
    dq_full = empty(batch + tuple(q2.shape[-2:]), q.dtype)
    dk_own = empty(tuple(k_in.shape), k.dtype)
    dv_own = empty(tuple(v_in.shape), v.dtype)
    dmask_full = None
    if return_mask_grad and m2 is not None and m2.dtype != np.bool_:
        dmask_full = empty(batch + (q.shape[-2], k.shape[-2]), np.float32)

    roles = {"query": q_in, "key": k_in, "value": v_in, "output": o2, "stats": st2, "grad_output": do2,
             "grad_query": dq_full, "grad_key": dk_own, "grad_value": dv_own}
    if m2 is not None:
        roles["mask"] = m2
    if dmask_full is not None:
        roles["grad_mask"] = dmask_full
    views = {name: full_view(a) for name, a in roles.items()}
    strides = [list(_strides(a)[:-2]) if a.size else [0] * len(batch) for a in views.values()]
    kernel_batch, kernel_strides = _merge_batch_dims(batch, strides)
    specs = {}
    for (name, a), bst in zip(views.items(), kernel_strides):
        matrix = _strides(a)[-2:] if a.size else (0, 0)
        specs[name] = (DTYPES[dtype_of(a.dtype)].kernel_code, tuple(bst) + tuple(matrix), a)
    seq_q, seq_kv = q.shape[-2], k.shape[-2]
    if m2 is not None:  # a mask broadcast along its rows or columns
        m_rows, m_cols = m2.shape[-2:]
        code, bst, a = specs["mask"]
        specs["mask"] = (code, bst[:3] + (bst[3] if m_rows != 1 else 0, bst[4] if m_cols != 1 else 0), a)
    if seq_q == 0 or seq_kv == 0:  # no score exists: every gradient is zero (and the kernel takes no empty views)
        for a in (dq_full, dk_own, dv_own, dmask_full):
            if a is not None:
                a[...] = 0
    else:
        scale_value = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if queue is not None:
            sycl_runtime.wait_for_producers(views.values())
            specs = {name: (code, strides, sycl_runtime.usm_address(a)) for name, (code, strides, a) in specs.items()}
            run_backward = functools.partial(sycl_runtime.plugin().backward, queue)
        else:
            run_backward = _cpu.backward
        run_backward(kernel_batch, seq_q, seq_kv, q.shape[-1], v.shape[-1], specs,
                      mask_kind=_cpu.MASK_KIND_CODES["none" if m2 is None else
                                                     ("select" if m2.dtype == np.bool_ else "additive")],
                      has_scale=True, scale=scale_value, causal=bool(is_causal),
                      causal_offset=(seq_kv - seq_q) if causal_alignment == "bottom_right" else 0,
                      inf_as_zero=True, dropout_p=float(dropout_p),
                      dropout_seed=_s64(dropout_seed or 0, "dropout_seed") & 0xFFFFFFFFFFFFFFFF,
                      dropout_offset=_s64(dropout_offset, "dropout_offset") & 0xFFFFFFFFFFFFFFFF)
        if queue is not None:
            queue.wait()  # the gradients are ready on return, as on the CPU

    dq = _reduce_to(dq_full, q2.shape).astype(q.dtype, copy=False).reshape(q.shape)
    dk = (dk_own if kv_alike else _reduce_to(dk_own, k2.shape).astype(k.dtype, copy=False)).reshape(k.shape)
    dv = (dv_own if kv_alike else _reduce_to(dv_own, v2.shape).astype(v.dtype, copy=False)).reshape(v.shape)
    grads = (from_numpy(dq, kind), from_numpy(dk, kind), from_numpy(dv, kind))
    if not return_mask_grad:
        return grads
    dmask = None
    if dmask_full is not None:
        dmask = _reduce_to(dmask_full, m2.shape).astype(m2.dtype, copy=False).reshape(user_mask.shape)
        dmask = from_numpy(dmask, kind)
    return grads + (dmask,)
