"""graphattn's varlen call against what users do without it, in one process, interleaved.

Sequences of lengths drawn log-uniform in [--min-len, --max-len] (seeded), causal, forward and backward, per
dtype.  Contenders, each over the same sequences:
  varlen        ga.varlen_attention (ga.varlen_attention_backward) on the packed (T, H, D) tensors
  per_sequence  one dense graphattn call per sequence (bottom-right causal), the sum of their times
  padded        one dense graphattn call on the batch padded to the longest, with a key-padding bool mask
  torch_padded  torch's scaled_dot_product_attention on the same padded batch and mask (where torch is installed)
and, for a dense batch of --dense-batch sequences of --dense-len each, the varlen call against the dense call.
Prints a JSON line per case and a table; ratios are the contender's time over varlen's (> 1: varlen faster).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

import graphattn as ga
from bench_common import Progress, attention_flops, cpu_model, interleaved_times, median, print_table
from graphattn.testing import random_array

try:
    import torch
except ImportError:  # the peer is optional
    torch = None


def log_uniform_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(round(math.exp(x))) for x in rng.uniform(math.log(low), math.log(high), count)]


def cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def padded_batch(x: np.ndarray, cu_seqlens: np.ndarray, longest: int) -> np.ndarray:
    """(B, H, L, D) of a packed (T, H, D) tensor, each sequence padded with zeros to `longest` rows."""
    out = np.zeros((len(cu_seqlens) - 1, x.shape[1], longest, x.shape[2]), x.dtype)
    for b in range(len(cu_seqlens) - 1):
        out[b, :, :cu_seqlens[b + 1] - cu_seqlens[b]] = x[cu_seqlens[b]:cu_seqlens[b + 1]].swapaxes(0, 1)
    return out


def padding_mask(lengths, longest: int) -> np.ndarray:
    """(B, 1, L, L) bool: causal within each sequence (equal query and key lengths) and its keys only."""
    keep = np.arange(longest)[None, :] < np.array(lengths)[:, None]
    return (keep[:, None, :] & np.tril(np.ones((longest, longest), bool))[None])[:, None]


def as_torch(x: np.ndarray):
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def contenders(lengths, heads: int, kv_heads: int, d: int, dtype: str, backward: bool, rng, peers: bool) -> dict:
    cq = cu(lengths)
    total, longest = int(cq[-1]), max(lengths)
    q, k, v = (random_array((total, h, d), dtype, rng) for h in (heads, kv_heads, kv_heads))
    runs = {}
    out, stats = ga.varlen_attention(q, k, v, cq, cq, is_causal=True, return_stats=True)
    grad = random_array(out.shape, dtype, rng)
    seqs = [slice(int(cq[b]), int(cq[b + 1])) for b in range(len(lengths))]
    views = [tuple(x[s].swapaxes(0, 1) for x in (q, k, v)) for s in seqs]
    if backward:
        runs["varlen"] = lambda: ga.varlen_attention_backward(grad, q, k, v, out, stats, cq, cq, is_causal=True)
        dense = [ga.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True,
                                                 causal_alignment="bottom_right", return_stats=True) for qkv in views]
        grads = [grad[s].swapaxes(0, 1) for s in seqs]

        def per_sequence():
            for qkv, (o, st), g in zip(views, dense, grads):
                ga.scaled_dot_product_attention_backward(g, *qkv, o, st, is_causal=True, enable_gqa=True,
                                                         causal_alignment="bottom_right")
    else:
        runs["varlen"] = lambda: ga.varlen_attention(q, k, v, cq, cq, is_causal=True)

        def per_sequence():
            for qkv in views:
                ga.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    runs["per_sequence"] = per_sequence
    pq, pk, pv = (padded_batch(x, cq, longest) for x in (q, k, v))
    mask = padding_mask(lengths, longest)
    if backward:
        p_out, p_stats = ga.scaled_dot_product_attention(pq, pk, pv, mask, enable_gqa=True, return_stats=True)
        p_grad = padded_batch(grad, cq, longest)
        runs["padded"] = lambda: ga.scaled_dot_product_attention_backward(p_grad, pq, pk, pv, p_out, p_stats, mask,
                                                                          enable_gqa=True)
    else:
        runs["padded"] = lambda: ga.scaled_dot_product_attention(pq, pk, pv, mask, enable_gqa=True)
    if peers and torch is not None:
        tq, tk, tv = (as_torch(x).requires_grad_(backward) for x in (pq, pk, pv))
        t_mask = torch.from_numpy(mask)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if backward:
            t_out = sdpa(tq, tk, tv, attn_mask=t_mask, enable_gqa=True)
            t_grad = as_torch(padded_batch(grad, cq, longest))
            runs["torch_padded"] = lambda: t_out.backward(t_grad, retain_graph=True)
        else:
            def torch_padded():
                with torch.no_grad():
                    sdpa(tq, tk, tv, attn_mask=t_mask, enable_gqa=True)
            runs["torch_padded"] = torch_padded
    return runs


def dense_contenders(batch: int, length: int, heads: int, kv_heads: int, d: int, dtype: str, backward: bool,
                     rng) -> dict:
    """The varlen call on a dense batch against the dense call it equals (the same memory, (B, S, H, D))."""
    q, k, v = (random_array((batch, length, h, d), dtype, rng) for h in (heads, kv_heads, kv_heads))
    cq = cu([length] * batch)
    flat = [x.reshape(batch * length, *x.shape[2:]) for x in (q, k, v)]
    views = [x.swapaxes(1, 2) for x in (q, k, v)]
    if not backward:
        return {"varlen": lambda: ga.varlen_attention(*flat, cq, cq, is_causal=True),
                "dense": lambda: ga.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True)}
    out, stats = ga.varlen_attention(*flat, cq, cq, is_causal=True, return_stats=True)
    grad = random_array(out.shape, dtype, rng)
    d_out, d_stats = ga.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True, return_stats=True)
    d_grad = grad.reshape(batch, length, heads, -1).swapaxes(1, 2)
    return {"varlen": lambda: ga.varlen_attention_backward(grad, *flat, out, stats, cq, cq, is_causal=True),
            "dense": lambda: ga.scaled_dot_product_attention_backward(d_grad, *views, d_out, d_stats,
                                                                      is_causal=True, enable_gqa=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--passes", default="forward,backward")
    parser.add_argument("--dense-batch", type=int, default=4)
    parser.add_argument("--dense-len", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per contender and case")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (1 for calls of seconds)")
    parser.add_argument("--min-reps", type=int, default=3, help="timed calls per round at the least")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-peers", action="store_true", help="leave torch out")
    args = parser.parse_args()
    dtypes, passes = args.dtypes.split(","), args.passes.split(",")
    for name, values, allowed in (("--dtypes", dtypes, ("f32", "bf16", "f16")),
                                  ("--passes", passes, ("forward", "backward"))):
        if unknown := [x for x in values if x not in allowed]:
            parser.error(f"{name}: unknown {','.join(unknown)} (choose from {','.join(allowed)})")
    lengths = log_uniform_lengths(args.sequences, args.min_len, args.max_len, args.seed)
    rng = np.random.default_rng(args.seed)
    rows = []
    progress = Progress(2 * len(dtypes) * len(passes))
    for dtype in dtypes:
        for pass_name in passes:
            backward = pass_name == "backward"
            progress.step(f"{dtype} {pass_name} varlen")
            times = interleaved_times(contenders(lengths, args.heads, args.kv_heads, args.head_dim, dtype, backward,
                                                 rng, not args.no_peers), args.seconds, args.rounds,
                                  args.min_reps)
            flops = sum(attention_flops(1, args.heads, n, n, args.head_dim, causal=True, backward=backward)
                        for n in lengths)
            row = {"bench": "varlen", "pass": pass_name, "dtype": dtype, "lengths": lengths,
                   "heads": [args.heads, args.kv_heads], "head_dim": args.head_dim, "threads": ga.thread_count(),
                   "cpu": cpu_model()}
            for name, t in times.items():
                row[f"{name}_ms"] = round(median(t) * 1e3, 3)
            row["varlen_gflops"] = round(flops / (row["varlen_ms"] * 1e-3) / 1e9, 1)
            for name in times:  # from the medians themselves: rounded times of tiny calls gave ratios of 0
                if name != "varlen":
                    row[f"vs_{name}"] = float(f"{median(times[name]) / median(times['varlen']):.4g}")
            print(json.dumps(row), flush=True)
            rows.append(row)
            progress.step(f"{dtype} {pass_name} dense batch")
            times = interleaved_times(dense_contenders(args.dense_batch, args.dense_len, args.heads, args.kv_heads,
                                                       args.head_dim, dtype, backward, rng), args.seconds,
                                  args.rounds, args.min_reps)
            dense = {"bench": "varlen_dense", "pass": pass_name, "dtype": dtype,
                     "shape": [args.dense_batch, args.dense_len, args.heads, args.kv_heads, args.head_dim],
                     "threads": ga.thread_count(), "cpu": cpu_model(),
                     "varlen_ms": round(median(times["varlen"]) * 1e3, 3),
                     "dense_ms": round(median(times["dense"]) * 1e3, 3)}
            dense["vs_dense"] = float(f"{median(times['dense']) / median(times['varlen']):.4g}")
            print(json.dumps(dense), flush=True)
            rows.append(dense)
    varlen_rows = [r for r in rows if r["bench"] == "varlen"]
    for r in varlen_rows:
        for key in ("vs_per_sequence", "vs_padded", "vs_torch_padded"):
            r.setdefault(key, float("nan"))
    print_table(varlen_rows, [("pass", "pass", "<8"), ("dtype", "dtype", "<5"), ("varlen_ms", "varlen ms", ">10.2f"),
                              ("vs_per_sequence", "vs per-seq", ">10.2f"), ("vs_padded", "vs padded", ">9.2f"),
                              ("vs_torch_padded", "vs torch", ">8.2f")],
                f"{len(lengths)} sequences {min(lengths)}..{max(lengths)}, H {args.heads}/{args.kv_heads}, "
                f"D {args.head_dim}, causal; ratio = contender ms / varlen ms")
    dense_rows = [r for r in rows if r["bench"] == "varlen_dense"]
    print_table(dense_rows, [("pass", "pass", "<8"), ("dtype", "dtype", "<5"), ("varlen_ms", "varlen ms", ">10.2f"),
                             ("dense_ms", "dense ms", ">9.2f"), ("vs_dense", "dense/varlen", ">12.3f")],
                f"dense batch {args.dense_batch} x {args.dense_len} through varlen")


if __name__ == "__main__":
    main()
