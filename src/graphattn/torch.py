"""graphattn from PyTorch models: an attention function for Hugging Face transformers.

    import graphattn.torch
    name = graphattn.torch.register_transformers()        # "graphattn"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

The function takes transformers' attention call (query (B, Hq, L, D), key and value (B, Hkv, S, D), the
mask transformers' sdpa mask function builds: bool, True where a key is kept, or None for plain causal; a
sliding window, softcap and gpt-oss's sinks (s_aux) as the kernels' own arguments) and runs graphattn's fused
kernels, forward and, through autograd, backward; K/V are never repeated for GQA.

register_transformers() also registers "graphattn_flash", which transformers treats as a flash implementation
("flash" in its name: its continuous batching and padding-free training then pass packed sequences as
cu_seq_lens_q/k and max_length_q/k, or position_ids that restart per sequence, and no 4-D mask).  Those calls
run through graphattn.varlen_attention; a 2-D padding mask (a padded batch) becomes a key-padding mask.
"""
from __future__ import annotations

from . import functional


def _window(sliding_window):
    """flash-attn's window_size of a sliding window of w keys: row i sees keys i - w < j."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int (the keys a row sees), got {sliding_window!r}")
    return (sliding_window - 1, -1)


# The attribute that marks the key a graphattn.hf_cache.PagedLayer's update returns: the layer attends itself.
PAGED_LAYER_MARK = "graphattn_paged_layer"


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface: (attn_output of shape (B, L, Hq, Dv), None for the weights)."""
    if kwargs.get("position_bias") is not None:
        raise ValueError("graphattn attention does not take position_bias; pass it as a float attention_mask")
    paged = getattr(key, PAGED_LAYER_MARK, None)
    if paged is not None:  # the rows are in the layer's blocks (graphattn.hf_cache)
        if dropout:
            raise NotImplementedError("graphattn.hf_cache.PagedCache: dropout is not taken (decode has none)")
        sinks = kwargs.get("s_aux")
        return paged.attend(query, attention_mask, scaling, _window(kwargs.get("sliding_window")),
                            kwargs.get("softcap"), None if sinks is None else sinks.float()), None
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa: a mask, when given, already holds the causal rule; decode rows see every key.
    causal = bool(causal) and attention_mask is None and q_length > 1
    # A sliding window of w keys (Mistral, Gemma 2, gpt-oss): row i sees keys i - w < j, flash-attn's
    # window_size (w - 1, ...), rows aligned to the keys' end as the cache puts them.  The mask transformers
    # builds holds it too; as a window the kernel skips the blocks outside it.
    window = _window(kwargs.get("sliding_window"))
    # Gemma 2's logit softcap and gpt-oss's per-head sink logits (s_aux, in the model's dtype: the kernels take
    # f32, and autograd reaches the parameter through the cast).
    sinks = kwargs.get("s_aux")
    out = functional.scaled_dot_product_attention(query, key, value, attention_mask, dropout, causal, scaling,
                                                  enable_gqa=query.shape[1] != key.shape[1],
                                                  causal_alignment="bottom_right", window=window,
                                                  softcap=kwargs.get("softcap"),
                                                  sinks=None if sinks is None else sinks.float())
    return out.transpose(1, 2).contiguous(), None


def _layer_value(value, module):
    """A per-layer-type value of transformers' continuous batching (a dict keyed by layer type) for this layer."""
    if not isinstance(value, dict):
        return value
    config = getattr(module, "config", None)
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if layer_types is not None and layer is not None and layer_types[layer] in value:
        return value[layer_types[layer]]
    if len(value) == 1:
        return next(iter(value.values()))
    return value.get("full_attention")


def _packed_lengths(kwargs, module, batch: int):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of a packed call, or None for a dense one: transformers' varlen
    kwargs, else position_ids of one packed row that restart at each sequence's first token."""
    cu_q, cu_k = _layer_value(kwargs.get("cu_seq_lens_q"), module), _layer_value(kwargs.get("cu_seq_lens_k"), module)
    if cu_q is not None and cu_k is not None:
        return cu_q, cu_k, _layer_value(kwargs.get("max_length_q"), module), \
            _layer_value(kwargs.get("max_length_k"), module)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or batch != 1 or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    import torch

    positions = position_ids[0]
    starts = (positions == positions.min()).nonzero().view(-1)
    if starts.numel() <= 1:  # one sequence: the dense call
        return None
    cu = torch.cat([starts, torch.tensor([positions.numel()], device=starts.device)]).to(torch.int32)
    return cu, cu, None, None


def flash_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            is_causal=None, **kwargs):
    """transformers' attention interface for "graphattn_flash": packed sequences through varlen_attention, a
    padded batch through the dense call with its 2-D padding mask, (B, L, Hq, Dv) and None for the weights."""
    from . import varlen

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    packed = _packed_lengths(kwargs, module, query.shape[0]) if attention_mask is None else None
    if packed is None:
        if attention_mask is not None and attention_mask.dim() == 2:  # (B, S) keys kept, as flash's mask gives it
            import torch

            keep = attention_mask.bool()[:, None, None, -key.shape[2]:]
            if causal:  # rows aligned to the keys' end (bottom-right), as the cache puts them
                rows, keys = query.shape[2], key.shape[2]
                keep = keep & torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
            attention_mask = keep
        else:
            attention_mask = None
        return attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal=causal,
                                 **kwargs)
    cu_q, cu_k, max_q, max_k = packed
    window = _window(kwargs.get("sliding_window"))
    sinks = kwargs.get("s_aux")
    # (1, H, T, D) -> (T, H, D) views: the packed rows of every sequence
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, is_causal=causal,
                                  window=window, softcap=kwargs.get("softcap"),
                                  sinks=None if sinks is None else sinks.float(), dropout_p=dropout)
    return out[None], None


def register_transformers(name: str = "graphattn") -> str:
    """Registers graphattn under `name` with transformers' AttentionInterface, and transformers' sdpa mask
    builder with its AttentionMaskInterface (without it, padding would be ignored); returns the name to pass
    as attn_implementation."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_transformers: name must be a non-empty string, got {name!r}")
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask, sdpa_mask
    except ImportError as why:
        raise ImportError("register_transformers needs transformers with AttentionInterface and "
                          "AttentionMaskInterface (pip install 'transformers>=4.56')") from why
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    AttentionInterface.register(FLASH_NAME, flash_attention_forward)
    AttentionMaskInterface.register(FLASH_NAME, flash_attention_mask)
    return name


FLASH_NAME = "graphattn_flash"  # "flash" in it: transformers passes packed sequences to it
