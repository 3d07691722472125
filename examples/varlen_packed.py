"""Sequences of different lengths in one call, three ways:

1. graphattn.varlen_attention on packed (T, H, D) tensors, checked against each sequence's own dense call;
2. padding-free training: transformers' DataCollatorWithFlattening packs a batch into one row and the
   "graphattn_flash" implementation runs it through varlen (no padding, no mask): its loss is that of "sdpa"
   on the sequences one by one;
3. continuous batching on the CPU: model.generate_batch through "graphattn_flash", the same greedy tokens as
   "sdpa".

    python examples/varlen_packed.py [--dtype f32|bf16] [--new-tokens 6]
"""
from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
import transformers

import graphattn as ga
import graphattn.torch
from graphattn.testing import random_array


def packed_call(dtype: str) -> None:
    rng = np.random.default_rng(0)
    lengths = [5, 70, 1, 33]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q = random_array((cu_seqlens[-1], 8, 64), dtype, rng)    # (T, H_q, D)
    k = random_array((cu_seqlens[-1], 2, 64), dtype, rng)    # (T, H_kv, D): GQA
    v = random_array((cu_seqlens[-1], 2, 64), dtype, rng)
    out = ga.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, is_causal=True)
    worst = 0.0
    for b in range(len(lengths)):
        rows = slice(cu_seqlens[b], cu_seqlens[b + 1])
        dense = ga.scaled_dot_product_attention(q[rows].swapaxes(0, 1), k[rows].swapaxes(0, 1),
                                                v[rows].swapaxes(0, 1), is_causal=True, enable_gqa=True)
        worst = max(worst, float(np.abs(out[rows].astype(np.float32) - dense.swapaxes(0, 1).astype(np.float32)).max()))
    tolerance = 1e-5 if dtype == "f32" else 2e-2
    print(f"varlen_attention, {len(lengths)} sequences of {lengths} rows, {dtype}: max difference from the "
          f"per-sequence calls {worst:.2e} ({'matches' if worst <= tolerance else 'DIFFERS'})")
    assert worst <= tolerance


def models():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ours = transformers.LlamaForCausalLM(config)
    theirs = copy.deepcopy(ours)
    graphattn.torch.register_transformers()  # "graphattn" and "graphattn_flash"
    ours.config._attn_implementation = graphattn.torch.FLASH_NAME
    theirs.config._attn_implementation = "sdpa"
    return ours, theirs


def padding_free_training(ours, theirs) -> None:
    torch.manual_seed(1)
    sequences = [torch.randint(0, 97, (n,)).tolist() for n in (7, 13, 5)]
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": s} for s in sequences])
    loss = ours(**batch).loss
    total = sum(theirs(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss * (len(s) - 1) for s in sequences)
    reference = total / sum(len(s) - 1 for s in sequences)
    print(f"padding-free training, one packed row of {batch['input_ids'].shape[1]} tokens: loss {loss.item():.6f}, "
          f"sdpa per sequence {reference.item():.6f}")
    assert abs(loss.item() - reference.item()) < 1e-4


def continuous_batching(ours, theirs, new_tokens: int) -> None:
    torch.manual_seed(2)
    prompts = [torch.randint(1, 97, (n,)).tolist() for n in (7, 13, 5)]
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    with torch.no_grad():
        got = ours.generate_batch(inputs=prompts, generation_config=config)
        want = theirs.generate_batch(inputs=prompts, generation_config=config)
    same = all(got[key].generated_tokens == want[key].generated_tokens for key in want)
    print(f"continuous batching, {len(prompts)} prompts x {new_tokens} tokens: greedy tokens "
          f"{'match' if same else 'DIFFER from'} sdpa's")
    assert same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args()
    packed_call(args.dtype)
    ours, theirs = models()
    padding_free_training(ours, theirs)
    continuous_batching(ours, theirs, args.new_tokens)


if __name__ == "__main__":
    main()
