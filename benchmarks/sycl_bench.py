"""SYCL plugin benchmark: kernel time on a SYCL device (the OpenCL CPU device without a GPU) for the standard
shapes, and the kernel build time cold (fresh process, empty on-disk cache) and warm (on-disk cache).

    python benchmarks/sycl_bench.py [--shapes quick|standard] [--dtypes f32,bf16,f16]

Calls go through the graph API with the inputs already on the device; the time is one execute plus the wait.
For bf16/f16 both forward kernels are timed where the device keeps the XMX one.  Prints JSON lines, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench_common import Progress, attention_flops, cpu_model, time_call

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


def forward_call(shape, dtype: str, causal: bool, queue, rng):
    """(call, kernel name) for one compiled forward partition with its inputs and outputs on the queue."""
    import graphattn as ga
    from graphattn import sycl_runtime
    from graphattn.dtypes import numpy_dtype
    from graphattn.testing import SdpaGraphSpec

    if len(shape) == 6:
        n, hq, hkv, sq, skv, d = shape
    else:
        (n, hq, sq, d), hkv, skv = shape, shape[1], shape[2]
    spec = SdpaGraphSpec(batch=n, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d, dtype=dtype,
                         gqa="5d" if hkv != hq else "none", mask="causal_bottom_right" if causal else None)
    graph = spec.build()
    engine, (partition,) = ga.Engine(queue), graph.get_partitions()
    stream = ga.Stream(engine)
    values = {}
    for tensor_id, array in spec.random_inputs(rng).items():
        values[tensor_id] = array if array.size == 1 else sycl_runtime.to_device(array, queue)
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, tuple(values[lt.id].shape)) for lt in partition.get_input_ports()]
    compiled = partition.compile(in_lts, partition.get_output_ports(), engine)
    inputs = [ga.Tensor(lt, engine, values[lt.id]) for lt in compiled.inputs]
    outputs = [ga.Tensor(lt, engine, sycl_runtime.empty(lt.shape, numpy_dtype(lt.dtype), queue))
               for lt in compiled.outputs]

    def call():
        compiled.execute(stream, inputs, outputs)
        stream.wait()

    return call, compiled.kernel.isa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="quick")
    parser.add_argument("--dtypes", default="f32,bf16,f16")
    args = parser.parse_args()
    from graphattn import sycl_runtime

    sycl_runtime.configure_environment()  # before dpctl enumerates: the pip-installed OpenCL device
    import dpctl

    queue = dpctl.SyclQueue(dpctl.get_devices()[0])
    device = queue.sycl_device.name
    cold, warm = build_times()
    rows = [{"what": "build", "device": device, "cold_s": round(cold, 3), "warm_s": round(warm, 3)}]
    print(json.dumps(rows[0]), flush=True)
    rng = np.random.default_rng(0)
    dtypes = args.dtypes.split(",")
    modes = {dtype: ["off", "force"] if dtype != "f32" else ["off"] for dtype in dtypes}
    progress = Progress(len(SHAPES[args.shapes]) * 2 * sum(len(m) for m in modes.values()))
    for shape in SHAPES[args.shapes]:
        n, hq, hkv, sq, skv, d = shape if len(shape) == 6 else (shape[0], shape[1], shape[1], shape[2], shape[2],
                                                                 shape[3])
        for dtype in dtypes:
            for causal in (False, True):
                seen = set()
                for mode in modes[dtype]:
                    previous = sycl_runtime.set_matrix_kernels(mode)
                    try:
                        call, kernel = forward_call(shape, dtype, causal, queue, rng)
                        progress.step(f"{shape} {dtype} causal={causal} {kernel}")
                        family = kernel.split(" ")[0]
                        if family in seen:  # "force" fell back to the kernel already timed
                            continue
                        seen.add(family)
                        times = time_call(call, min_seconds=0.5, max_reps=10)
                    finally:
                        sycl_runtime.set_matrix_kernels(previous)
                    seconds = float(np.median(times))
                    flops = attention_flops(n, hq, sq, skv, d, causal=causal, alignment="bottom_right")
                    row = {"what": "forward", "shape": [n, hq, hkv, sq, skv, d], "dtype": dtype, "causal": causal,
                           "kernel": kernel, "ms": round(seconds * 1e3, 3), "gflops": round(flops / seconds / 1e9, 2),
                           "device": device}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nbuild: cold {cold:.2f} s, warm {warm:.2f} s ({device}; host CPU {cpu_model()})")
    print(f"{'shape (N,Hq,Hkv,Sq,Skv,D)':28} {'dtype':5} {'causal':6} {'kernel':10} {'ms':>10} {'GFLOP/s':>9}")
    for row in rows[1:]:
        kernel = row["kernel"].split(" ")[0]
        print(f"{str(tuple(row['shape'])):28} {row['dtype']:5} {str(row['causal']):6} {kernel:10} {row['ms']:10.3f} "
              f"{row['gflops']:9.2f}")


if __name__ == "__main__":
    main()
