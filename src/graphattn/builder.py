"""GraphBuilder: numbers tensors and ops as they are added, names roles, and makes the Graph.

Shared by the functional API and the test graph builders so that neither
hand-numbers ids.
"""
from __future__ import annotations

import itertools

from .graph import Graph
from .logical_tensor import LogicalTensor
from .ops import Op


class GraphBuilder:
    def __init__(self):
        self.ops: list[Op] = []
        self.roles: dict[str, int] = {}
        self.by_role: dict[str, LogicalTensor] = {}
        self._ids = itertools.count()

    def tensor(self, role: str | None, dtype, shape, strides=None) -> LogicalTensor:
        """A new logical tensor; `role` (if given) records its id under that name."""
        lt = LogicalTensor(next(self._ids), dtype, shape, strides)
        if role:
            self.roles[role] = lt.id
            self.by_role[role] = lt
        return lt

    def op(self, kind, inputs, outputs, **attrs) -> LogicalTensor | None:
        """Adds an op and returns its first output (None for End, which has none)."""
        self.ops.append(Op(len(self.ops), kind, inputs, outputs, attrs))
        return outputs[0] if outputs else None

    def reshape(self, x: LogicalTensor, shape) -> LogicalTensor:
        return self.op("StaticReshape", [x], [self.tensor(None, x.dtype, shape)], shape=list(shape),
                       special_zero=False)

    def graph(self, engine_kind: str = "cpu") -> Graph:
        graph = Graph(engine_kind)
        for op in self.ops:
            graph.add_op(op)
        graph.finalize()
        return graph
