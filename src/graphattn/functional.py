"""The one-call API: scaled_dot_product_attention with PyTorch's arguments and OpenVINO SDPA-13 broadcasting.

This module is the entry point only: torch calls that need autograd (or that torch.compile traces) go to the
custom ops of torch_autograd, which come back to forward_call with detached tensors; every other call goes to
forward_call directly.  Neither of those imports this module.
"""
from __future__ import annotations

import numpy as np

from . import forward_call, score_mods
from .call_prep import check_out_kind
from .interop import is_torch_tensor, torch_compiling

_torch_ops = None  # graphattn.torch_autograd, once a torch call has been seen (it imports torch)


def _load_torch_ops():
    """graphattn.torch_autograd, imported once: an import statement on every torch call would cost a tiny call
    more than its checks."""
    global _torch_ops
    from . import torch_autograd

    _torch_ops = torch_autograd
    return _torch_ops


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 causal_alignment: str = "top_left", return_stats: bool = False,
                                 dropout_seed: int | None = None, dropout_offset: int = 0, window=None,
                                 softcap: float | None = None, alibi_slopes=None, sinks=None, out=None):
    """softmax(Q K^T * scale + mask) V, fused, with PyTorch's arguments.

    query (..., L, E), key (..., S, E), value (..., S, Ev), at least 3 dims;
    batch dims broadcast across query, key, value and attn_mask.  A bool mask
    keeps the positions that are True, a float mask is added; a scalar 0 mask
    means no mask.  is_causal applies the implicit causal mask aligned
    "top_left" (PyTorch) or "bottom_right".  enable_gqa lets key/value have
    fewer heads (dim -3) than query, dividing it; K/V are never repeated.
    window=(left, right) limits the keys each row sees, as flash-attn's
    window_size: key j is visible to row i iff (left < 0 or j >= i' - left)
    and (right < 0 or j <= i' + right), i' the row aligned as causal_alignment
    says; is_causal sets right to 0.  It combines with attn_mask.
    Fully masked rows give 0.  dropout_p > 0 drops probabilities with the
    Philox keep-mask of (dropout_seed, dropout_offset) and scales the kept
    ones by 1 / (1 - dropout_p); the same seed and offset always drop the same
    elements (pass them to the backward too); dropout_seed=None draws a fresh
    seed.  Score modifiers, applied after the scale and before the mask:
    softcap=c caps the scores at c * tanh(s / c); alibi_slopes (f32, (H_q,) or
    (N, H_q)) subtracts slope * |i' - j|, i' aligned as causal_alignment says;
    sinks (f32, (H_q,)) adds exp(sink) to each row's softmax denominator (a
    row that sees no key then gives 0).  Returns an array of query's kind and
    dtype, or (out, stats) with return_stats, stats being the f32 logsumexp
    (..., L, 1) of the scores, the sink included (dropout does not change it).
    out: for NumPy inputs, a writable C-contiguous array of the result's shape
    and dtype, sharing no memory with the inputs, that the result is written
    to and returned as (a loop of equal calls then reuses its memory).
    """
    if out is not None:
        check_out_kind(out, query, "out")
    # torch operands that require grad, and calls torch.compile traces, go through graphattn's torch ops
    if type(query) is not np.ndarray and is_torch_tensor(query):
        if alibi_slopes is not None:
            score_mods.refuse_slopes_grad(alibi_slopes)
        # While torch.compile traces, the ops module is imported, not read from _torch_ops: a guard on that
        # global, None in a fresh process, would fail on the next call and compile the function again.
        torch_ops = _load_torch_ops() if torch_compiling() else _torch_ops or _load_torch_ops()
        if torch_ops.takes(query, key, value, attn_mask, sinks):
            return torch_ops.attention(query, key, value, attn_mask, return_stats, dropout_p, is_causal, scale,
                                       enable_gqa, causal_alignment, dropout_seed, dropout_offset, window, softcap,
                                       alibi_slopes, sinks)
    return forward_call.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                  causal_alignment, return_stats, dropout_seed, dropout_offset, window, softcap,
                                  alibi_slopes, sinks, out)
