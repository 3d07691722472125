"""The reference executor: runs a partition op by op with each op's NumPy reference."""
from __future__ import annotations

import numpy as np

from ..ops import Op


class ReferenceKernel:
    """Correct for every op and shape; O(S^2) memory for attention, so slow and large."""

    name = "reference"

    def __init__(self, ops: list[Op], reason: str = ""):
        self.ops = ops
        self.reason = reason

    def execute(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> None:
        values = dict(inputs)
        for op in self.ops:
            produced = op.schema.reference(op.attrs, [values[lt.id] for lt in op.inputs],
                                           [lt.dtype for lt in op.outputs])
            for lt, value in zip(op.outputs, produced):
                values[lt.id] = value
        for tensor_id, out in outputs.items():
            out[...] = values[tensor_id]
