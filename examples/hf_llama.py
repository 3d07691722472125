"""A small Llama-like model from a config with random weights (nothing is downloaded), run by transformers
with graphattn's attention and with PyTorch's SDPA: a few training steps, then greedy generation with a KV
cache (graphattn's: a paged cache whose blocks grow in place, graphattn.hf_cache.PagedCache; SDPA's:
transformers' own); prints both implementations' times and whether their tokens agree.

    python examples/hf_llama.py [--layers 2] [--hidden 128] [--steps 3] [--new-tokens 16]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import graphattn.torch
from graphattn.hf_cache import PagedCache


def build(args) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def run(model: LlamaForCausalLM, implementation: str, args) -> tuple[dict, torch.Tensor]:
    model.config._attn_implementation = implementation
    torch.manual_seed(1)
    batch = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    train_s = time.perf_counter() - start
    model.eval()
    prompt = batch[:, : args.seq // 2]
    start = time.perf_counter()
    cache = {"cache": PagedCache(max_cache_len=prompt.shape[1] + args.new_tokens)} if implementation != "sdpa" else {}
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                                pad_token_id=0, **cache)
    generate_s = time.perf_counter() - start
    return {"train_s": train_s, "generate_s": generate_s, "loss": float(loss)}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    name = graphattn.torch.register_transformers()
    base = build(args)
    results = {}
    for implementation in (name, "sdpa"):
        results[implementation] = run(copy.deepcopy(base), implementation, args)
    for implementation, (times, _) in results.items():
        print(f"{implementation:10s} train {args.steps} steps {times['train_s'] * 1e3:8.1f} ms   "
              f"generate {args.new_tokens} tokens {times['generate_s'] * 1e3:8.1f} ms   "
              f"final loss {times['loss']:.4f}")
    same = torch.equal(results[name][1], results["sdpa"][1])
    print(f"generated tokens {'agree' if same else 'DIFFER'} between {name} and sdpa")


if __name__ == "__main__":
    main()
