"""graphattn from PyTorch models: an attention function for Hugging Face transformers.

    import graphattn.torch
    name = graphattn.torch.register_transformers()        # "graphattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

The function takes transformers' attention call (query (B, Hq, L, D), key and value (B, Hkv, S, D), the
mask transformers' sdpa mask function builds: bool, True where a key is kept, or None for plain causal; a
sliding window, softcap and gpt-oss's sinks (s_aux) as the kernels' own arguments) and runs graphattn's fused
kernels, forward and, through autograd, backward; K/V are never repeated for GQA.
"""
from __future__ import annotations

from . import functional


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface: (attn_output of shape (B, L, Hq, Dv), None for the weights)."""
    if kwargs.get("position_bias") is not None:
        raise ValueError("graphattn attention does not take position_bias; pass it as a float attention_mask")
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa: a mask, when given, already holds the causal rule; decode rows see every key.
    causal = bool(causal) and attention_mask is None and q_length > 1
    # A sliding window of w keys (Mistral, Gemma 2, gpt-oss): row i sees keys i - w < j, flash-attn's
    # window_size (w - 1, ...), rows aligned to the keys' end as the cache puts them.  The mask transformers
    # builds holds it too; as a window the kernel skips the blocks outside it.
    sliding_window = kwargs.get("sliding_window")
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int (the keys a row sees), got {sliding_window!r}")
        window = (sliding_window - 1, -1)
    # Gemma 2's logit softcap and gpt-oss's per-head sink logits (s_aux, in the model's dtype: the kernels take
    # f32, and autograd reaches the parameter through the cast).
    sinks = kwargs.get("s_aux")
    out = functional.scaled_dot_product_attention(query, key, value, attention_mask, dropout, causal, scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1],
                                                  causal_alignment="bottom_right", window=window,
                                                  softcap=kwargs.get("softcap"),
                                                  sinks=None if sinks is None else sinks.float())
    return out.transpose(1, 2).contiguous(), None


def register_transformers(name: str = "graphattn") -> str:
    """Registers graphattn under `name` with transformers' AttentionInterface, and transformers' sdpa mask
    builder with its AttentionMaskInterface (without it, padding would be ignored); returns the name to pass
    as attn_implementation."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_transformers: name must be a non-empty string, got {name!r}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as why:
        raise ImportError("register_transformers needs transformers with AttentionInterface and "
                          "AttentionMaskInterface (pip install 'transformers>=4.56')") from why
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
