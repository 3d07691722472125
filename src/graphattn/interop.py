"""Array interchange: NumPy in, NumPy out; torch (CPU) in, torch out; other DLPack producers via NumPy.

Inputs are wrapped without copies.  torch bfloat16 has no NumPy dtype, so it
is reinterpreted as ml_dtypes.bfloat16 through an int16 view.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def to_numpy(x, name: str) -> tuple[np.ndarray, str]:
    """(array sharing x's memory, kind of x) where kind is 'numpy' or 'torch'."""
    if isinstance(x, np.ndarray):
        return x, "numpy"
    if _is_torch(x):
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on {t.device}; the CPU engine needs CPU tensors")
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16), "torch"
        return t.numpy(), "torch"
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x), "numpy"
    if np.isscalar(x) or isinstance(x, (list, tuple)):
        return np.asarray(x), "numpy"
    raise TypeError(f"{name} must be a NumPy array, a torch CPU tensor or a DLPack producer, got {type(x).__name__}")


def from_numpy(array: np.ndarray, kind: str):
    """Wraps a result as the caller's array kind, without a copy."""
    if kind != "torch":
        return array
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
