"""Shared by the examples: compile the single partition, run it, time it, check it against NumPy."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.testing import assert_close


def run_fused(graph: ga.Graph, data: dict[int, np.ndarray], outs: list[ga.LogicalTensor], kind: str,
              title: str, repeats: int = 3) -> tuple[list[np.ndarray], float, str]:
    """Compiles the graph's single partition (which must be of `kind`), runs it `repeats` times after a
    warm-up, and returns its outputs, the best time in ms and the kernel's description."""
    partitions = graph.get_partitions()
    print(f"{title}: {len(graph.ops)} ops -> {len(partitions)} partition(s): "
          + ", ".join(f"{p.kind} {p.get_ops()}" for p in partitions))
    assert len(partitions) == 1 and partitions[0].kind == kind, f"the graph must fuse into one {kind} partition"
    engine = ga.Engine("cpu")
    stream = ga.Stream(engine)
    (partition,) = partitions
    compiled = partition.compile(partition.get_input_ports(), outs, engine)
    results = [np.empty(compiled.query_logical_tensor(o.id).shape, numpy_dtype(o.dtype)) for o in outs]
    inputs = [ga.Tensor(lt, engine, data[lt.id]) for lt in compiled.inputs]
    outputs = [ga.Tensor(compiled.query_logical_tensor(o.id), engine, r) for o, r in zip(outs, results)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        compiled.execute(stream, inputs, outputs)
        stream.wait()
        times.append(time.perf_counter() - start)
    kernel = f"{compiled.kernel_name} (isa {getattr(compiled.kernel, 'isa', 'reference')})"
    return results, min(times[1:]) * 1e3, kernel


def run_and_check(graph: ga.Graph, data: dict[int, np.ndarray], out: ga.LogicalTensor,
                  reference: Callable[[], np.ndarray], dtype: str, title: str, repeats: int = 3) -> np.ndarray:
    """`reference` is called after the timing: NumPy's BLAS threads keep spinning after a
    matmul and would steal the cores from the kernel's OpenMP threads."""
    (result,), best_ms, kernel = run_fused(graph, data, [out], "sdpa_forward", title, repeats)
    expected = reference()
    assert_close(result, expected, dtype, title)
    print(f"  kernel {kernel}: best {best_ms:.3f} ms; matches the NumPy reference (max abs error "
          f"{np.abs(result.astype(np.float64) - expected).max():.2e})")
    return result
