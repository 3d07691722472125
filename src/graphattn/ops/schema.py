"""OpSchema: what an op kind accepts (arity, attributes) and how it computes.

Each op module registers one schema per kind in SCHEMAS.  Shape inference
works on concrete shapes; the reference implementation computes in float64
(int64 for integers) and rounds to each output's declared dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..dtypes import DataType, numpy_dtype
from .kinds import OpKind

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Attr:
    kind: type  # bool, int, float, str or list (of ints)
    required: bool = False
    default: Any = None
    choices: tuple = ()


@dataclass(frozen=True)
class OpSchema:
    kind: OpKind
    inputs: tuple[int, int]    # (min, max) count
    outputs: tuple[int, int]
    attrs: dict[str, Attr] = field(default_factory=dict)
    # infer(attrs, input_shapes, where) -> output shapes (one per possible output)
    infer: Callable[[dict, Sequence[Shape], str], list[Shape]] | None = None
    # check_dtypes(attrs, input_dtypes, output_dtypes, where); raises TypeError
    check_dtypes: Callable[[dict, Sequence[DataType], Sequence[DataType], str], None] | None = None
    # reference(attrs, inputs, output_dtypes) -> outputs
    reference: Callable[[dict, Sequence[np.ndarray], Sequence[DataType]], list[np.ndarray]] | None = None


SCHEMAS: dict[OpKind, OpSchema] = {}


def register(schema: OpSchema) -> OpSchema:
    SCHEMAS[schema.kind] = schema
    return schema


def to_compute(array: np.ndarray) -> np.ndarray:
    """Upcast to the reference's compute type: float64 for floats, int64 for integers."""
    if array.dtype == np.bool_:
        return array
    if np.issubdtype(array.dtype, np.integer):
        return array.astype(np.int64)
    return array.astype(np.float64)


def cast_output(value: np.ndarray, dtype: DataType) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.asarray(value).astype(numpy_dtype(dtype))


def normalize_axis(axis: int, rank: int, where: str, name: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise ValueError(f"{where}: {name} {axis} is out of range for rank {rank}")
    return axis % rank
