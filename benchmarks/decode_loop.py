"""A generate loop's attention: one query row per head against a K/V cache that grows by one row each step,
graphattn against PyTorch's own SDPA on the same torch tensors, timed per step.

    python benchmarks/decode_loop.py [--dtypes f32,bf16] [--steps 256] [--start 512] [--rounds 3]

Shapes as in a Llama-like model: query (N, Hq, 1, D) against key and value (N, Hkv, S, D), GQA, S from
--start to --start + --steps - 1, one new length per step (the plan of each length is new to graphattn).  The
cache grows as transformers' DynamicCache grows it (torch.cat of the new row, a new contiguous tensor each
step), with static, as views of one preallocated buffer (StaticCache's layout), or, with paged, in blocks of
--block-size rows of one paged cache: graphattn appends the row and attends in one call
(ga.attention_with_kv_cache), torch gathers the blocks into dense K/V first.  Each round runs the
whole loop for each implementation in turn, alternating which goes first, both over the same lengths (a new
range each round): a step's time grows with S, so the two must see the same S to compare.  The times are the
median over rounds of the mean time per step; the speedup is the median over rounds of torch_sdpa / graphattn
in that round (above 1: graphattn is faster).  Prints one JSON line per case and a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import graphattn as ga
from bench_common import cpu_model, print_table

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
SHAPES = {  # name: (N, Hq, Hkv, D)
    "llama_8b_head": (1, 32, 8, 128),
    "small_batch4": (4, 8, 2, 64),
}


def _loop(attention, query, caches) -> float:
    """Seconds per step of attention(query, k, v) over the caches, one step per (k, v)."""
    start = time.perf_counter()
    for k, v in caches:
        attention(query, k, v)
    return (time.perf_counter() - start) / len(caches)


def _graphattn(q, k, v):
    return ga.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _torch_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _paged_implementations(query, buffer_k, buffer_v, block_size: int) -> dict:
    """Steps over one paged cache (blocks in a random order): graphattn appends the step's row and attends in one
    call; torch gathers the sequence's blocks into dense K/V, then runs its SDPA (what users do without a paged
    call).  Each implementation takes (query, length, None): the step that makes the cache `length` rows."""
    n, hkv, longest, d = buffer_k.shape
    per = -(-longest // block_size)
    table = torch.randperm(n * per, generator=torch.Generator().manual_seed(1)).to(torch.int32).reshape(n, per)
    caches = []
    for buffer in (buffer_k, buffer_v):
        blocks = torch.zeros(n * per, block_size, hkv, d, dtype=buffer.dtype)
        rows = torch.zeros(n, per * block_size, hkv, d, dtype=buffer.dtype)
        rows[:, :longest] = buffer.transpose(1, 2)
        blocks[table.reshape(-1).long()] = rows.reshape(n * per, block_size, hkv, d)
        caches.append(blocks)
    k_cache, v_cache = caches
    q_rows = query.transpose(1, 2)  # (N, 1, Hq, D)
    new_k, new_v = buffer_k.transpose(1, 2), buffer_v.transpose(1, 2)  # (N, S, Hkv, D) views

    def graphattn_step(q, length, _):
        ga.attention_with_kv_cache(q_rows, k_cache, v_cache, new_k[:, length - 1:length],
                                   new_v[:, length - 1:length], cache_seqlens=length - 1, block_table=table)

    def torch_step(q, length, _):
        k = k_cache[table.long()].reshape(n, -1, hkv, d)[:, :length].transpose(1, 2)
        v = v_cache[table.long()].reshape(n, -1, hkv, d)[:, :length].transpose(1, 2)
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return {"graphattn": graphattn_step, "torch_sdpa": torch_step}


def case(shape_name: str, dtype: str, layout: str, args) -> dict:
    n, hq, hkv, d = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(0)
    tdtype = DTYPES[dtype]
    query = torch.randn(n, hq, 1, d, generator=gen).to(tdtype)
    longest = args.start + args.steps * args.rounds
    buffer_k = torch.randn(n, hkv, longest, d, generator=gen).to(tdtype)
    buffer_v = torch.randn(n, hkv, longest, d, generator=gen).to(tdtype)
    times: dict[str, list[float]] = {"graphattn": [], "torch_sdpa": []}
    implementations = {"graphattn": _graphattn, "torch_sdpa": _torch_sdpa}
    if layout == "paged":
        implementations = _paged_implementations(query, buffer_k, buffer_v, args.block_size)
    for r in range(args.rounds):
        order = list(implementations) if r % 2 == 0 else list(reversed(implementations))
        # lengths no graphattn call of this process has seen (each step plans a new length), the same for both
        first = args.start + r * args.steps
        lengths = range(first, first + args.steps)
        for name in order:
            if layout == "paged":  # a step's "cache" is its length: the paged cache grows in place
                caches = [(s, None) for s in lengths]
            elif layout == "static":
                caches = [(buffer_k[:, :, :s], buffer_v[:, :, :s]) for s in lengths]
                # read the buffer first, so that neither turn finds it warmer in the caches than the other
                caches[-1][0].sum(), caches[-1][1].sum()
            else:  # each step's cache is a new contiguous tensor, as torch.cat makes it
                caches = [(buffer_k[:, :, :s].contiguous(), buffer_v[:, :, :s].contiguous()) for s in lengths]
            implementations[name](query, *caches[0])  # warm: the first call of a shape class
            times[name].append(_loop(implementations[name], query, caches[1:]))
            del caches
    result = {name: statistics.median(t) for name, t in times.items()}
    speedup = statistics.median(theirs / ours for ours, theirs in zip(times["graphattn"], times["torch_sdpa"]))
    return {"bench": "decode_loop", "shape": shape_name, "n_hq_hkv_d": [n, hq, hkv, d], "dtype": dtype,
            "layout": layout, "start": args.start, "steps": args.steps, "rounds": args.rounds,
            "graphattn_us_per_step": round(result["graphattn"] * 1e6, 2),
            "torch_sdpa_us_per_step": round(result["torch_sdpa"] * 1e6, 2),
            "speedup_vs_torch_sdpa": round(speedup, 3),
            "round_lengths": [[args.start + r * args.steps, args.start + (r + 1) * args.steps - 1]
                              for r in range(args.rounds)],
            "graphattn_us_per_round": [round(t * 1e6, 2) for t in times["graphattn"]],
            "torch_sdpa_us_per_round": [round(t * 1e6, 2) for t in times["torch_sdpa"]],
            "cpu": cpu_model(), "threads": ga.thread_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--layouts", default="concat,static,paged")
    parser.add_argument("--block-size", type=int, default=16, help="rows per block of the paged layout")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--start", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for shape_name in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for layout in args.layouts.split(","):
                row = case(shape_name, dtype, layout, args)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print_table(rows, [("shape", "shape", "<15"), ("dtype", "dtype", "<5"), ("layout", "layout", "<7"),
                       ("graphattn_us_per_step", "graphattn us", ">12.1f"),
                       ("torch_sdpa_us_per_step", "torch us", ">9.1f"),
                       ("speedup_vs_torch_sdpa", "speedup", ">8.2f")])

if __name__ == "__main__":
    main()
