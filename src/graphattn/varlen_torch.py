"""varlen_attention as torch.library custom ops, with autograd between them.

varlen.varlen_attention routes torch calls here when grad mode is on and an operand requires grad, and while
torch.compile traces it: the op takes cu_seqlens as tensors, so new lengths are new data, not a new graph.
The forward op returns the stats beside the output; the backward op takes them.  Imported on the first such
call only (it imports torch).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import arguments, key_window, score_mods, varlen_call
from .torch_autograd import dropout_seeds


def _int_or_none(value: int) -> Optional[int]:
    return None if value < 0 else value


@torch.library.custom_op("graphattn::varlen_forward", mutates_args=())
def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: Optional[float],
                   is_causal: bool, causal_alignment: str, window: list[int], softcap: Optional[float],
                   alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor], dropout_p: float,
                   dropout_seed: int, dropout_offset: int,
                   seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, stats) of varlen_attention on detached operands; max_seqlen -1 for None; seed, where given, is
    dropout's seed as an int64 tensor drawn in the traced graph, in place of dropout_seed."""
    return varlen_call.attention(
        q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, _int_or_none(max_seqlen_q),
        _int_or_none(max_seqlen_k), scale, is_causal, causal_alignment, tuple(window), softcap,
        None if alibi_slopes is None else alibi_slopes.detach(), None if sinks is None else sinks.detach(), dropout_p,
        dropout_seed if seed is None else int(seed), dropout_offset, True, None)


@varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, causal_alignment, window,
      softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset, seed):
    out = q.new_empty((q.shape[1], q.shape[0], v.shape[2])).transpose(0, 1)  # varlen_call.head_major's layout
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("graphattn::varlen_backward", mutates_args=())
def varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    stats: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, scale: Optional[float], is_causal: bool, causal_alignment: str,
                    window: list[int], softcap: Optional[float], alibi_slopes: Optional[torch.Tensor],
                    sinks: Optional[torch.Tensor], dropout_p: float, dropout_seed: int, dropout_offset: int,
                    seed: Optional[torch.Tensor],
                    sinks_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of varlen_attention_backward; dsinks is empty unless asked for."""
    grads = varlen_call.backward(
        grad_out.detach(), q.detach(), k.detach(), v.detach(), out.detach(), stats, cu_seqlens_q, cu_seqlens_k,
        _int_or_none(max_seqlen_q), _int_or_none(max_seqlen_k), scale, is_causal, causal_alignment, tuple(window),
        softcap, None if alibi_slopes is None else alibi_slopes.detach(), None if sinks is None else sinks.detach(),
        dropout_p, dropout_seed if seed is None else int(seed), dropout_offset, sinks_grad, None)
    dsinks = grads[3] if sinks_grad else q.new_empty(0, dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsinks


@varlen_backward.register_fake
def _(grad_out, q, k, v, out, stats, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
      causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset, seed,
      sinks_grad):
    dsinks = sinks.new_empty(sinks.shape) if sinks_grad else q.new_empty(0, dtype=torch.float32)
    grads = (x.new_empty((x.shape[1], x.shape[0], x.shape[2])).transpose(0, 1) for x in (q, k, v))  # head-major
    return (*grads, dsinks)


# varlen_forward's inputs after q, k, v: the ones the backward takes as they are.
_PASSED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "scale", "is_causal", "causal_alignment",
           "window", "softcap", "alibi_slopes", "sinks", "dropout_p", "dropout_seed", "dropout_offset", "seed")
_SINKS_INPUT = 3 + _PASSED.index("sinks")


def _setup_context(ctx, inputs, output):
    q, k, v, *passed = inputs
    tensors = {name: value for name, value in zip(_PASSED, passed) if isinstance(value, torch.Tensor)}
    ctx.tensor_names = tuple(tensors)
    ctx.save_for_backward(q, k, v, *output, *tensors.values())
    ctx.passed = {name: value for name, value in zip(_PASSED, passed) if name not in tensors}
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_stats):
    q, k, v, out, stats, *tensors = ctx.saved_tensors
    passed = dict(ctx.passed, **dict(zip(ctx.tensor_names, tensors)))
    wants = ctx.needs_input_grad
    sinks_grad = passed.get("sinks") is not None and bool(wants[_SINKS_INPUT])
    dq, dk, dv, dsinks = varlen_backward(grad_out, q, k, v, out, stats, *(passed.get(n) for n in _PASSED),
                                         sinks_grad)
    grads = [None] * (3 + len(_PASSED))
    grads[:3] = [dq if wants[0] else None, dk if wants[1] else None, dv if wants[2] else None]
    if sinks_grad:
        grads[_SINKS_INPUT] = dsinks
    return tuple(grads)


varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def _length(value, name: str):
    """A max_seqlen for the op: -1 for None; a symbolic int while tracing stays symbolic (no recompile when it
    changes)."""
    if value is None:
        return -1
    return value if isinstance(value, torch.SymInt) else arguments.integer(value, name)


def _index_tensor(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(varlen_call.to_numpy(x, name)[0])


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, causal_alignment,
              window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset, return_stats):
    """The call through varlen_forward: out, or (out, stats) with stats not differentiable."""
    score_mods.refuse_slopes_grad(alibi_slopes)
    dropout_p = arguments.dropout_probability(dropout_p)
    dropout_seed, seed = dropout_seeds(dropout_p, dropout_seed)
    out, stats = varlen_forward(
        q, k, v, _index_tensor(cu_seqlens_q, "cu_seqlens_q"), _index_tensor(cu_seqlens_k, "cu_seqlens_k"),
        _length(max_seqlen_q, "max_seqlen_q"), _length(max_seqlen_k, "max_seqlen_k"),
        arguments.scale_value(scale), bool(is_causal), causal_alignment, list(key_window.checked_window(window)),
        None if softcap is None else arguments.real_number(softcap, "softcap"), alibi_slopes, sinks, dropout_p,
        0 if dropout_seed is None else arguments.integer(dropout_seed, "dropout_seed"),
        arguments.integer(dropout_offset, "dropout_offset"), seed)
    return (out, stats) if return_stats else out
