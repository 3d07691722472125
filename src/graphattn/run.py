"""run_graph: compile and execute every partition of a graph on NumPy inputs, in order."""
from __future__ import annotations

import numpy as np

from .dtypes import numpy_dtype
from .engine import Engine, Stream
from .logical_tensor import LogicalTensor
from .tensor import Tensor, element_strides


def run_graph(graph, inputs: dict[int, np.ndarray], policy: str = "fusion", engine: Engine | None = None,
              partitions=None) -> dict[int, np.ndarray]:
    """Runs the whole graph; returns {tensor id: array} for every partition output.

    Input arrays may be strided views: each partition is compiled for the
    layouts it is given.  Outputs are allocated dense.
    """
    engine = engine or Engine("cpu")
    stream = Stream(engine)
    values = dict(inputs)
    for partition in partitions if partitions is not None else graph.get_partitions(policy):
        in_ports = partition.get_input_ports()
        missing = [lt.id for lt in in_ports if lt.id not in values]
        if missing:
            raise ValueError(f"run_graph: no array given for input tensor(s) {missing}")
        in_lts = [LogicalTensor(lt.id, lt.dtype, values[lt.id].shape, element_strides(values[lt.id]))
                  for lt in in_ports]
        compiled = partition.compile(in_lts, partition.get_output_ports(), engine)
        out_arrays = {lt.id: np.empty(lt.shape, numpy_dtype(lt.dtype)) for lt in compiled.outputs}
        compiled.execute(stream,
                         [Tensor(lt, engine, values[lt.id]) for lt in compiled.inputs],
                         [Tensor(lt, engine, out_arrays[lt.id]) for lt in compiled.outputs])
        values.update(out_arrays)
    return {k: v for k, v in values.items() if k not in inputs}
