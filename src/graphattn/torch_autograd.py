"""graphattn's fused forward and backward as torch.library custom ops, with autograd between them.

scaled_dot_product_attention routes torch calls here when grad mode is on and query, key, value or a float
attn_mask requires grad (a caller who asked for gradients never gets a detached result), and while
torch.compile traces it, so that `torch.compile(fullgraph=True)` sees one op per call, whatever the lengths.
The forward op returns the kernel's stats (the f32 log-sum-exp) beside the output; the backward op takes
them and recomputes P.  Imported on the first such call only (it imports torch).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import arguments, forward_call, functional_backward, key_window
from .interop import torch_random_seed


@torch.library.custom_op("graphattn::sdpa_forward", mutates_args=())
def sdpa_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                 dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool, causal_alignment: str,
                 dropout_seed: int, dropout_offset: int, window: list[int], softcap: Optional[float],
                 alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                 seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, stats) of the functional forward (forward_call, on detached operands).  seed, where
    given, is dropout's seed as an int64 tensor (drawn in the traced graph) in place of dropout_seed."""
    return forward_call.attention(
        query.detach(), key.detach(), value.detach(), _detached(attn_mask), dropout_p, is_causal, scale, enable_gqa,
        causal_alignment, True, _seed(dropout_seed, seed), dropout_offset, tuple(window), softcap,
        _detached(alibi_slopes), _detached(sinks), None)


def _detached(x):
    return None if x is None else x.detach()


def _seed(dropout_seed: int, seed) -> int:
    """The dropout seed: the seed tensor's value where there is one (read here, inside the op, so that tracing
    needs no Python int of it), else dropout_seed."""
    return dropout_seed if seed is None else int(seed)


@sdpa_forward.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, dropout_seed,
      dropout_offset, window, softcap, alibi_slopes, sinks, seed):
    lead = 3 if enable_gqa else 2  # under GQA the heads are Q's, and K/V's batch dims stop before theirs
    batch = torch.broadcast_shapes(query.shape[:-lead], key.shape[:-lead], value.shape[:-lead])
    batch = tuple(batch) + (tuple(query.shape[-3:-2]) if enable_gqa else ())
    out = query.new_empty(batch + (query.shape[-2], value.shape[-1]))
    return out, query.new_empty(batch + (query.shape[-2], 1), dtype=torch.float32)


@torch.library.custom_op("graphattn::sdpa_backward", mutates_args=())
def sdpa_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  out: torch.Tensor, stats: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float,
                  is_causal: bool, scale: Optional[float], enable_gqa: bool, causal_alignment: str, dropout_seed: int,
                  dropout_offset: int, window: list[int], softcap: Optional[float],
                  alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor], seed: Optional[torch.Tensor],
                  mask_grad: bool,
                  sinks_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask, dsinks) of the functional backward; dmask and dsinks are empty unless asked for."""
    grads = functional_backward.scaled_dot_product_attention_backward(
        grad_out.contiguous(), query, key, value, out, stats, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        causal_alignment=causal_alignment, dropout_seed=_seed(dropout_seed, seed), dropout_offset=dropout_offset,
        return_mask_grad=mask_grad, window=tuple(window), softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        return_sinks_grad=sinks_grad)
    grads = list(grads)
    dmask = grads.pop(3) if mask_grad else query.new_empty(0)
    dsinks = grads.pop(3) if sinks_grad else query.new_empty(0, dtype=torch.float32)
    return grads[0], grads[1], grads[2], dmask, dsinks


@sdpa_backward.register_fake
def _(grad_out, query, key, value, out, stats, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
      dropout_seed, dropout_offset, window, softcap, alibi_slopes, sinks, seed, mask_grad, sinks_grad):
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty(0)
    dsinks = sinks.new_empty(sinks.shape) if sinks_grad else query.new_empty(0, dtype=torch.float32)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask, dsinks


_OPTIONS = ("dropout_p", "is_causal", "scale", "enable_gqa", "causal_alignment", "dropout_seed", "dropout_offset",
            "window", "softcap")
_SINKS_INPUT = 4 + len(_OPTIONS) + 1  # sdpa_forward's inputs: q, k, v, mask, the options, alibi_slopes, sinks, seed


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, *rest = inputs
    options, (alibi_slopes, sinks, seed) = rest[:len(_OPTIONS)], rest[len(_OPTIONS):]
    ctx.save_for_backward(query, key, value, attn_mask, alibi_slopes, sinks, seed, *output)
    ctx.options = dict(zip(_OPTIONS, options))
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_stats):
    query, key, value, attn_mask, alibi_slopes, sinks, seed, out, stats = ctx.saved_tensors
    wants = ctx.needs_input_grad
    mask_grad = attn_mask is not None and bool(wants[3])
    sinks_grad = sinks is not None and bool(wants[_SINKS_INPUT])
    dq, dk, dv, dmask, dsinks = sdpa_backward(grad_out, query, key, value, out, stats, attn_mask,
                                              *ctx.options.values(), alibi_slopes, sinks, seed, mask_grad,
                                              sinks_grad)
    return (dq if wants[0] else None, dk if wants[1] else None, dv if wants[2] else None,
            dmask if mask_grad else None) + (None,) * (len(_OPTIONS) + 1) + (dsinks if sinks_grad else None, None)


sdpa_forward.register_autograd(_backward, setup_context=_setup_context)


def takes(query, key, value, attn_mask, sinks=None) -> bool:
    """Whether a call goes through the ops: a torch operand that requires grad with grad mode on, or a call
    that torch.compile is tracing.  Attribute reads come first: they are the cheapest test of a plain call."""
    if query.requires_grad or getattr(key, "requires_grad", False) or getattr(value, "requires_grad", False) \
            or getattr(attn_mask, "requires_grad", False) or getattr(sinks, "requires_grad", False):
        return torch.is_grad_enabled() or torch.compiler.is_dynamo_compiling()
    return torch.compiler.is_dynamo_compiling()


def dropout_seeds(dropout_p: float, dropout_seed):
    """(dropout_seed, seed tensor or None) of an op call: one seed for the forward and the backward, drawn from
    torch's generator where none is given; while torch.compile traces, as a tensor the graph draws (no Python
    int, no graph break)."""
    if not dropout_p or dropout_seed is not None:
        return dropout_seed, None
    if torch.compiler.is_dynamo_compiling():
        return None, torch.randint(0, 1 << 62, (), dtype=torch.int64)
    return torch_random_seed(), None


def attention(query, key, value, attn_mask, return_stats: bool, dropout_p, is_causal, scale, enable_gqa,
              causal_alignment, dropout_seed, dropout_offset, window=None, softcap=None, alibi_slopes=None,
              sinks=None):
    """The call through sdpa_forward: out, or (out, stats) with stats not differentiable.  NumPy operands are
    taken as tensors (the ops take tensors only)."""
    dropout_p = arguments.dropout_probability(dropout_p)
    dropout_seed, seed = dropout_seeds(dropout_p, dropout_seed)
    query, key, value = (x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (query, key, value))
    attn_mask, alibi_slopes, sinks = (x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(x)
                                      for x in (attn_mask, alibi_slopes, sinks))
    out, stats = sdpa_forward(query, key, value, attn_mask, dropout_p, bool(is_causal), arguments.scale_value(scale),
                              bool(enable_gqa), causal_alignment,
                              0 if dropout_seed is None else arguments.integer(dropout_seed, "dropout_seed"),
                              arguments.integer(dropout_offset, "dropout_offset"),
                              list(key_window.checked_window(window)),
                              None if softcap is None else arguments.real_number(softcap, "softcap"), alibi_slopes,
                              sinks, seed)
    return (out, stats) if return_stats else out
