"""flash-attn 2's Python API on graphattn's CPU kernels: code written for flash-attn runs by changing its import.

    from graphattn.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

The signatures, defaults and return conventions are flash-attn 2's (flash_attn/flash_attn_interface.py):
tensors (batch, seqlen, nheads, headdim), or packed (total, nheads, headdim) with cu_seqlens; GQA where nheads
is a multiple of nheads_k; causal aligned bottom-right (row i of a sequence sees keys j <= i + S_k - S_q);
window_size (left, right) with -1 for no limit; softcap 0.0 for none; alibi_slopes (nheads,) or
(batch, nheads) f32; return_attn_probs=True returns (out, softmax_lse, None) with softmax_lse (batch, nheads,
seqlen_q) or, packed, (nheads, total_q), +inf for a row that sees no key (its output 0), as flash-attn gives
it.  Gradients flow through torch autograd.  deterministic is accepted: graphattn's backward is always
deterministic.  Arguments graphattn does not implement raise NotImplementedError naming them.
"""
from __future__ import annotations

import numpy as np

from . import functional, kv_cache, varlen
from .interop import from_numpy, is_torch_tensor, to_numpy


def _softcap(softcap):
    return None if softcap is None or softcap == 0.0 else softcap


def _lse(stats):
    """graphattn's stats with flash-attn's value for a row that sees no key: +inf (graphattn gives -inf)."""
    if is_torch_tensor(stats):
        return stats.masked_fill(stats == float("-inf"), float("inf"))
    return np.where(stats == float("-inf"), np.float32(np.inf), stats)


def _transposed(x):
    """(batch, seqlen, heads, dim) as the (batch, heads, seqlen, dim) view graphattn's functional call takes, and
    back."""
    return x.transpose(1, 2) if is_torch_tensor(x) else x.swapaxes(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_func: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k,
    headdim); out (batch, seqlen_q, nheads, headdim_v), and with return_attn_probs (out, softmax_lse, None)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
    out, stats = functional.scaled_dot_product_attention(
        _transposed(q), _transposed(k), _transposed(v), None, dropout_p, bool(causal), softmax_scale,
        enable_gqa=q.shape[2] != k.shape[2], causal_alignment="bottom_right", window=tuple(window_size),
        softcap=_softcap(softcap), alibi_slopes=alibi_slopes, return_stats=True)
    out = _transposed(out)
    out = out.contiguous() if is_torch_tensor(out) else np.ascontiguousarray(out)
    if not return_attn_probs:
        return out
    return out, _lse(stats[..., 0]), None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's flash_attn_varlen_func: q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim),
    cu_seqlens int32 (batch + 1,); out (total_q, nheads, headdim_v), and with return_attn_probs
    (out, softmax_lse (nheads, total_q), None)."""
    if block_table is not None:
        raise NotImplementedError("block_table: paged K/V is not implemented by graphattn.flash_attn yet")
    out, stats = varlen.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale, is_causal=bool(causal),
        causal_alignment="bottom_right", window=tuple(window_size), softcap=_softcap(softcap),
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_stats=True)
    out = out.contiguous() if is_torch_tensor(out) else np.ascontiguousarray(out)  # flash-attn's layout
    if not return_attn_probs:
        return out
    return out, _lse(stats), None


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, nheads, headdim), read in place."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_kvpacked_func: kv (batch, seqlen_k, 2, nheads_k, headdim), read in place."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2's flash_attn_varlen_qkvpacked_func: qkv (total, 3, nheads, headdim), read in place."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_varlen_kvpacked_func: kv (total_k, 2, nheads_k, headdim), read in place."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def _rotated(x, cos, sin, positions, interleaved: bool):
    """x (B, L, H, D) with rotary embedding on its first rotary_dim = 2 * cos.shape[1] dims, row (b, i) at
    position positions[b, i]: pairs (x[2p], x[2p + 1]) where interleaved (GPT-J), else (x[p], x[p + dim / 2])
    (GPT-NeoX), each turned by the angle whose cos and sin are cos[pos, p] and sin[pos, p].  A new array in
    x's kind and dtype, computed in f32."""
    a, kind = to_numpy(x, "q or k")
    c, _ = to_numpy(cos, "rotary_cos")
    s_, _ = to_numpy(sin, "rotary_sin")
    half = c.shape[1]
    if c.ndim != 2 or s_.shape != c.shape or 2 * half > a.shape[-1]:
        raise ValueError(f"rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                         f"headdim {a.shape[-1]}, got {tuple(c.shape)} and {tuple(s_.shape)}")
    if int(positions.max(initial=0)) >= c.shape[0]:
        raise ValueError(f"rotary_cos has {c.shape[0]} positions, but rows reach position {int(positions.max())}")
    out = a.astype(np.float32)
    cs = c.astype(np.float32)[positions][:, :, None, :]
    sn = s_.astype(np.float32)[positions][:, :, None, :]
    rot = out[..., :2 * half]
    first, second = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    first_new, second_new = first * cs - second * sn, second * cs + first * sn
    if interleaved:
        rot[..., 0::2], rot[..., 1::2] = first_new, second_new
    else:
        rot[..., :half], rot[..., half:] = first_new, second_new
    return from_numpy(out.astype(a.dtype), kind)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's flash_attn_with_kvcache: q (batch, seqlen_q, nheads, headdim); k_cache and v_cache
    (batch_cache, seqlen_cache, nheads_k, headdim), or paged (num_blocks, page_block_size, nheads_k, headdim)
    with block_table (batch, max_blocks) int32; k and v (batch, seqlen_new, nheads_k, headdim) are written
    into the cache at cache_seqlens first (in place).  With rotary_cos/rotary_sin (seqlen_ro, rotary_dim / 2),
    k is rotated at positions cache_seqlens, cache_seqlens + 1, ... and q too where causal or windowed (else
    at position cache_seqlens).  cache_seqlens None: the whole cache.  out (batch, seqlen_q, nheads, headdim);
    with return_softmax_lse (out, softmax_lse (batch, nheads, seqlen_q)).  num_splits is the kernel's own
    choice here (accepted, not used)."""
    if getattr(q, "ndim", None) != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen, nheads, headdim), got shape {tuple(getattr(q, 'shape', ()))}")
    batch, seqlen_q = q.shape[:2]
    if cache_seqlens is None:  # every row of the cache (flash-attn's default)
        capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
        cache_seqlens = capacity - (k.shape[1] if k is not None else 0)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None and k is not None:
        seqlens = kv_cache.index_operand(cache_seqlens, "cache_seqlens", batch)
        if cache_leftpad is not None:
            seqlens = seqlens - kv_cache.index_operand(cache_leftpad, "cache_leftpad", batch)
        new = np.arange(k.shape[1])[None, :]
        k = _rotated(k, rotary_cos, rotary_sin, seqlens[:, None] + new, bool(rotary_interleaved))
        local = tuple(window_size) != (-1, -1)
        rows_q = np.arange(seqlen_q)[None, :] if causal or local else np.zeros((1, seqlen_q), np.int64)
        q = _rotated(q, rotary_cos, rotary_sin, seqlens[:, None] + rows_q, bool(rotary_interleaved))
    out = kv_cache.attention_with_kv_cache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, scale=softmax_scale, is_causal=bool(causal),
        window=tuple(window_size), softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
        return_stats=return_softmax_lse)
    if not return_softmax_lse:
        return out
    return out[0], _lse(out[1])
