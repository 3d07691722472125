"""Partitions (fused or single-op subgraphs) and their compiled, executable form."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import _cpu, sycl_runtime, verbose
from .dtypes import numpy_dtype
from .engine import Engine, Stream
from .kernels.fused_sdpa import FusedSdpaForward, LengthReplay, NotUsable
from .kernels.fused_sdpa_backward import BackwardLengthReplay, FusedSdpaBackward
from .kernels.reference import ReferenceKernel, SyclHostFallback
from .logical_tensor import UNKNOWN_DIM, LogicalTensor, dense_strides
from .ops import Op, OpKind
from .patterns.sdpa import NoMatch, SdpaMatch, match_sdpa
from .patterns.sdpa_backward import SdpaBackwardMatch, match_sdpa_backward
from .plan_cache import SignatureCache
from .tensor import Tensor, array_strides, element_strides
from .views import overlaps_itself


class Partition:
    """A set of ops compiled and executed as one unit.

    kind is "sdpa_forward" or "sdpa_backward" for a fused attention pattern,
    "op" for a single op run by the reference executor.  Every partition is
    supported.
    """

    def __init__(self, graph, partition_id: int, ops: list[Op], kind: str,
                 match: SdpaMatch | SdpaBackwardMatch | None = None, reason: str = ""):
        self.id = partition_id
        self.kind = kind
        self.reason = reason
        self._graph = graph
        self._ops = ops
        self._match = match
        op_ids = {op.id for op in ops}
        produced = {lt.id for op in ops for lt in op.outputs}
        self._inputs: list[LogicalTensor] = []
        for op in ops:
            for lt in op.inputs:
                if lt.id not in produced and lt.id not in {t.id for t in self._inputs}:
                    self._inputs.append(graph.tensor(lt.id))
        self._outputs: list[LogicalTensor] = []
        for op in ops:
            for lt in op.outputs:
                used_outside = any(c.id not in op_ids for c in graph.consumers(lt.id))
                if used_outside or not graph.consumers(lt.id) or graph.is_marked_output(lt.id):
                    self._outputs.append(graph.tensor(lt.id))

    def is_supported(self) -> bool:
        """Always True: every partition runs, fused or on the reference executor."""
        return True

    def get_ops(self) -> list[int]:
        """Ids of the partition's ops, in topological order."""
        return [op.id for op in self._ops]

    def get_ops_num(self) -> int:
        """Number of ops in the partition."""
        return len(self._ops)

    def get_input_ports(self) -> list[LogicalTensor]:
        """The logical tensors the partition reads (compile needs a concrete one for each)."""
        return list(self._inputs)

    def get_output_ports(self) -> list[LogicalTensor]:
        """The logical tensors the partition writes."""
        return list(self._outputs)

    def compile(self, inputs: Sequence[LogicalTensor], outputs: Sequence[LogicalTensor], engine: Engine):
        """Compiles for concrete input shapes and layouts (and optional output layouts); returns a CompiledPartition.
        The fused kernel is chosen here, or the reference with the reason logged.  Inputs with unknown (-1)
        dims give a DynamicCompiledPartition, which serves every size of those dims."""
        if not isinstance(engine, Engine):
            raise TypeError(f"partition {self.id}: compile needs an Engine, got {type(engine).__name__}")
        if any(isinstance(lt, LogicalTensor) and not lt.is_shape_known() for lt in inputs):
            return DynamicCompiledPartition(self, self._concrete_inputs(inputs, unknown_dims=True), outputs, engine)
        lts = self._concrete_inputs(inputs)
        shapes = self._infer_shapes(lts)
        lts.update(self._concrete_outputs(outputs, shapes))
        kernel = self._choose_kernel(lts, shapes, engine)
        return CompiledPartition(self, [lts[t.id] for t in self._inputs], [lts[t.id] for t in self._outputs], kernel)

    # ---- compile steps -------------------------------------------------------------
    def _where(self, lt_id: int) -> str:
        return f"partition {self.id}: tensor {lt_id}"

    def _concrete_inputs(self, inputs, unknown_dims: bool = False) -> dict[int, LogicalTensor]:
        """The input ports' logical tensors, checked against the graph's; unknown_dims lets them keep -1 dims."""
        given = _by_id(inputs, f"partition {self.id}: compile inputs")
        lts = {}
        for port in self._inputs:
            lt = given.pop(port.id, None)
            if lt is None:
                raise ValueError(f"{self._where(port.id)}: compile is missing this input logical tensor "
                                 f"(input ports are {[t.id for t in self._inputs]})")
            if not unknown_dims and not lt.is_shape_known():
                raise ValueError(f"{self._where(port.id)}: compile needs a concrete shape, got {lt.shape}")
            _check_matches_port(lt, port, self._where(port.id))
            lts[port.id] = lt
        if given:
            raise ValueError(f"partition {self.id}: compile got logical tensors {sorted(given)} that are not "
                             f"input ports (input ports are {[t.id for t in self._inputs]})")
        return lts

    def _infer_shapes(self, lts) -> dict[int, tuple[int, ...]]:
        shapes = {tid: lt.shape for tid, lt in lts.items()}
        for op in self._ops:
            inferred = op.schema.infer(op.attrs, [shapes[lt.id] for lt in op.inputs], op.where)
            for lt, shape in zip(op.outputs, inferred):
                declared = self._graph.tensor(lt.id).shape
                if len(declared) != len(shape) or any(d not in (-1, s) for d, s in zip(declared, shape)):
                    raise ValueError(f"{op.where}: output tensor {lt.id} is declared {declared} "
                                     f"but the op produces {tuple(shape)} for these input shapes")
                shapes[lt.id] = tuple(shape)
        return shapes

    def _concrete_outputs(self, outputs, shapes) -> dict[int, LogicalTensor]:
        given = _by_id(outputs, f"partition {self.id}: compile outputs")
        lts = {}
        for port in self._outputs:
            lt = given.pop(port.id, None) or port
            _check_matches_port(lt, port, self._where(port.id))
            shape = shapes[port.id]
            if any(d not in (-1, s) for d, s in zip(lt.shape, shape)):
                raise ValueError(f"{self._where(port.id)}: output declared {lt.shape} but the partition produces {shape}")
            lts[port.id] = lt.with_shape(shape, lt.strides if lt.has_explicit_strides else None)
            if overlaps_itself(shape, lts[port.id].strides):
                raise ValueError(f"{self._where(port.id)}: output strides {lts[port.id].strides} put several elements "
                                 f"of shape {shape} in one place; an output needs a location for each element")
        if given:
            raise ValueError(f"partition {self.id}: compile got logical tensors {sorted(given)} that are not "
                             f"output ports (output ports are {[t.id for t in self._outputs]})")
        return lts

    def probe_kernel(self, inputs: Sequence[LogicalTensor], outputs: Sequence[LogicalTensor], engine: Engine):
        """The fused kernel compile would choose for these concrete logical tensors, or None where the
        partition has no fused pattern, the shapes break a rule or the kernel declines them; nothing is
        logged (a dynamic partition's length replay probes other lengths with it)."""
        if self._match is None:
            return None
        try:
            lts = self._concrete_inputs(inputs)
            shapes = self._infer_shapes(lts)
            lts.update(self._concrete_outputs(outputs, shapes))
            kernel_type = FusedSdpaBackward if self.kind == "sdpa_backward" else FusedSdpaForward
            return kernel_type(self._match, lts, shapes, engine)
        except (NotUsable, ValueError, TypeError):
            return None

    def _choose_kernel(self, lts, shapes, engine):
        kernel = self._fused_or_reference(lts, shapes, engine)
        return SyclHostFallback(kernel, self._ops) if engine.is_sycl and isinstance(kernel, ReferenceKernel) else kernel

    def _fused_or_reference(self, lts, shapes, engine):
        if self._match is not None:
            try:
                kernel_type = FusedSdpaBackward if self.kind == "sdpa_backward" else FusedSdpaForward
                kernel = kernel_type(self._match, lts, shapes, engine)
                if verbose.enabled():  # the dispatch text plans the work again: only for the log
                    verbose.log("compile", f"partition={self.id}", kernel.name, kernel.dispatch_text(),
                                kernel.shape_text)
                return kernel
            except NotUsable as why:
                verbose.log("compile", f"partition={self.id}", "reference", f"fused kernel not usable: {why}")
                return ReferenceKernel(self._ops, str(why))
        verbose.log("compile", f"partition={self.id}", "reference", self.reason)
        return ReferenceKernel(self._ops, self.reason)

    def __repr__(self) -> str:
        return f"Partition(id={self.id}, kind={self.kind}, ops={self.get_ops()})"


def _by_id(lts, what: str) -> dict[int, LogicalTensor]:
    result: dict[int, LogicalTensor] = {}
    for lt in lts:
        if not isinstance(lt, LogicalTensor):
            raise TypeError(f"{what}: expected LogicalTensors, got {type(lt).__name__}")
        if lt.id in result:
            raise ValueError(f"{what}: logical tensor id {lt.id} appears twice")
        result[lt.id] = lt
    return result


def _check_matches_port(lt: LogicalTensor, port: LogicalTensor, where: str) -> None:
    if lt.dtype != port.dtype:
        raise TypeError(f"{where}: dtype {lt.dtype.value} differs from the graph's {port.dtype.value}")
    if lt.ndim != port.ndim or any(p not in (-1, d) for p, d in zip(port.shape, lt.shape)):
        raise ValueError(f"{where}: shape {lt.shape} is incompatible with the graph's {port.shape}")


class _PartitionRun:
    """What a compiled partition and a dynamic partition's replay share: the kernel's run for arrays keyed by
    port id, and the per-call checks of the outputs' memory.  Subclasses set partition and kernel."""

    @property
    def kernel_name(self) -> str:
        return self.kernel.name

    def execute_unchecked(self, inputs: dict, outputs: dict, replayed=None, shape_text: str | None = None) -> None:
        """execute without the per-call checks, for arrays keyed by port id that the caller already knows match the
        compiled shapes, strides and dtypes (the functional API's signature cache guarantees it); replayed: a
        length replay's plans for them, the call's shape_text for the verbose log."""
        if verbose.enabled():
            import time
            start = time.perf_counter()
            self._run(inputs, outputs, replayed)
            elapsed = (time.perf_counter() - start) * 1e3
            if shape_text is None:
                shape_text = getattr(self.kernel, "shape_text", f"ops={self.partition.get_ops()}")
            verbose.log("exec", f"partition={self.partition.id}", self.kernel.name, shape_text, f"{elapsed:.4f}ms")
        else:
            self._run(inputs, outputs, replayed)

    def _run(self, inputs: dict, outputs: dict, replayed) -> None:
        # only the fused kernels take a replay's plans
        if replayed is None:
            self.kernel.execute(inputs, outputs)
        else:
            self.kernel.execute(inputs, outputs, replayed)

    def _check_outputs(self, inputs: dict, outputs: dict, overlapping: frozenset) -> None:
        """Outputs must be writable, each element of an output one memory location (no stride 0 over a dim of
        two or more, no strides that fold two elements onto one: overlapping names the ports whose layout does),
        and no output may share memory with an input or another output: the kernels write them from many
        threads while they read the inputs."""
        where = f"partition {self.partition.id}: execute"
        for port_id, data in outputs.items():
            if not isinstance(data, np.ndarray):
                continue  # USM arrays: checked for shape and strides above; their memory is the queue's
            if not data.flags.writeable:
                raise ValueError(f"{where}: output port {port_id} is read-only; pass a writable array")
            if port_id in overlapping:
                raise ValueError(f"{where}: output port {port_id} has strides {data.strides} (bytes) for shape "
                                 f"{data.shape} that map several elements to one location; pass an array with "
                                 "an element of its own for each index")
        shared = _cpu.first_shared_memory(tuple(inputs.values()) + tuple(outputs.values()), len(inputs))
        if shared is not None:
            names = [f"input port {i}" for i in inputs] + [f"output port {i}" for i in outputs]
            raise ValueError(f"{where}: {names[shared[0]]} overlaps the memory of {names[shared[1]]}; outputs are "
                             "not computed in place")


class CompiledPartition(_PartitionRun):
    """A partition compiled for concrete shapes and layouts; execute runs it."""

    def __init__(self, partition: Partition, inputs: list[LogicalTensor], outputs: list[LogicalTensor], kernel):
        self.partition = partition
        self.inputs = inputs
        self.outputs = outputs
        self.kernel = kernel
        self._lts = {lt.id: lt for lt in inputs + outputs}
        self._dtypes = {lt.id: lt.dtype for lt in inputs + outputs}
        self._numpy_dtypes = {lt.id: numpy_dtype(lt.dtype) for lt in inputs + outputs}
        # byte strides each bound array must have (size-1 dims take any stride, marked None)
        self._byte_strides = {lt.id: _byte_strides(lt, self._numpy_dtypes[lt.id].itemsize)
                              for lt in inputs + outputs}
        self._overlapping = _overlapping_outputs(outputs)

    def with_layouts(self, kernel, shapes: dict, strides: dict, byte_strides: dict) -> CompiledPartition:
        """This compiled partition for other shapes and element strides of its ports (by id), run by this
        kernel (a length replay's).  byte_strides: those of the arrays the layouts were taken from, which the
        execute's fast check compares (any others fall back to the element-stride check)."""
        compiled = CompiledPartition.__new__(CompiledPartition)
        compiled.partition = self.partition
        compiled.kernel = kernel
        compiled.inputs = [lt.concrete(shapes[lt.id], strides[lt.id]) for lt in self.inputs]
        compiled.outputs = [lt.concrete(shapes[lt.id], strides[lt.id]) for lt in self.outputs]
        compiled._lts = {lt.id: lt for lt in compiled.inputs + compiled.outputs}
        compiled._dtypes = self._dtypes
        compiled._numpy_dtypes = self._numpy_dtypes
        compiled._byte_strides = byte_strides
        compiled._overlapping = _overlapping_outputs(compiled.outputs)
        return compiled

    def query_logical_tensor(self, tensor_id: int) -> LogicalTensor:
        """The concrete logical tensor (shape, strides) of an input or output port after compilation."""
        return _port(self._lts, tensor_id, self.partition.id)

    def execute(self, stream: Stream, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
        """Runs the compiled partition; tensors are matched to ports by id and must have the compiled shapes and
        strides."""
        if not isinstance(stream, Stream):
            raise TypeError(f"execute needs a Stream, got {type(stream).__name__}")
        bound_inputs = self._bind(inputs, self.inputs, "inputs")
        bound_outputs = self._bind(outputs, self.outputs, "outputs")
        self._check_outputs(bound_inputs, bound_outputs, self._overlapping)
        self.execute_unchecked(bound_inputs, bound_outputs)

    def bound_runner(self, fixed_inputs: dict):
        """The kernel's own call for repeated executions whose inputs in fixed_inputs (keyed by port id) never
        change, or None where the kernel has none (see FusedSdpaForward.bound_runner for its arguments).  Like
        execute_unchecked, it trusts the caller for shapes, strides and dtypes, and it logs nothing."""
        bind = getattr(self.kernel, "bound_runner", None)
        return bind(fixed_inputs) if bind is not None else None

    def _bind(self, tensors: Sequence[Tensor], ports: list[LogicalTensor], what: str) -> dict[int, np.ndarray]:
        where = f"partition {self.partition.id}: execute"
        if len(tensors) != len(ports):
            raise ValueError(f"{where} got {len(tensors)} {what}, expected {len(ports)} (ids {[p.id for p in ports]})")
        by_id = {}
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"{where}: {what} must be Tensors, got {type(t).__name__}")
            by_id[t.id] = t
        arrays = {}
        for port in ports:
            tensor = by_id.get(port.id)
            if tensor is None:
                raise ValueError(f"{where}: no tensor given for {what[:-1]} port {port.id}")
            if tensor.logical_tensor.dtype != port.dtype:
                raise TypeError(f"{where}: {what[:-1]} port {port.id} was compiled for {port.dtype.value}, got a "
                                f"Tensor of {tensor.logical_tensor.dtype.value}")
            data = tensor.data
            if sycl_runtime.is_usm_array(data):
                _checked_usm_array(data, port, where)
            else:
                if data.dtype != self._numpy_dtypes[port.id]:
                    raise TypeError(f"{where}: {what[:-1]} port {port.id} was compiled for {port.dtype.value} "
                                    f"({self._numpy_dtypes[port.id]}), got data of {data.dtype}")
                if data.shape != port.shape or not _strides_match(data.strides, self._byte_strides[port.id]):
                    _checked_array(data, port, where)
            arrays[port.id] = data
        return arrays

class _ReplayedPartition(_PartitionRun):
    """A dynamic partition's compile for one class of lengths (the same unknown dims equal), run for every
    other call of the class at the call's own lengths and strides: the kernel's lowering replayed (LengthReplay,
    BackwardLengthReplay) with nothing kept per call.  The key of the class pins everything but the lengths,
    strides and dtypes, so run checks the dtypes, the outputs' memory and (through the replay) the folds."""

    def __init__(self, template: CompiledPartition, replay: LengthReplay | BackwardLengthReplay):
        self.partition = template.partition
        self.kernel = template.kernel
        self.template = template
        self.replay = replay
        self._dtypes = template._dtypes
        self._numpy_dtypes = template._numpy_dtypes

    def run(self, tensors: list, input_count: int, ids: tuple, arrays: list) -> bool:
        """Runs the call of these tensors (ids and arrays: theirs, in order); False where the lowering's folds
        do not hold for the arrays' strides: then nothing is run, and the caller compiles the layout.  A Tensor
        or data of another dtype than its port is refused as a compiled partition refuses it, by name."""
        bound_inputs, bound_outputs = self._bound(tensors[:input_count]), self._bound(tensors[input_count:])
        by_id = dict(zip(ids, arrays))
        if bound_inputs is None or bound_outputs is None:
            layouts = _layouts(tensors)
            shapes = {tensor_id: shape for tensor_id, shape, _ in layouts}
            strides = {tensor_id: stride for tensor_id, _, stride in layouts}
            full = self.template.with_layouts(self.kernel, shapes, strides, {t.id: t.data.strides for t in tensors})
            full._bind(tensors[:input_count], full.inputs, "inputs")  # raises, naming the Tensor of the wrong dtype
            full._bind(tensors[input_count:], full.outputs, "outputs")
            return False
        plans = self.replay.plans_for(by_id)
        if plans is None:
            return False
        overlapping = frozenset(port_id for port_id, data in bound_outputs.items() if _overlaps_itself(data))
        self._check_outputs(bound_inputs, bound_outputs, overlapping)
        shape_text = None
        if verbose.enabled():
            shape_text = self.replay.shape_text(by_id)
            verbose.log("compile", f"partition={self.partition.id}", self.kernel.name,
                        f"{self.replay.dispatch_text(plans)},plan=replayed", shape_text)
        self.execute_unchecked(bound_inputs, bound_outputs, plans, shape_text)
        return True

    def _bound(self, tensors: Sequence[Tensor]) -> dict | None:
        """The tensors' arrays by port id, or None where a Tensor or its data has another dtype than its port."""
        arrays = {}
        dtypes, numpy_dtypes = self._dtypes, self._numpy_dtypes
        for t in tensors:
            data = t.data
            if t.logical_tensor.dtype is not dtypes[t.id] or data.dtype != numpy_dtypes[t.id]:
                return None
            arrays[t.id] = data
        return arrays


_NO_REPLAY = object()  # the replay cache's entry for a class of lengths whose every call compiles
_OTHER_ARRAY = "element strides"  # marks a key entry of an array other than a NumPy ndarray


class DynamicCompiledPartition:
    """A partition compiled with unknown (-1) dims in its input logical tensors, as oneDNN Graph's dynamic
    shapes: execute takes tensors of any size in those dims (the other dims as compiled), in any layout;
    query_dynamic_outputs gives the outputs' shapes for given input shapes.

    The first call of a class of lengths (the same unknown dims equal to each other: _length_free_key) is
    compiled, and where the partition compiled at probe lengths lowers the same but for the lengths, the
    fused kernel's lowering is replayed for every later call of the class at its own lengths and strides (the
    forward's kernels.fused_sdpa.LengthReplay, the backward's BackwardLengthReplay): nothing is checked,
    lowered or kept per call, so a new length costs what a length seen before does.  Any other set of shapes
    and layouts (no replay, or strides that break a fold of the lowering) is compiled once, on its first
    execute, and kept in a SignatureCache."""

    def __init__(self, partition: Partition, inputs: dict, outputs: Sequence[LogicalTensor], engine: Engine):
        self.partition = partition
        self.inputs = [inputs[port.id] for port in partition.get_input_ports()]
        given = _by_id(outputs, f"partition {partition.id}: compile outputs")
        self.outputs = [given.pop(port.id, port) for port in partition.get_output_ports()]
        if given:
            raise ValueError(f"partition {partition.id}: compile got logical tensors {sorted(given)} that are not "
                             f"output ports (output ports are {[t.id for t in partition.get_output_ports()]})")
        for lt, port in zip(self.outputs, partition.get_output_ports()):
            _check_matches_port(lt, port, f"partition {partition.id}: tensor {port.id}")
        self._lts = {lt.id: lt for lt in self.inputs + self.outputs}
        self._engine = engine
        self._plans = SignatureCache()
        self._last: _PartitionRun | None = None
        # the unknown dims of each port (its rank, its axes), and the replays by length-free key
        self._unknown = {lt.id: (lt.ndim, tuple(axis for axis, d in enumerate(lt.shape) if d == UNKNOWN_DIM))
                         for lt in self.inputs + self.outputs}
        self._replays = SignatureCache()
        # signature_key's (rank, mask of unknown dims counted from the last) per port, and in the ports' order
        self._free_axes = {tensor_id: (rank, sum(1 << (rank - 1 - axis) for axis in axes))
                           for tensor_id, (rank, axes) in self._unknown.items()}
        self._port_ids = tuple(lt.id for lt in self.inputs + self.outputs)
        self._port_free_axes = tuple(x for tensor_id in self._port_ids for x in self._free_axes[tensor_id])

    @property
    def kernel_name(self) -> str:
        """The kernel of the last shapes executed ("dynamic" before the first execute)."""
        return self._last.kernel_name if self._last is not None else "dynamic"

    def query_logical_tensor(self, tensor_id: int) -> LogicalTensor:
        """The logical tensor of an input or output port as compiled, -1 dims included."""
        return _port(self._lts, tensor_id, self.partition.id)

    def query_dynamic_outputs(self, inputs: Sequence[LogicalTensor]) -> list[LogicalTensor]:
        """The output ports' logical tensors (dense) for inputs of these concrete shapes."""
        lts = self.partition._concrete_inputs(inputs)
        for lt in lts.values():
            self._check_compiled_dims(lt.id, lt.shape)
        shapes = self.partition._infer_shapes(lts)
        return [lt.with_shape(shapes[lt.id]) for lt in self.outputs]

    def execute(self, stream: Stream, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
        """Runs the partition on these tensors, compiled for their shapes and layouts on first sight."""
        if not isinstance(stream, Stream):
            raise TypeError(f"execute needs a Stream, got {type(stream).__name__}")
        for what, tensors, ports in (("inputs", inputs, self.inputs), ("outputs", outputs, self.outputs)):
            if len(tensors) != len(ports):
                raise ValueError(f"partition {self.partition.id}: execute got {len(tensors)} {what}, expected "
                                 f"{len(ports)} (ids {[p.id for p in ports]})")
            for t in tensors:
                if not isinstance(t, Tensor):
                    raise TypeError(f"partition {self.partition.id}: execute: {what} must be Tensors, got "
                                    f"{type(t).__name__}")
        tensors = list(inputs) + list(outputs)
        ids = tuple([t.id for t in tensors])
        arrays = [t.data for t in tensors]
        # First by the class of lengths: the compile of its first call runs every other (_ReplayedPartition).
        free = self._length_free_key(ids, arrays, tensors)
        replayed = self._replays.get(free)
        if isinstance(replayed, _ReplayedPartition) and replayed.run(tensors, len(inputs), ids, arrays):
            self._last = replayed
            return
        # Else by the layouts: the port ids and NumPy's own shapes and byte strides, which pin a layout as the
        # element strides do (a port's dtype is fixed, and execute checks each array's), packed as bytes
        # (_cpu.signature_key); where an array is not NumPy's, the tuple of layouts seen.
        key = _cpu.signature_key(arrays, (), ids)
        if key is None:
            key = self._seen(tensors)
        compiled = self._plans.get(key)
        if compiled is None:
            compiled = self._compiled_anew(key, free, replayed, tensors, len(inputs))
        self._last = compiled
        compiled.execute(stream, inputs, outputs)

    @staticmethod
    def _seen(tensors: list) -> tuple:
        """The layouts of a call's tensors: (tensor id, shape, byte strides) of a NumPy array, (tensor id,
        shape, element strides, _OTHER_ARRAY) of another."""
        return tuple((t.id, t.data.shape, t.data.strides) if type(t.data) is np.ndarray else
                     (t.id, tuple(t.data.shape), _data_strides(t.data), _OTHER_ARRAY) for t in tensors)

    def _length_free_key(self, ids: tuple, arrays: list, tensors: list):
        """The class of lengths of a call: its layouts with each unknown dim of size 2 or more named by the
        place of its size among those met (-2 - place), so that calls whose unknown dims are equal in the same
        places share it, and no strides; 0 and 1 stay (they change broadcasting).  Packed natively for NumPy
        arrays (no dtypes: the replay checks them), a tuple for others."""
        axes = self._port_free_axes if ids == self._port_ids else \
            tuple(x for tensor_id in ids for x in self._free_axes.get(tensor_id, (0, 0)))
        free = _cpu.signature_key(arrays, axes, ids, True, name_lengths=True, dtypes=False)
        return free if free is not None else self._length_free_layouts(self._seen(tensors))[0]

    def _compiled_anew(self, key, free, replayed, tensors: list, input_count: int) -> CompiledPartition:
        """The partition compiled for a new layout, kept under execute's key; the first of its class of lengths
        (free) also becomes the class's replay where its kernel has one."""
        seen = key if type(key) is tuple else self._seen(tensors)
        # element strides: an array other than NumPy's has them in its key entry already
        layouts = tuple(entry[:3] if len(entry) == 4 else (entry[0], entry[1], _data_strides(t.data))
                        for entry, t in zip(seen, tensors))
        compiled = self._compiled(layouts, tensors, input_count)
        if replayed is None:
            lengths = self._length_free_layouts(seen)[1]
            self._replays.put(free, self._length_replay(compiled, layouts, lengths) or _NO_REPLAY)
        self._plans.put(key, compiled)
        return compiled

    def _compiled(self, layouts: tuple, tensors: list, input_count: int) -> CompiledPartition:
        for tensor_id, shape, _ in layouts:
            if tensor_id in self._lts:  # a tensor of no port is named by the compiled partition's checks
                self._check_compiled_dims(tensor_id, shape)
        # dtypes as the tensors give them: compile checks them against the graph's
        concrete = [LogicalTensor(tensor_id, t.logical_tensor.dtype, shape, strides)
                    for (tensor_id, shape, strides), t in zip(layouts, tensors)]
        return self.partition.compile(concrete[:input_count], concrete[input_count:], self._engine)

    def _length_free_layouts(self, layouts: tuple) -> tuple[tuple, list]:
        """The shapes of layouts (entries (tensor id, shape, ...)) with each unknown dim of size 2 or more named
        by its length's place in the returned list of lengths (-2 - place), so that calls whose unknown dims
        are equal in the same places share the key; 0 and 1 stay (they change broadcasting)."""
        lengths: list = []
        key = []
        for tensor_id, shape, *_ in layouts:
            rank, axes = self._unknown.get(tensor_id, (None, ()))
            if axes and len(shape) == rank:
                named = list(shape)
                for axis in axes:
                    size = named[axis]
                    if size >= 2:
                        if size not in lengths:
                            lengths.append(size)
                        named[axis] = -2 - lengths.index(size)
                shape = tuple(named)
            key.append((tensor_id, shape))
        return tuple(key), lengths

    def _length_replay(self, compiled: CompiledPartition, layouts: tuple, lengths: list):
        """The compiled kernel's LengthReplay, or None where it has none: the partition is compiled again
        with each length replaced by a probe length that no dim has, on dense arrays, and the kernel compares
        the two lowerings."""
        make = getattr(compiled.kernel, "length_replay", None)
        if make is None or not lengths:
            return None
        taken = {d for _, shape, _ in layouts for d in shape}
        probes = {}
        candidate = 10007
        for length in lengths:
            while candidate in taken:
                candidate += 2
            probes[length] = candidate
            candidate += 2
        shapes = {}
        for tensor_id, shape, _ in layouts:
            rank, axes = self._unknown.get(tensor_id, (None, ()))
            shapes[tensor_id] = tuple(probes.get(d, d) if axis in axes else d for axis, d in enumerate(shape))
        probe = self.partition.probe_kernel([lt.with_shape(shapes[lt.id]) for lt in compiled.inputs],
                                            [lt.with_shape(shapes[lt.id]) for lt in compiled.outputs], self._engine)
        replay = make(probe) if probe is not None else None
        return _ReplayedPartition(compiled, replay) if replay is not None else None

    def _check_compiled_dims(self, tensor_id: int, shape: tuple) -> None:
        compiled = self._lts[tensor_id]
        if len(shape) != compiled.ndim or any(c not in (-1, d) for c, d in zip(compiled.shape, shape)):
            raise ValueError(f"partition {self.partition.id}: tensor {tensor_id} has shape {tuple(shape)}, compiled "
                             f"for {compiled.shape} (-1: any size)")


def _port(lts: dict, tensor_id: int, partition_id: int) -> LogicalTensor:
    """A compiled partition's logical tensor of this port id; a ValueError where it is no port."""
    try:
        return lts[tensor_id]
    except KeyError:
        raise ValueError(f"partition {partition_id}: tensor {tensor_id} is neither an input nor an output "
                         "port") from None


def _layouts(tensors: list) -> tuple:
    """(tensor id, shape, element strides) of each tensor's data."""
    return tuple((t.id, tuple(t.data.shape), _data_strides(t.data)) for t in tensors)


def _data_strides(data) -> tuple:
    """Element strides of a NumPy or USM array (dense ones for an empty array: any layout serves)."""
    if not data.size:
        return dense_strides(data.shape)
    return array_strides(data)


def _byte_strides(lt: LogicalTensor, itemsize: int) -> tuple:
    return tuple(None if d == 1 else s * itemsize for s, d in zip(lt.strides, lt.shape))


def _overlaps_itself(data) -> bool:
    """views.overlaps_itself of an array's layout: a C-contiguous NumPy array never does; NumPy's byte strides
    serve as they are (an overlap does not depend on the stride's unit)."""
    if type(data) is np.ndarray:
        return not data.flags.c_contiguous and overlaps_itself(data.shape, data.strides)
    return overlaps_itself(tuple(data.shape), _data_strides(data))


def _overlapping_outputs(outputs: list[LogicalTensor]) -> frozenset:
    """The output ports whose layout maps several elements to one location (views.overlaps_itself).  A bound
    array has its port's shape and, over every dim of two or more, its strides (_bind), so the port's layout
    decides it once."""
    return frozenset(lt.id for lt in outputs if overlaps_itself(lt.shape, lt.strides))


def _strides_match(actual: tuple, expected: tuple) -> bool:
    return actual == expected or all(e is None or a == e for a, e in zip(actual, expected))


def _checked_array(data: np.ndarray, lt: LogicalTensor, where: str) -> np.ndarray:
    if data.shape != lt.shape:
        raise ValueError(f"{where}: tensor {lt.id} has shape {data.shape}, compiled for {lt.shape}")
    if data.size:
        strides = element_strides(data, f"{where}: tensor {lt.id}")
        if any(a != b for a, b, d in zip(strides, lt.strides, lt.shape) if d != 1):
            raise ValueError(f"{where}: tensor {lt.id} has strides {strides}, compiled for {lt.strides}; "
                             "compile with LogicalTensor(..., strides=...) matching the array")
    return data


def _checked_usm_array(data, lt: LogicalTensor, where: str) -> None:
    if tuple(data.shape) != lt.shape:
        raise ValueError(f"{where}: tensor {lt.id} has shape {tuple(data.shape)}, compiled for {lt.shape}")
    strides = sycl_runtime.usm_element_strides(data)
    if data.size and any(a != b for a, b, d in zip(strides, lt.strides, lt.shape) if d != 1):
        raise ValueError(f"{where}: tensor {lt.id} has strides {strides}, compiled for {lt.strides}; "
                         "compile with LogicalTensor(..., strides=...) matching the array")


def build_partitions(graph, policy: str) -> list[Partition]:
    """Fused SDPA partitions first, then one partition per remaining op, in topological order."""
    order = graph.ops
    position = {op.id: i for i, op in enumerate(order)}
    claimed: set[int] = set()
    groups: list[tuple[list[Op], str, SdpaMatch | None, str]] = []
    anchors = {OpKind.SoftMax: ("sdpa_forward", match_sdpa), OpKind.SoftMaxBackward: ("sdpa_backward", match_sdpa_backward)}
    if policy == "fusion":
        for op in order:
            if op.kind not in anchors or op.id in claimed:
                continue
            kind, matcher = anchors[op.kind]
            try:
                match = matcher(graph, op)
            except NoMatch as why:
                verbose.log("pattern", f"{op.kind.value.lower()}={op.id}", "not fused", why)
                continue
            ops = sorted(match.all_ops(), key=lambda o: position[o.id])
            if any(o.id in claimed for o in ops):
                continue
            for note in getattr(match, "notes", ()):
                verbose.log("pattern", f"{op.kind.value.lower()}={op.id}", "left out", note)
            claimed.update(o.id for o in ops)
            groups.append((ops, kind, match, f"fused {kind.replace('_', ' ')}"))
    for op in order:
        if op.id not in claimed and op.kind != OpKind.End:
            reason = "debug policy" if policy == "debug" else "no fusion pattern covers this op"
            groups.append(([op], "op", None, reason))
    groups.sort(key=lambda g: position[g[0][-1].id])
    return [Partition(graph, i, ops, kind, match, reason) for i, (ops, kind, match, reason) in enumerate(groups)]
