"""run_graph: compile and execute every partition of a graph on NumPy inputs, in order (on the CPU or on a
SYCL engine, the arrays then being copied to and from its queue)."""
from __future__ import annotations

import numpy as np

from . import sycl_runtime
from .dtypes import numpy_dtype
from .engine import Engine, Stream
from .logical_tensor import LogicalTensor
from .tensor import Tensor, array_strides


def run_graph(graph, inputs: dict[int, np.ndarray], policy: str = "fusion", engine: Engine | None = None,
              partitions=None) -> dict[int, np.ndarray]:
    """Runs the whole graph; returns {tensor id: array} for every partition output.

    Input arrays may be strided views: each partition is compiled for the
    layouts it is given.  Outputs are allocated dense.  On a SYCL engine,
    inputs of more than one element are copied to the engine's queue (dense),
    single values stay host scalars, and the outputs come back as NumPy.
    """
    engine = engine or Engine("cpu")
    stream = Stream(engine)
    values = {k: _to_device(v, engine) for k, v in inputs.items()} if engine.is_sycl else dict(inputs)
    for partition in partitions if partitions is not None else graph.get_partitions(policy):
        in_ports = partition.get_input_ports()
        missing = [lt.id for lt in in_ports if lt.id not in values]
        if missing:
            raise ValueError(f"run_graph: no array given for input tensor(s) {missing}")
        in_lts = [LogicalTensor(lt.id, lt.dtype, tuple(values[lt.id].shape), array_strides(values[lt.id]))
                  for lt in in_ports]
        compiled = partition.compile(in_lts, partition.get_output_ports(), engine)
        out_arrays = {lt.id: _empty(lt, engine) for lt in compiled.outputs}
        compiled.execute(stream,
                         [Tensor(lt, engine, values[lt.id]) for lt in compiled.inputs],
                         [Tensor(lt, engine, out_arrays[lt.id]) for lt in compiled.outputs])
        values.update(out_arrays)
    stream.wait()
    results = {k: v for k, v in values.items() if k not in inputs}
    if engine.is_sycl:
        bf16 = {lt.id for op in graph.ops for lt in op.outputs if lt.dtype.value == "bf16"}
        results = {k: sycl_runtime.to_host(v, bf16=k in bf16) for k, v in results.items()}
    return results


def _to_device(array: np.ndarray, engine: Engine):
    return array if array.size == 1 else sycl_runtime.to_device(array, engine.queue)


def _empty(lt: LogicalTensor, engine: Engine):
    dtype = numpy_dtype(lt.dtype)
    return sycl_runtime.empty(lt.shape, dtype, engine.queue) if engine.is_sycl else np.empty(lt.shape, dtype)
