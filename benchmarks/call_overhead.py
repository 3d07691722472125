"""Per-call overhead of ga.scaled_dot_product_attention on a tiny repeated call.

    python benchmarks/call_overhead.py [--calls 20000]

Shape (1, 1, 1, 1, 16): the kernel's work is negligible, so the time is the
Python path (cache lookup, binding, validation) plus the kernel launch.
Cases: NumPy inputs (plain, causal, stats); where torch is importable, torch
tensors of shape (1, 1, 1, 16) (torch) and, for scale, PyTorch's own
F.scaled_dot_product_attention on them (torch_sdpa).
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
    rows = []
    for name, (shape, fn) in cases.items():
        seconds = measure(fn, args.calls)
        row = {"bench": "call_overhead", "case": name, "shape": list(shape), "dtype": "f32",
               "us_per_call": round(seconds * 1e6, 2), "cpu": cpu_model(), "threads": ga.thread_count()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'case':<10} {'us/call':>8}   (cpu: {rows[0]['cpu']}, {rows[0]['threads']} threads)")
    for row in rows:
        print(f"{row['case']:<10} {row['us_per_call']:>8.1f}")


if __name__ == "__main__":
    main()
