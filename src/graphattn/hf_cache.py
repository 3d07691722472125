"""A paged K/V cache for transformers' ``generate``: every layer's keys and values live in blocks of one
preallocated pool and grow in place (no torch.cat of the whole cache per token), read by graphattn's kernels
through the block table.

    from graphattn.hf_cache import PagedCache
    name = graphattn.torch.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    out = model.generate(ids, past_key_values=PagedCache(max_cache_len=512), max_new_tokens=64)

Needs the "graphattn" attention implementation (graphattn.torch.register_transformers): a layer's ``update``
writes the new rows into its blocks (ga.kv_cache_append) and hands the attention function a marker, not the
whole cache; the attention function then attends over the blocks (ga.attention_with_kv_cache), causal
bottom-right, with the batch's left padding taken from transformers' mask.

``PagedCache(max_cache_len, kv_format="u8", group_size=32)`` keeps the blocks quantized (graphattn.kv_quant's
formats: the new rows quantized on write, decoded by the kernels as they read); an fp8 format takes one scale
per layer's K and V, set from the first update's largest magnitude with 2x headroom (later rows beyond it
saturate).
"""
from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import kv_cache, kv_quant
from .torch import PAGED_LAYER_MARK

__all__ = ["PagedCache", "PagedLayer"]

class PagedLayer(CacheLayerMixin):
    """One layer's cache: (num_blocks, block_size, H_kv, D) key and value blocks, batch row b's blocks at
    block_table[b] (allocated at the first update, for max_cache_len rows per row of the batch)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, max_cache_len: int, block_size: int = 16, kv_format: str | None = None,
                 group_size: int | None = None):
        super().__init__()
        if max_cache_len < 1 or block_size < 1:
            raise ValueError(f"PagedCache needs max_cache_len >= 1 and block_size >= 1, got {max_cache_len} and "
                             f"{block_size}")
        self.max_cache_len, self.block_size = int(max_cache_len), int(block_size)
        self.format = None if kv_format is None else kv_quant.format_named(kv_format)
        self.group_size = group_size
        self.quant = {}  # attention_with_kv_cache's kv_format, scales and zero points, for a quantized cache
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, d = key_states.shape
        per_row = -(-self.max_cache_len // self.block_size)
        blocks = (batch * per_row, self.block_size, heads)
        if self.format is None:
            self.keys = torch.empty(*blocks, d, dtype=key_states.dtype)
            self.values = torch.empty(*blocks, value_states.shape[-1], dtype=value_states.dtype)
        else:
            self.keys, self.values = (self._quantized_blocks(side, blocks, x) for side, x in
                                      (("k", key_states), ("v", value_states)))
            self.quant["kv_format"] = self.format.name
        self.block_table = torch.arange(batch * per_row, dtype=torch.int32).reshape(batch, per_row)
        self.device = key_states.device
        self.is_initialized = True

    def _quantized_blocks(self, side: str, blocks: tuple, states: torch.Tensor) -> torch.Tensor:
        """The byte blocks of one side (K or V) in the cache's format, its scales and zero points put in
        self.quant: per group f16 scales and uint8 zero points shaped as the blocks with D / G last; fp8's one
        scale from these first states."""
        fmt, d = self.format, states.shape[-1]
        data = torch.zeros(*blocks, fmt.stored_cols(d), dtype=torch.int8 if fmt.name == "s8" else torch.uint8)
        if fmt.fp8 is not None:
            top = float(states.detach().abs().max()) if states.numel() else 0.0
            fmax = kv_quant.fp8_max(fmt)
            self.quant[f"{side}_scales"] = torch.tensor(2.0 * top / fmax if top > 0 else 1.0, dtype=torch.float32)
            return data
        group = self.group_size or (32 if d % 32 == 0 else d)
        if d % group:
            raise ValueError(f"PagedCache: group_size {group} does not divide the head size {d} (D % G != 0)")
        kv_quant.checked_group(d, d // group, "group_size", fmt)
        self.quant[f"{side}_scales"] = torch.zeros(*blocks, d // group, dtype=torch.float16)
        if not fmt.symmetric:
            self.quant[f"{side}_zero_points"] = torch.zeros(*blocks, d // group, dtype=torch.uint8)
        return data

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes the new (B, H_kv, L, D) rows after the cached ones; returns markers for the attention function
        (empty tensors that name this layer), not the cache."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kv_cache.kv_cache_append(self.keys, self.values, key_states.transpose(1, 2), value_states.transpose(1, 2),
                                 cache_seqlens=self.length, block_table=self.block_table, **self.quant)
        self.length += key_states.shape[2]
        marks = key_states.new_empty((key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])), \
            value_states.new_empty((value_states.shape[0], value_states.shape[1], 0, value_states.shape[3]))
        for m in marks:
            setattr(m, PAGED_LAYER_MARK, self)
        return marks

    def attend(self, query: torch.Tensor, attention_mask, scaling, window, softcap, sinks) -> torch.Tensor:
        """(B, L, H_q, Dv) of the query (B, H_q, L, D) over the cached rows, the newest L its own."""
        leftpad = None
        if attention_mask is not None:  # transformers' mask: the last row sees exactly the keys after the padding
            last = attention_mask[:, 0, -1, :self.length]
            if last.dtype != torch.bool:
                last = last == 0
            if not bool(last.any(dim=-1).all()):
                raise NotImplementedError("PagedCache: a row of the batch that sees no key (a mask other than "
                                          "left padding) is not supported")
            leftpad = torch.argmax(last.to(torch.int8), dim=-1).to(torch.int32)
        q = query.transpose(1, 2)
        out = kv_cache.attention_with_kv_cache(
            q, self.keys, self.values, cache_seqlens=np.full(q.shape[0], self.length, np.int64),
            block_table=self.block_table, cache_leftpad=leftpad, scale=scaling, is_causal=q.shape[1] > 1,
            window=window, softcap=softcap, sinks=sinks, **self.quant)
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.length = 0


def paged_layer(key) -> PagedLayer | None:
    """The PagedLayer whose update returned this key, or None for an ordinary key tensor."""
    return getattr(key, PAGED_LAYER_MARK, None)


class PagedCache(Cache):
    """transformers' Cache of PagedLayer layers, added as the model's layers first update them."""

    def __init__(self, max_cache_len: int, block_size: int = 16, kv_format: str | None = None,
                 group_size: int | None = None):
        super().__init__(layers=None, layer_class_to_replicate=lambda: PagedLayer(max_cache_len, block_size,
                                                                                  kv_format, group_size))
