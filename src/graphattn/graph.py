"""Graph: ops connected by logical tensor ids, validated, ordered and partitioned."""
from __future__ import annotations

from .logical_tensor import LogicalTensor
from .ops import Op, OpKind
from . import verbose


class Graph:
    """A DAG of ops.  ``add_op`` validates each op; ``finalize`` checks the whole graph."""

    def __init__(self, engine_kind: str = "cpu", fpmath_mode: str = "strict"):
        kind = str(engine_kind).rsplit(".", 1)[-1]
        if kind != "cpu":
            raise ValueError(f"graph engine kind {engine_kind!r} is not available; use 'cpu'")
        fpmath = str(fpmath_mode).rsplit(".", 1)[-1]
        if fpmath not in ("strict", "bf16", "f16", "tf32", "any"):
            raise ValueError(f"fpmath_mode must be strict, bf16, f16, tf32 or any, got {fpmath_mode!r}")
        self.engine_kind = kind
        self.fpmath_mode = fpmath
        self._ops: dict[int, Op] = {}
        self._tensors: dict[int, LogicalTensor] = {}
        self._producer: dict[int, Op] = {}
        self._consumers: dict[int, list[Op]] = {}
        self._finalized = False
        self._order: list[Op] = []

    # ---- construction -------------------------------------------------------
    def add_op(self, op: Op, allow_exists: bool = False) -> None:
        """Adds an op; its attributes and tensor counts are checked against the op's schema now."""
        if self._finalized:
            raise ValueError("graph is finalized: no more ops can be added")
        if not isinstance(op, Op):
            raise TypeError(f"add_op needs an Op, got {type(op).__name__}")
        if op.id in self._ops:
            if allow_exists and self._ops[op.id] is op:
                return
            raise ValueError(f"{op.where}: op id {op.id} is already used by {self._ops[op.id].where}")
        op.validate()
        for lt in list(op.inputs) + list(op.outputs):
            self._check_tensor_consistent(op, lt)
        for lt in op.outputs:
            if lt.id in self._producer:
                raise ValueError(f"{op.where}: output tensor {lt.id} is already produced by {self._producer[lt.id].where}")
        if len({lt.id for lt in op.outputs}) != len(op.outputs):
            raise ValueError(f"{op.where}: the same tensor id appears twice among its outputs")
        self._ops[op.id] = op
        for lt in list(op.inputs) + list(op.outputs):
            self._tensors.setdefault(lt.id, lt)
        for lt in op.outputs:
            self._producer[lt.id] = op
        for lt in op.inputs:
            self._consumers.setdefault(lt.id, []).append(op)

    def _check_tensor_consistent(self, op: Op, lt: LogicalTensor) -> None:
        known = self._tensors.get(lt.id)
        if known is None:
            return
        if known.dtype != lt.dtype or known.ndim != lt.ndim:
            raise ValueError(f"{op.where}: tensor {lt.id} is {lt.dtype.value} rank {lt.ndim} here but "
                             f"{known.dtype.value} rank {known.ndim} elsewhere in the graph")
        if any(a != b and -1 not in (a, b) for a, b in zip(known.shape, lt.shape)):
            raise ValueError(f"{op.where}: tensor {lt.id} has shape {lt.shape} here but {known.shape} elsewhere")

    def finalize(self) -> None:
        """Checks the graph (one producer per tensor, no cycles, shapes and dtypes agree) and freezes it."""
        if self._finalized:
            return
        if not self._ops:
            raise ValueError("graph has no ops")
        self._order = self._topological_order()
        self._check_known_shapes()
        self._finalized = True

    def _topological_order(self) -> list[Op]:
        pending = {op.id: sum(1 for lt in op.inputs if lt.id in self._producer) for op in self._ops.values()}
        ready = sorted(op_id for op_id, n in pending.items() if n == 0)
        order: list[Op] = []
        while ready:
            op = self._ops[ready.pop(0)]
            order.append(op)
            for lt in op.outputs:
                for consumer in self._consumers.get(lt.id, []):
                    pending[consumer.id] -= sum(1 for x in consumer.inputs if x.id == lt.id)
                    if pending[consumer.id] == 0:
                        ready.append(consumer.id)
            ready.sort()
        if len(order) != len(self._ops):
            stuck = sorted(op_id for op_id, n in pending.items() if n > 0)
            raise ValueError(f"graph has a cycle through ops {stuck}")
        return order

    def _check_known_shapes(self) -> None:
        """Runs shape inference where input shapes are known, so mismatches surface before compile."""
        shapes = {tid: lt.shape for tid, lt in self._tensors.items() if lt.is_shape_known()}
        for op in self._order:
            if op.kind == OpKind.End or not all(lt.id in shapes for lt in op.inputs):
                continue
            inferred = op.schema.infer(op.attrs, [shapes[lt.id] for lt in op.inputs], op.where)
            for lt, shape in zip(op.outputs, inferred):
                if any(d not in (-1, s) for d, s in zip(lt.shape, shape)) or lt.ndim != len(shape):
                    raise ValueError(f"{op.where}: output tensor {lt.id} is declared {lt.shape} "
                                     f"but the op produces {tuple(shape)}")
                shapes.setdefault(lt.id, tuple(shape))

    # ---- queries used by the pattern matcher and partitions ------------------
    @property
    def ops(self) -> list[Op]:
        """Ops in topological order (after finalize)."""
        self.finalize()
        return list(self._order)

    def op(self, op_id: int) -> Op:
        """The op with this id."""
        return self._ops[op_id]

    def tensor(self, tensor_id: int) -> LogicalTensor:
        """The logical tensor with this id, as the graph's ops declare it."""
        return self._tensors[tensor_id]

    def producer(self, tensor_id: int) -> Op | None:
        """The op that outputs this tensor, or None for a graph input."""
        return self._producer.get(tensor_id)

    def consumers(self, tensor_id: int) -> list[Op]:
        """Ops reading the tensor, End markers excluded."""
        return [op for op in self._consumers.get(tensor_id, []) if op.kind != OpKind.End]

    def is_marked_output(self, tensor_id: int) -> bool:
        """True if an End op marks the tensor as a graph output."""
        return any(op.kind == OpKind.End for op in self._consumers.get(tensor_id, []))

    # ---- partitioning -----------------------------------------------------------
    def get_partitions(self, policy: str = "fusion"):
        """Splits the finalized graph into partitions: fused SDPA forward/backward patterns (policy "fusion") and one
        reference partition per other op; "debug" fuses nothing."""
        from .partition import build_partitions

        policy_name = str(policy).rsplit(".", 1)[-1]
        if policy_name not in ("fusion", "debug"):
            raise ValueError(f"partition policy must be 'fusion' or 'debug', got {policy!r}")
        self.finalize()
        partitions = build_partitions(self, policy_name)
        for p in partitions:
            verbose.log("partition", f"id={p.id}", p.kind, f"ops={p.get_ops()}", p.reason)
        return partitions
