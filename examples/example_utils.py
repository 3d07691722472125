"""Shared by the examples: compile the single partition, run it, time it, check it against NumPy."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.testing import assert_close


def run_and_check(graph: ga.Graph, data: dict[int, np.ndarray], out: ga.LogicalTensor,
                  reference: Callable[[], np.ndarray], dtype: str, title: str, repeats: int = 3) -> np.ndarray:
    """`reference` is called after the timing: NumPy's BLAS threads keep spinning after a
    matmul and would steal the cores from the kernel's OpenMP threads."""
    partitions = graph.get_partitions()
    print(f"{title}: {len(graph.ops)} ops -> {len(partitions)} partition(s): "
          + ", ".join(f"{p.kind} {p.get_ops()}" for p in partitions))
    assert len(partitions) == 1 and partitions[0].kind == "sdpa_forward", "the SDPA graph must fuse"
    engine = ga.Engine("cpu")
    stream = ga.Stream(engine)
    (partition,) = partitions
    compiled = partition.compile(partition.get_input_ports(), [out], engine)
    result = np.empty(compiled.query_logical_tensor(out.id).shape, numpy_dtype(out.dtype))
    inputs = [ga.Tensor(lt, engine, data[lt.id]) for lt in compiled.inputs]
    outputs = [ga.Tensor(compiled.query_logical_tensor(out.id), engine, result)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        compiled.execute(stream, inputs, outputs)
        stream.wait()
        times.append(time.perf_counter() - start)
    expected = reference()
    assert_close(result, expected, dtype, title)
    print(f"  kernel {compiled.kernel_name} (isa {ga.forward_isa()}): best {min(times[1:]) * 1e3:.3f} ms; "
          f"matches the NumPy reference (max abs error "
          f"{np.abs(result.astype(np.float64) - expected).max():.2e})")
    return result
