"""graphattn: fused scaled dot-product attention with oneDNN Graph's API, in Python.

Build a Graph of Ops over LogicalTensors, take its partitions, compile them
for concrete shapes and execute them on Tensors::

    import graphattn as ga
    graph = ga.Graph("cpu")
    ...
    for partition in graph.get_partitions():
        compiled = partition.compile(inputs, outputs, ga.Engine("cpu"))
        compiled.execute(ga.Stream(engine), input_tensors, output_tensors)
"""
from ._cpu import backward_isa, cpu_features, forward_isa, thread_count
from .dtypes import DataType
from .engine import Engine, Stream
from .graph import Graph
from .logical_tensor import Layout, LogicalTensor, Property
from .ops import Op, OpKind
from .partition import CompiledPartition, Partition
from .tensor import Tensor
from .verbose import set_verbose
from .kernel_choice import force_kernel, kernel_candidates
from . import run, testing  # noqa: F401  (ga.run.run_graph, ga.testing)
from .run import run_graph
from .functional import scaled_dot_product_attention
from .functional_backward import scaled_dot_product_attention_backward
from .varlen import varlen_attention, varlen_attention_backward
from .kv_cache import attention_with_kv_cache, kv_cache_append
from .kv_quant import dequantize_kv, quantize_kv

__version__ = "0.1.0"

__all__ = [
    "CompiledPartition", "DataType", "Engine", "Graph", "Layout", "LogicalTensor", "Op", "OpKind",
    "Partition", "Property", "Stream", "Tensor", "attention_with_kv_cache", "backward_isa", "cpu_features",
    "dequantize_kv", "force_kernel",
    "forward_isa", "kernel_candidates", "kv_cache_append", "quantize_kv", "run_graph", "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward", "set_verbose", "thread_count", "varlen_attention",
    "varlen_attention_backward",
]
