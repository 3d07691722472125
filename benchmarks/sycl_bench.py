"""SYCL plugin benchmark: kernel time on a SYCL device (the OpenCL CPU device without a GPU) for the standard
shapes, and the kernel build time cold (fresh process, empty on-disk cache) and warm (on-disk cache).

    python benchmarks/sycl_bench.py [--shapes quick|standard] [--dtypes f32,f16]

Prints JSON lines, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench_common import attention_flops, cpu_model, time_call

SHAPES = {
    "quick": [(1, 16, 256, 64), (1, 32, 8, 1, 1024, 128)],
    "standard": [(1, 16, 1024, 64), (1, 16, 2048, 128), (4, 32, 512, 64), (1, 2, 2048, 64), (1, 32, 8, 1, 4096, 128)],
}

BUILD_PROBE = ("import time, graphattn, dpctl; from graphattn import _sycl; "
               "q = dpctl.SyclQueue(dpctl.get_devices()[0]); t = time.perf_counter(); "
               "_sycl.build_kernels(q, 0, 64, 64, True); print(time.perf_counter() - t)")


def build_times() -> tuple[float, float]:
    """(cold, warm) seconds to build the forward and backward kernels in a fresh process."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, SYCL_CACHE_DIR=cache, SYCL_CACHE_PERSISTENT="1")
        runs = [float(subprocess.run([sys.executable, "-c", BUILD_PROBE], env=env, check=True, capture_output=True,
                                     text=True).stdout.split()[-1]) for _ in range(2)]
    return runs[0], runs[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="quick")
    parser.add_argument("--dtypes", default="f32,f16")
    args = parser.parse_args()
    import dpctl
    import dpnp

    import graphattn as ga

    queue = dpctl.SyclQueue(dpctl.get_devices()[0])
    cold, warm = build_times()
    rows = [{"what": "build", "device": queue.sycl_device.name, "cold_s": round(cold, 3), "warm_s": round(warm, 3)}]
    print(json.dumps(rows[0]), flush=True)
    rng = np.random.default_rng(0)
    for shape in SHAPES[args.shapes]:
        if len(shape) == 6:
            n, hq, hkv, sq, skv, d = shape
        else:
            (n, hq, sq, d), hkv, skv = shape, shape[1], shape[2]
        for dtype in args.dtypes.split(","):
            np_dtype = {"f32": np.float32, "f16": np.float16}[dtype]
            q = dpnp.asarray(rng.standard_normal((n, hq, sq, d)).astype(np_dtype), sycl_queue=queue)
            k = dpnp.asarray(rng.standard_normal((n, hkv, skv, d)).astype(np_dtype), sycl_queue=queue)
            v = dpnp.asarray(rng.standard_normal((n, hkv, skv, d)).astype(np_dtype), sycl_queue=queue)
            for causal in (False, True):
                times = time_call(lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                          enable_gqa=hq != hkv), min_seconds=0.5,
                                  max_reps=10)
                seconds = float(np.median(times))
                flops = attention_flops(n, hq, sq, skv, d, causal=causal)
                row = {"what": "forward", "shape": [n, hq, hkv, sq, skv, d], "dtype": dtype, "causal": causal,
                       "ms": round(seconds * 1e3, 3), "gflops": round(flops / seconds / 1e9, 2),
                       "device": queue.sycl_device.name}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nbuild: cold {cold:.2f} s, warm {warm:.2f} s ({rows[0]['device']}; host CPU {cpu_model()})")
    print(f"{'shape (N,Hq,Hkv,Sq,Skv,D)':28} {'dtype':5} {'causal':6} {'ms':>10} {'GFLOP/s':>9}")
    for row in rows[1:]:
        print(f"{str(tuple(row['shape'])):28} {row['dtype']:5} {str(row['causal']):6} {row['ms']:10.3f} {row['gflops']:9.2f}")


if __name__ == "__main__":
    main()
