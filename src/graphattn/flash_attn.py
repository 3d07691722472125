"""flash-attn 2's Python API on graphattn's CPU kernels: code written for flash-attn runs by changing its import.

    from graphattn.flash_attn import flash_attn_func, flash_attn_varlen_func

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

from . import functional, varlen
from .interop import is_torch_tensor


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
