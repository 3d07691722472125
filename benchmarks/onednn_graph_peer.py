"""oneDNN Graph called directly through its C API (ctypes), as a benchmark peer.

The SDPA patterns of the oneDNN Graph specification (../shared/spec) come from the graphs the
tests build through graphattn's own graph API (graphattn.testing.SdpaGraphSpec), translated op by
op into oneDNN's: MatMul, Multiply by the scale, the implicit causal mask (GenIndex, GreaterEqual,
Select) or none, SoftMax, MatMul; GQA in its 5-D form (Q as (N, Hkv, Hq/Hkv, S, D), K and V as
(N, Hkv, 1, S, D)); and the training backward (Subtract and Exp of the stats, SoftMaxBackward, the
four MatMuls, TypeCast for bf16/f16, ReduceSum over a GQA group).  The forward is taken only where oneDNN returns one
partition holding every op; the backward, which oneDNN 3.13 does not fuse on CPUs, runs as the
partitions it makes.

Where it comes from: PyPI's `onednn` wheel (pip install onednn; 2026.1 is oneDNN 3.13).  That
build runs its CPU engine on the SYCL runtime, i.e. on the OpenCL CPU device of intel-opencl-rt,
which graphattn.sycl_runtime.configure_environment() makes visible (GRAPHATTN_BENCH_ONEDNN names
another libdnnl.so.3, its dependencies beside it and OCL_ICD_FILENAMES set by the caller).  With
that runtime oneDNN does not build its fused SDPA micro-kernel (the specification names OpenMP and
threadpool runtimes), so the partition goes to its primitive-based kernel (matmul and softmax
primitives with an O(S^2) scratchpad); `ONEDNN_VERBOSE=graph` prints the kernel it chose.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import sys

import numpy as np

import graphattn  # noqa: F401  (configures the OpenCL loader at import, before oneDNN enumerates devices)
from graphattn.dtypes import from_numpy
from graphattn.graph import Graph
from graphattn.interop import to_numpy
from graphattn.testing import SdpaGraphSpec

# Values of the C API's enums (oneapi/dnnl/dnnl_common_types.h and dnnl_graph_types.h of oneDNN 3.13).
_MAX_NDIMS = 12
_CPU_ENGINE = 1
_IN_ORDER_STREAM = 0x1
_FUSION_POLICY = 1
_DATA_TYPES = {"f16": 1, "bf16": 2, "f32": 3, "s32": 4, "boolean": 8}
_OP_KINDS = {"Add": 2, "Divide": 20, "Exp": 26, "MatMul": 39, "Multiply": 46, "ReduceSum": 57, "Select": 81,
             "SoftMax": 64, "SoftMaxBackward": 65, "Subtract": 74, "TypeCast": 77, "GenIndex": 84,
             "GreaterEqual": 85}
_ATTRS = {"axis": 0x30, "axes": 0x40, "keep_dims": 0x61, "transpose_a": 0x65, "transpose_b": 0x66,
          "auto_broadcast": 0x80, "mode": 0x84}
_STATUS = ["success", "out_of_memory", "invalid_arguments", "unimplemented", "last_impl_reached",
           "runtime_error", "not_required", "invalid_graph", "invalid_graph_op", "invalid_shape",
           "invalid_data_type"]
# Shared libraries libdnnl.so.3 needs that sit in the environment's lib/ rather than on the loader's path.
_DEPENDENCIES = ("libtbb.so.12", "libintlc.so.5", "libimf.so", "libsvml.so", "libsycl.so.9")

_Dims = ctypes.c_int64 * _MAX_NDIMS


class _LogicalTensor(ctypes.Structure):
    """dnnl_graph_logical_tensor_t."""

    class _Layout(ctypes.Union):
        _fields_ = [("strides", _Dims), ("layout_id", ctypes.c_size_t)]

    _fields_ = [("id", ctypes.c_size_t), ("ndims", ctypes.c_int), ("dims", _Dims), ("data_type", ctypes.c_int),
                ("property", ctypes.c_int), ("layout_type", ctypes.c_int), ("layout", _Layout)]


class OneDnnError(RuntimeError):
    """A oneDNN call failed; the message names the call and oneDNN's status."""


class _Library:
    """libdnnl's Graph C API with the process's CPU engine and stream."""

    def __init__(self, path: str):
        lib_dir = os.path.dirname(path)
        for name in _DEPENDENCIES:
            dependency = os.path.join(lib_dir, name)
            if os.path.exists(dependency):
                ctypes.CDLL(dependency, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(path)
        self.engine, self.stream = ctypes.c_void_p(), ctypes.c_void_p()
        if self.lib.dnnl_engine_get_count(_CPU_ENGINE) < 1:
            raise OneDnnError("oneDNN finds no CPU engine (its SYCL runtime needs the OpenCL CPU device of "
                              "intel-opencl-rt)")
        self.call("dnnl_engine_create", ctypes.byref(self.engine), _CPU_ENGINE, 0)
        self.call("dnnl_stream_create", ctypes.byref(self.stream), self.engine, _IN_ORDER_STREAM)

    def call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            what = _STATUS[status] if 0 <= status < len(_STATUS) else str(status)
            raise OneDnnError(f"{name} returned {what}")

    def version(self) -> str:
        class Version(ctypes.Structure):
            _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                        ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]
        self.lib.dnnl_version.restype = ctypes.POINTER(Version)
        v = self.lib.dnnl_version().contents
        return f"{v.major}.{v.minor}.{v.patch}"


@functools.lru_cache(maxsize=None)
def _library() -> _Library | str:
    """The loaded library, or why it cannot be used."""
    path = os.environ.get("GRAPHATTN_BENCH_ONEDNN") or os.path.join(sys.prefix, "lib", "libdnnl.so.3")
    if not os.path.exists(path):
        return f"oneDNN is not installed (pip install onednn; no {path})"
    try:
        return _Library(path)
    except (OSError, OneDnnError) as why:
        return f"oneDNN cannot be loaded: {why}"


def onednn_version() -> str | None:
    """oneDNN's version, or None where it cannot be used."""
    lib = _library()
    return lib.version() if isinstance(lib, _Library) else None


def unavailable_reason() -> str | None:
    """Why this peer cannot run here, or None when it can."""
    lib = _library()
    return None if isinstance(lib, _Library) else lib


def _arrays(*tensors) -> list[np.ndarray]:
    """NumPy views of torch tensors or NumPy arrays (same memory), as graphattn takes them; the patterns'
    logical tensors are dense, so each must be C-contiguous."""
    arrays = []
    for tensor, name in zip(tensors, ("query", "key", "value", "grad_out", "stats")):
        array = to_numpy(tensor, name)[0]
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}: the oneDNN peer takes C-contiguous tensors only")
        arrays.append(array)
    return arrays


def _dtype_name(array: np.ndarray) -> str:
    return from_numpy(array.dtype).value


class _PatternGraph:
    """A graphattn Graph restated in oneDNN's Graph API (same op kinds, attributes and tensor ids)."""

    def __init__(self, lib: _Library, graph: Graph):
        self.lib = lib
        self.graph = ctypes.c_void_p()
        lib.call("dnnl_graph_graph_create", ctypes.byref(self.graph), _CPU_ENGINE)
        self.ops: list[ctypes.c_void_p] = []
        self.tensors: dict[int, _LogicalTensor] = {}
        for op in graph.ops:
            self._add_op(op)

    def tensor(self, lt) -> _LogicalTensor:
        """oneDNN's logical tensor for graphattn's `lt` (strided, as graphattn's are)."""
        if lt.id not in self.tensors:
            found = self.tensors[lt.id] = _LogicalTensor()
            self.lib.call("dnnl_graph_logical_tensor_init_with_strides", ctypes.byref(found), ctypes.c_size_t(lt.id),
                          _DATA_TYPES[lt.dtype.value], lt.ndim, _Dims(*lt.shape), _Dims(*lt.strides), 0)
        return self.tensors[lt.id]

    def _add_op(self, source) -> None:
        kind = source.kind.value
        if kind not in _OP_KINDS:
            raise OneDnnError(f"the peer does not pass {kind} ops to oneDNN")
        op = ctypes.c_void_p()
        self.lib.call("dnnl_graph_op_create", ctypes.byref(op), ctypes.c_size_t(source.id), _OP_KINDS[kind],
                      source.name.encode())
        self.ops.append(op)
        for lt in source.inputs:
            self.lib.call("dnnl_graph_op_add_input", op, ctypes.byref(self.tensor(lt)))
        for lt in source.outputs:
            self.lib.call("dnnl_graph_op_add_output", op, ctypes.byref(self.tensor(lt)))
        for name, value in source.attrs.items():
            if name not in _ATTRS:
                if value != source.schema.attrs[name].default:
                    raise OneDnnError(f"{kind}: the peer does not pass attribute {name} to oneDNN")
                continue
            if isinstance(value, bool):
                self.lib.call("dnnl_graph_op_set_attr_bool", op, _ATTRS[name], ctypes.byref(ctypes.c_uint8(value)), 1)
            elif isinstance(value, int):
                self.lib.call("dnnl_graph_op_set_attr_s64", op, _ATTRS[name], ctypes.byref(ctypes.c_int64(value)), 1)
            elif isinstance(value, (list, tuple)):
                self.lib.call("dnnl_graph_op_set_attr_s64", op, _ATTRS[name], (ctypes.c_int64 * len(value))(*value),
                              len(value))
            else:
                self.lib.call("dnnl_graph_op_set_attr_str", op, _ATTRS[name], str(value).encode(), len(str(value)))
        self.lib.call("dnnl_graph_add_op", self.graph, op)

    def compile(self, output_ids, allow_split: bool = False) -> "_CompiledGraph":
        """The graph compiled: as one partition holding every op, or, with allow_split, as the partitions
        oneDNN makes of it (run in the topological order it returns them in).  OneDnnError otherwise."""
        call = self.lib.call
        call("dnnl_graph_graph_finalize", self.graph)
        call("dnnl_graph_graph_filter", self.graph, _FUSION_POLICY)
        count = ctypes.c_size_t()
        call("dnnl_graph_graph_get_partition_num", self.graph, ctypes.byref(count))
        handles = (ctypes.c_void_p * count.value)()
        call("dnnl_graph_graph_get_partitions", self.graph, count, handles)
        partitions = [ctypes.c_void_p(h) for h in handles]
        outputs = [self.tensors[i] for i in output_ids]
        parts, ops_taken = [], 0
        try:
            if count.value != 1 and not allow_split:
                raise OneDnnError(f"oneDNN split the pattern into {count.value} partitions")
            for partition in partitions:
                supported, op_count = ctypes.c_uint8(), ctypes.c_size_t()
                call("dnnl_graph_partition_is_supported", partition, ctypes.byref(supported))
                call("dnnl_graph_partition_get_op_num", partition, ctypes.byref(op_count))
                if not supported.value:
                    raise OneDnnError("oneDNN cannot run one of the pattern's partitions")
                ops_taken += op_count.value
                parts.append(self._compile_partition(partition, outputs))
        finally:
            for partition in partitions:
                call("dnnl_graph_partition_destroy", partition)
            for op in self.ops:
                call("dnnl_graph_op_destroy", op)
            call("dnnl_graph_graph_destroy", self.graph)
        if ops_taken != len(self.ops):
            raise OneDnnError(f"oneDNN's partitions hold {ops_taken} of the pattern's {len(self.ops)} ops")
        return _CompiledGraph(self.lib, parts)

    def _compile_partition(self, partition, outputs):
        """(compiled partition, input ports, output ports); the pattern's outputs keep the shapes asked for."""
        call = self.lib.call
        ports = []
        for kind in ("input", "output"):
            port_count = ctypes.c_size_t()
            call(f"dnnl_graph_partition_get_{kind}_ports_num", partition, ctypes.byref(port_count))
            found = (_LogicalTensor * port_count.value)()
            call(f"dnnl_graph_partition_get_{kind}_ports", partition, port_count, found)
            ports.append(list(found))
        inputs, part_outputs = ports
        by_id = {lt.id: lt for lt in outputs}
        part_outputs = [by_id.get(port.id, port) for port in part_outputs]
        compiled = ctypes.c_void_p()
        call("dnnl_graph_compiled_partition_create", ctypes.byref(compiled), partition)
        input_refs = (ctypes.POINTER(_LogicalTensor) * len(inputs))(*[ctypes.pointer(lt) for lt in inputs])
        output_refs = (ctypes.POINTER(_LogicalTensor) * len(part_outputs))(
            *[ctypes.pointer(lt) for lt in part_outputs])
        try:
            call("dnnl_graph_partition_compile", partition, compiled, len(inputs), input_refs, len(part_outputs),
                 output_refs, self.lib.engine)
        except OneDnnError:
            call("dnnl_graph_compiled_partition_destroy", compiled)
            raise
        return compiled, inputs, part_outputs


class _CompiledGraph:
    """Compiled partitions bound to their buffers (NumPy arrays, kept alive here)."""

    def __init__(self, lib: _Library, parts):
        self.lib, self.parts = lib, parts
        self.partition_count = len(parts)
        self.buffers: dict[int, object] = {}
        self.tensors: list[ctypes.c_void_p] = []
        self.calls: list = []

    def bind(self, buffers: dict[int, object]) -> None:
        """buffers: logical tensor id -> NumPy array, for the pattern's inputs and outputs; tensors passed from
        one partition to the next get buffers of their own."""
        self.buffers = dict(buffers)
        for compiled, inputs, outputs in self.parts:
            handles = []
            for lt in inputs + outputs:
                if lt.id not in self.buffers:
                    size = ctypes.c_size_t()
                    self.lib.call("dnnl_graph_logical_tensor_get_mem_size", ctypes.byref(lt), ctypes.byref(size))
                    self.buffers[lt.id] = np.empty(size.value, dtype=np.uint8)
                handle = ctypes.c_void_p()
                self.lib.call("dnnl_graph_tensor_create", ctypes.byref(handle), ctypes.byref(lt), self.lib.engine,
                              ctypes.c_void_p(self.buffers[lt.id].ctypes.data))
                handles.append(handle)
            self.tensors += handles
            self.calls.append((compiled, len(inputs), (ctypes.c_void_p * len(inputs))(*handles[:len(inputs)]),
                               len(outputs), (ctypes.c_void_p * len(outputs))(*handles[len(inputs):])))

    def __call__(self) -> None:
        for compiled, n_in, ins, n_out, outs in self.calls:
            self.lib.call("dnnl_graph_compiled_partition_execute", compiled, self.lib.stream, n_in, ins, n_out, outs)
        self.lib.call("dnnl_stream_wait", self.lib.stream)

    def __del__(self):
        try:
            for handle in self.tensors:
                self.lib.lib.dnnl_graph_tensor_destroy(handle)
            for compiled, _, _ in self.parts:
                self.lib.lib.dnnl_graph_compiled_partition_destroy(compiled)
        except Exception:  # interpreter shutdown
            pass


def _scalar(value: float, dtype) -> np.ndarray:
    return np.full((1,), value, dtype=dtype)


def _spec(q, k, **variant) -> SdpaGraphSpec:
    """The SdpaGraphSpec of q (N, Hq, Sq, D) and k (N, Hkv, Skv, D): 4-D, or GQA's 5-D form."""
    n, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    return SdpaGraphSpec(batch=n, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
                         dtype=_dtype_name(q), gqa="none" if hq == hkv else "5d", **variant)


def _bind(lib: _Library, spec: SdpaGraphSpec, graph: Graph, data: dict, outputs: list[str], allow_split: bool):
    """The graph compiled, bound to data (role -> array, reshaped to the graph's shapes) and to new output
    arrays; returns (callable, outputs in their 4-D shapes)."""
    pattern = _PatternGraph(lib, graph)
    ids = [spec.ids[role] for role in outputs]
    run = pattern.compile(ids, allow_split=allow_split)
    buffers = {spec.ids[role]: array.reshape(graph.tensor(spec.ids[role]).shape) for role, array in data.items()}
    results = [np.empty(graph.tensor(i).shape, data["query"].dtype) for i in ids]
    buffers.update(zip(ids, results))
    run.bind(buffers)
    return run, results


def _inputs(lib, *tensors):
    if not isinstance(lib, _Library):
        raise OneDnnError(lib)
    return _arrays(*tensors)


def sdpa_forward(q, k, v, causal: bool):
    """A callable running inference SDPA on q (N, Hq, Sq, D), k and v (N, Hkv, Skv, D) through oneDNN
    Graph (contiguous torch tensors or NumPy arrays of one dtype; Hkv dividing Hq), and its output (NumPy).
    OneDnnError where oneDNN does not take the pattern as one compiled partition.  Causal: the implicit
    mask, top-left aligned (as graphattn's and PyTorch's is_causal)."""
    lib = _library()
    q, k, v = _inputs(lib, q, k, v)
    spec = _spec(q, k, mask="causal_top_left" if causal else None, softmax_mode="inf_as_zero")
    graph = spec.build()
    data = {"query": q, "key": k, "value": v, "scale": _scalar(1.0 / math.sqrt(q.shape[-1]), q.dtype)}
    if causal:
        data["fill"] = _scalar(float("-inf"), np.float32)
    run, (out,) = _bind(lib, spec, graph, data, ["output"], allow_split=False)
    return run, out.reshape(q.shape)


def sdpa_backward(q, k, v, grad_out, stats, causal: bool):
    """A callable running the training backward through oneDNN Graph (as the partitions oneDNN makes of
    it), and its (dQ, dK, dV) (NumPy).  stats: the forward's f32 logsumexp of the scaled (masked) scores,
    shape (N, Hq, Sq, 1).  The specification's backward takes explicit masks only, so a causal call adds
    a (Sq, Skv) -inf mask (top-left aligned)."""
    lib = _library()
    q, k, v, grad_out, stats = _inputs(lib, q, k, v, grad_out, stats)
    sq, skv = q.shape[2], k.shape[2]
    spec = _spec(q, k, mask="add" if causal else None, mask_shape=(sq, skv) if causal else None)
    graph = spec.build_backward()
    data = {"query": q, "key": k, "value": v, "grad_output": grad_out, "stats": stats,
            "scale": _scalar(1.0 / math.sqrt(q.shape[-1]), q.dtype)}
    if causal:
        data["mask"] = np.triu(np.full((sq, skv), -np.inf, dtype=q.dtype), 1)
    run, grads = _bind(lib, spec, graph, data, ["grad_query", "grad_key", "grad_value"], allow_split=True)
    return run, tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))
