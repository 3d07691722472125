"""Accuracy of the quantized K/V cache formats: decode over a cache quantized by ga.quantize_kv against the same
call over the unquantized f32 cache, on N(0, 1) keys and values and on keys with outlier channels (a few of D's
channels 20x the others, as LLM keys have).

    python benchmarks/kv_quant_accuracy.py [--cached 2048] [--head-dim 128] [--groups 32,64,128]

Prints a JSON line per (data, format, group size): the output's largest error and its RMS error relative to the
output's RMS, then a table.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import graphattn as ga
from bench_common import cpu_model, print_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--cached", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    b, s, h, hk, d = args.sequences, args.cached, args.heads, args.kv_heads, args.head_dim
    q = rng.standard_normal((b, 1, h, d)).astype(np.float32)
    lens = np.full(b, s, np.int32)
    outliers = rng.choice(d, size=max(1, d // 32), replace=False)
    rows = []
    for data in ("normal", "outlier_keys"):
        k = rng.standard_normal((b, s, hk, d)).astype(np.float32)
        v = rng.standard_normal((b, s, hk, d)).astype(np.float32)
        if data == "outlier_keys":
            k[..., outliers] *= 20.0
        want = ga.attention_with_kv_cache(q, k, v, cache_seqlens=lens)
        cases = [(f, int(g)) for f in ("u8", "s8", "u4", "s4") for g in args.groups.split(",") if d % int(g) == 0]
        cases += [("fp8_e4m3", 0), ("fp8_e5m2", 0)]
        for fmt, group in cases:
            kw = {} if group == 0 else {"group_size": group}
            kd, ks, kz = ga.quantize_kv(k, fmt, **kw)
            vd, vs, vz = ga.quantize_kv(v, fmt, **kw)
            got = ga.attention_with_kv_cache(q, kd, vd, cache_seqlens=lens, kv_format=fmt, k_scales=ks, v_scales=vs,
                                             k_zero_points=kz, v_zero_points=vz)
            err = got.astype(np.float64) - want
            row = {"bench": "kv_quant_accuracy", "data": data, "kv_format": fmt, "group": str(group or "tensor"),
                   "max_abs_err": float(f"{np.abs(err).max():.3g}"),
                   "rel_rms_err": float(f"{np.sqrt((err ** 2).mean() / (want.astype(np.float64) ** 2).mean()):.3g}"),
                   "cached": s, "head_dim": d, "threads": ga.thread_count(), "cpu": cpu_model()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print_table(rows, [("data", "data", "<14"), ("kv_format", "format", "<10"), ("group", "G", ">7"),
                       ("max_abs_err", "max |err|", ">10.3g"), ("rel_rms_err", "RMS err / RMS", ">14.3g")],
                f"decode over {b} x {s} cached rows, H {h}/{hk}, D {d}, f32 queries, against the unquantized cache")


if __name__ == "__main__":
    main()
