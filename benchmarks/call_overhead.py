"""Per-call overhead of ga.scaled_dot_product_attention on a tiny repeated call.

    python benchmarks/call_overhead.py [--calls 20000]

Shape (1, 1, 1, 1, 16): the kernel's work is negligible, so the time is the
Python path (cache lookup, binding, validation) plus the kernel launch.
Cases: NumPy inputs (plain, causal, stats); where torch is importable, torch
tensors of shape (1, 1, 1, 16) (torch) and, for scale, PyTorch's own
F.scaled_dot_product_attention on them (torch_sdpa).
Also a decode call (1, 32, 1, 128) against K/V (1, 8, S, 128) at NEW_LENGTHS lengths S each seen for the
first time (new_length: a plan is made per new signature), then the same lengths again (repeat_length), on
NumPy and, where importable, torch inputs.
Prints one JSON line per case and a table.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import graphattn as ga
from bench_common import cpu_model

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch cases are optional
    torch = None


def measure(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        best = min(best, (time.perf_counter() - start) / (calls // 5))
    return best


NEW_LENGTHS = 100


def length_cases(rng, first_length: int) -> dict:
    """{name: (shape, seconds per call)} of decode calls whose K/V length is new on each call, then repeated."""
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    kvs = [rng.standard_normal((1, 8, first_length + i, 128)).astype(np.float32) for i in range(NEW_LENGTHS)]
    kinds = {"": (q, kvs)}
    if torch is not None:
        kinds["torch_"] = (torch.from_numpy(q), [torch.from_numpy(kv) for kv in kvs])
    cases = {}
    for prefix, (query, keys) in kinds.items():
        for name in ("new_length", "repeat_length"):  # the second pass finds every plan cached
            start = time.perf_counter()
            for kv in keys:
                ga.scaled_dot_product_attention(query, kv, kv, enable_gqa=True)
            cases[prefix + name] = (tuple(keys[0].shape), (time.perf_counter() - start) / len(keys))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 1, 1, 16)).astype(np.float32)
    cases = {  # name: (the inputs' shape, the call)
        "plain": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x)),
        "causal": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x, is_causal=True)),
        "stats": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x, return_stats=True)),
    }
    if torch is not None:  # graphattn on torch tensors, and PyTorch's own call on them for scale
        t = torch.from_numpy(x[0])  # 4-D: PyTorch takes 5-D inputs down a slower path (17 us against 4 us)
        cases["torch"] = (t.shape, lambda: ga.scaled_dot_product_attention(t, t, t))
        cases["torch_sdpa"] = (t.shape, lambda: F.scaled_dot_product_attention(t, t, t))
    timed = {name: (shape, measure(fn, args.calls)) for name, (shape, fn) in cases.items()}
    timed.update(length_cases(rng, 1000))
    rows = []
    for name, (shape, seconds) in timed.items():
        row = {"bench": "call_overhead", "case": name, "shape": list(shape), "dtype": "f32",
               "us_per_call": round(seconds * 1e6, 2), "cpu": cpu_model(), "threads": ga.thread_count()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'case':<20} {'us/call':>8}   (cpu: {rows[0]['cpu']}, {rows[0]['threads']} threads)")
    for row in rows:
        print(f"{row['case']:<20} {row['us_per_call']:>8.1f}")


if __name__ == "__main__":
    main()
