"""Attention over sequences of different lengths packed in one call: flash-attn's varlen layout.

    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)

q is (T_q, H_q, D), k (T_k, H_kv, D), v (T_k, H_kv, Dv): the rows of B sequences one after another, sequence b
holding query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
H_q is a multiple of H_kv (query head h reads K/V head h // (H_q / H_kv)).  Each sequence attends to its own
keys only, with causal, the window and ALiBi aligned per sequence (bottom-right by default, as flash-attn:
i' = i + S_k - S_q of that sequence).  stats are (H_q, T_q) f32, the log-sum-exp of each row (sinks included),
-inf for a row that sees no key (with sinks: the sink's logit alone), whose output is 0.

Dropout keeps element (b, h, i, j) (sequence, query head, row and key within the sequence) by Philox element
E_b + (h * S_q + i) * S_k + j of the stream (dropout_seed, dropout_offset) (graphattn/philox.hpp), where E_b
sums H_q * S_q * S_k over the sequences before b: the sequences' probability matrices one after another.  The
backward regenerates the same mask from the same seed and offset.

NumPy in, NumPy out; torch in, torch out, with autograd and torch.compile through custom ops (varlen_torch.py).
The kernels read strided views in place: q, k and v may be views of one packed (T, 3, H, D) projection.
"""
from __future__ import annotations

from . import varlen_call
from .interop import is_torch_tensor, torch_compiling
from .varlen_call import checked_cu_seqlens, dispatch_text, head_major

__all__ = ["varlen_attention", "varlen_attention_backward", "checked_cu_seqlens", "dispatch_text", "head_major"]


def _takes_ops(*tensors) -> bool:
    """Whether a torch call goes through the custom ops (autograd, or torch.compile tracing it)."""
    if not is_torch_tensor(tensors[0]):
        return False
    if torch_compiling():
        return True
    import torch

    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, scale=None,
                     is_causal=False, causal_alignment="bottom_right", window=None, softcap=None, alibi_slopes=None,
                     sinks=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, return_stats=False, out=None):
    """Attention of packed sequences (this module's docstring): out (T_q, H_q, Dv) in q's dtype, and with
    return_stats its (H_q, T_q) f32 log-sum-exp.  out, when given, receives the result (any strides); else out
    is a (T_q, H_q, Dv) view of head-major memory (head_major)."""
    if out is None and _takes_ops(q, k, v, sinks):
        from . import varlen_torch

        return varlen_torch.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                      is_causal, causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p,
                                      dropout_seed, dropout_offset, return_stats)
    return varlen_call.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                                 causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed,
                                 dropout_offset, return_stats, out)


def varlen_attention_backward(grad_out, q, k, v, out, stats, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, scale=None, is_causal=False, causal_alignment="bottom_right",
                              window=None, softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                              dropout_seed=None, dropout_offset=0, return_sinks_grad=False, grads_out=None):
    """(dq, dk, dv) of varlen_attention for the upstream gradient grad_out (T_q, H_q, Dv), given its out and
    stats; (dq, dk, dv, dsinks) with return_sinks_grad.  dropout_p > 0 needs the forward's dropout_seed and
    dropout_offset.  grads_out: (dq, dk, dv) arrays to write, shaped and typed as q, k and v; without them the
    gradients are views of head-major memory, as varlen_attention's out."""
    return varlen_call.backward(grad_out, q, k, v, out, stats, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, is_causal, causal_alignment, window, softcap, alibi_slopes, sinks,
                                dropout_p, dropout_seed, dropout_offset, return_sinks_grad, grads_out)
