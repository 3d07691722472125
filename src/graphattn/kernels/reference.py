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


class SyclHostFallback:
    """A partition no SYCL kernel takes, on a SYCL engine: inputs are copied to the host, the reference runs
    there and the results are copied back (synchronous; the verbose log names the reason)."""

    name = "reference_on_host"

    def __init__(self, reference: ReferenceKernel, ops: list[Op]):
        self.reference = reference
        self.reason = reference.reason
        self._bf16 = {lt.id for op in ops for lt in op.inputs + op.outputs if lt.dtype.value == "bf16"}

    def execute(self, inputs: dict, outputs: dict) -> None:
        from .. import sycl_runtime

        host_in = {i: a if isinstance(a, np.ndarray) else sycl_runtime.to_host(a, bf16=i in self._bf16)
                   for i, a in inputs.items()}
        host_out = {}
        for i, a in outputs.items():
            dtype = np.dtype("float32") if i in self._bf16 else a.dtype  # written back as bf16 bits below
            host_out[i] = np.empty(tuple(a.shape), dtype)
        self.reference.execute(host_in, host_out)
        for i, a in outputs.items():
            value = host_out[i]
            if i in self._bf16:
                import ml_dtypes

                value = value.astype(ml_dtypes.bfloat16)
            sycl_runtime.copy_from_host(a, value)
