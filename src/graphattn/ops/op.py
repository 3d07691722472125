"""Op: one node of a graph, with its logical tensors and attributes."""
from __future__ import annotations

from typing import Any, Iterable

from ..logical_tensor import LogicalTensor
from .kinds import OpKind, as_op_kind
from .schema import SCHEMAS, Attr


def _coerce_attr(where: str, name: str, spec: Attr, value: Any):
    if spec.kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{where}: attribute {name} must be a bool, got {value!r}")
    elif spec.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: attribute {name} must be an int, got {value!r}")
    elif spec.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where}: attribute {name} must be a float, got {value!r}")
        value = float(value)
    elif spec.kind is str:
        if not isinstance(value, str):
            raise TypeError(f"{where}: attribute {name} must be a string, got {value!r}")
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{where}: attribute {name} must be one of {list(spec.choices)}, got {value!r}")
    elif spec.kind is list:
        try:
            value = [int(v) for v in value]
        except (TypeError, ValueError):
            raise TypeError(f"{where}: attribute {name} must be a list of ints, got {value!r}") from None
    return value


class Op:
    """An operation: ``Op(id, kind, inputs, outputs, attrs, name)`` as in oneDNN Graph."""

    def __init__(self, id: int, kind, inputs: Iterable[LogicalTensor] = (), outputs: Iterable[LogicalTensor] = (),
                 attrs: dict | None = None, name: str | None = None):
        if not isinstance(id, int) or isinstance(id, bool) or id < 0:
            raise TypeError(f"op id must be a non-negative int, got {id!r}")
        self.id = id
        self.kind: OpKind = as_op_kind(kind)
        self.name = name if name is not None else f"{self.kind.value}_{id}"
        self.inputs: list[LogicalTensor] = []
        self.outputs: list[LogicalTensor] = []
        self._attrs: dict[str, Any] = {}
        for lt in inputs:
            self.add_input(lt)
        for lt in outputs:
            self.add_output(lt)
        for key, value in (attrs or {}).items():
            self.set_attr(key, value)

    @property
    def where(self) -> str:
        """How error messages name this op."""
        return f"{self.kind.value} op {self.id} ({self.name!r})"

    @property
    def schema(self):
        return SCHEMAS[self.kind]

    def add_input(self, lt: LogicalTensor) -> "Op":
        """Appends an input logical tensor; returns the op, for chaining."""
        if not isinstance(lt, LogicalTensor):
            raise TypeError(f"{self.where}: inputs must be LogicalTensors, got {type(lt).__name__}")
        self.inputs.append(lt)
        return self

    def add_output(self, lt: LogicalTensor) -> "Op":
        """Appends an output logical tensor; returns the op, for chaining."""
        if not isinstance(lt, LogicalTensor):
            raise TypeError(f"{self.where}: outputs must be LogicalTensors, got {type(lt).__name__}")
        self.outputs.append(lt)
        return self

    def set_attr(self, name, value) -> "Op":
        """Sets an attribute (checked against the op's schema when added to a graph); returns the op."""
        name = str(name).rsplit(".", 1)[-1]
        spec = self.schema.attrs.get(name)
        if spec is None:
            raise ValueError(f"{self.where}: unknown attribute {name!r}; {self.kind.value} takes "
                             f"{sorted(self.schema.attrs) or 'no attributes'}")
        self._attrs[name] = _coerce_attr(self.where, name, spec, value)
        return self

    @property
    def attrs(self) -> dict[str, Any]:
        """Attributes with defaults filled in."""
        full = {name: spec.default for name, spec in self.schema.attrs.items() if not spec.required}
        full.update(self._attrs)
        return full

    def validate(self) -> None:
        """Checks arity, required attributes and dtypes; raises ValueError or TypeError naming this op."""
        schema = self.schema
        for what, tensors, (lo, hi) in (("inputs", self.inputs, schema.inputs), ("outputs", self.outputs, schema.outputs)):
            if not lo <= len(tensors) <= hi:
                expected = str(lo) if lo == hi else f"{lo} to {hi}"
                raise ValueError(f"{self.where}: takes {expected} {what}, got {len(tensors)}")
        missing = [n for n, spec in schema.attrs.items() if spec.required and n not in self._attrs]
        if missing:
            raise ValueError(f"{self.where}: missing required attribute(s) {missing}")
        schema.check_dtypes(self.attrs, [t.dtype for t in self.inputs], [t.dtype for t in self.outputs], self.where)

    def __repr__(self) -> str:
        return (f"Op({self.id}, {self.kind.value}, inputs={[t.id for t in self.inputs]}, "
                f"outputs={[t.id for t in self.outputs]}, attrs={self._attrs})")
