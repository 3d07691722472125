"""Autograd for torch inputs: graphattn's fused forward and backward as one torch.autograd.Function.

scaled_dot_product_attention routes here when grad mode is on and query, key, value or a float attn_mask
requires grad, so a caller who asked for gradients never gets a detached result.  The forward keeps the
kernel's stats (the f32 log-sum-exp) and the dropout seed it drew, and the backward hands both to the fused
backward, which recomputes P from them.  Imported on the first such call only (it imports torch).
"""
from __future__ import annotations

import torch

from . import functional, functional_backward
from .interop import torch_random_seed


class FusedAttention(torch.autograd.Function):
    """(out, stats) of attention on q, k, v and an optional mask; `options` are the functional API's other
    arguments (dropout_p, is_causal, scale, enable_gqa, causal_alignment, dropout_seed, dropout_offset), the
    seed already drawn where dropout needs one."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, options):
        out, stats = functional.scaled_dot_product_attention(
            _detached(query), _detached(key), _detached(value), _detached(attn_mask), return_stats=True, **options)
        tensors = [query, key, value, attn_mask]
        ctx.arrays = [None if isinstance(x, torch.Tensor) else x for x in tensors]  # NumPy operands, if any
        ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in tensors), out, stats)
        ctx.options = options
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    def backward(ctx, grad_out, _grad_stats):
        *saved, out, stats = ctx.saved_tensors
        query, key, value, attn_mask = (_detached(t) if a is None else a for t, a in zip(saved, ctx.arrays))
        wants = ctx.needs_input_grad
        mask_grad = attn_mask is not None and wants[3]
        # An expanded or strided gradient (e.g. from .sum()) is read once; contiguous keeps the kernel's
        # direct torch route.
        grads = functional_backward.scaled_dot_product_attention_backward(
            grad_out.contiguous(), query, key, value, out, stats, attn_mask, return_mask_grad=mask_grad,
            **ctx.options)
        dq, dk, dv = grads[:3]
        return (dq if wants[0] else None, dk if wants[1] else None, dv if wants[2] else None,
                grads[3] if mask_grad else None, None)


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def wants_grad(query, key, value, attn_mask) -> bool:
    """Whether a call must be differentiable: grad mode on, and a torch operand that requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (query, key, value, attn_mask))


def attention(query, key, value, attn_mask, return_stats: bool, options: dict):
    """The differentiable call: out, or (out, stats) with stats not differentiable."""
    if options["dropout_p"] and options["dropout_seed"] is None:  # one seed for the forward and the backward
        options = dict(options, dropout_seed=torch_random_seed())
    out, stats = FusedAttention.apply(query, key, value, attn_mask, options)
    return (out, stats) if return_stats else out
