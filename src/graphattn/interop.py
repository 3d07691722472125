"""Array interchange: NumPy in, NumPy out; torch (CPU) in, torch out; other DLPack producers via NumPy.

Inputs are wrapped without copies.  torch bfloat16 and float8 have no NumPy
dtype, so they are reinterpreted as ml_dtypes' through an integer view.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np


_torch = None  # the torch module, once a torch tensor has been seen (this module never imports it first)


def is_torch_tensor(x) -> bool:
    """Whether x is a torch tensor: none can exist before torch is imported, and this never imports it.  It
    reads no state of its own before writing it: torch.compile guards on module state a call reads, and state
    filled while it traces would fail its guard on the next call, which would then compile again."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    global _torch
    _torch = torch
    return True


def torch_compiling() -> bool:
    """Whether torch.compile is tracing this call (False before any torch tensor was seen)."""
    return _torch is not None and _torch.compiler.is_dynamo_compiling()


def to_numpy(x, name: str) -> tuple[np.ndarray, str]:
    """(array sharing x's memory, kind of x) where kind is 'numpy' or 'torch'.  A torch tensor with the negative
    bit (torch._neg_view) is resolved into a copy: its memory holds the negated values."""
    if isinstance(x, np.ndarray):
        return x, "numpy"
    if is_torch_tensor(x):
        if not x.is_cpu:
            raise TypeError(f"{name} is a torch tensor on {x.device}; the CPU engine needs CPU tensors")
        if x.layout is not _torch.strided:
            raise TypeError(f"{name} is a torch tensor of layout {x.layout}; pass a dense tensor ({name}.to_dense())")
        t = x.detach() if x.requires_grad else x
        if t.is_neg() or t.is_conj():
            t = t.resolve_neg().resolve_conj()
        if t.dtype is _torch.bfloat16:
            return t.view(_torch.int16).numpy().view(ml_dtypes.bfloat16), "torch"
        if t.dtype in _torch_float8():
            return t.view(_torch.uint8).numpy().view(_torch_float8()[t.dtype]), "torch"
        return t.numpy(), "torch"
    if hasattr(x, "__dlpack__"):
        return np.from_dlpack(x), "numpy"
    if np.isscalar(x) or isinstance(x, (list, tuple)):
        return np.asarray(x), "numpy"
    raise TypeError(f"{name} must be a NumPy array, a torch CPU tensor or a DLPack producer, got {type(x).__name__}")


def _torch_float8() -> dict:
    """torch's float8 dtypes and their ml_dtypes equivalents (no NumPy dtype of torch's own)."""
    return {_torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn), _torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2)}


def plain_torch_tensors(*xs) -> bool:
    """Whether every x is a torch tensor whose memory holds its values as they are (no negative bit, which
    torch._neg_view sets): such tensors may go to a kernel without a NumPy view.  torch is looked up once: a
    decode-sized call feels the loop."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = torch.Tensor
    for x in xs:
        if not isinstance(x, tensor) or x.is_neg():
            return False
    global _torch
    _torch = torch
    return True


def torch_layout(*tensors) -> tuple | None:
    """What pins the memory layout of torch tensors for a compiled call or a plan: the shape, element strides,
    dtype and whether on the CPU of each, in one tuple; None where one has no strides (a sparse tensor, which
    the checks of a new signature then refuse by name)."""
    try:
        if len(tensors) == 3:  # the forward's Q, K, V spelled out: cheaper than the loop below on tiny calls
            q, k, v = tensors
            return ((q.shape, q.stride(), q.dtype, q.is_cpu), (k.shape, k.stride(), k.dtype, k.is_cpu),
                    (v.shape, v.stride(), v.dtype, v.is_cpu))
        return tuple([(t.shape, t.stride(), t.dtype, t.is_cpu) for t in tensors])  # a list: faster than a generator
    except RuntimeError:
        return None


def torch_random_seed() -> int:
    """A 62-bit dropout seed from torch's default generator, so that torch.manual_seed repeats the mask."""
    return int(_torch.randint(0, 1 << 62, (), dtype=_torch.int64))


def torch_dtype_name(dtype) -> str:
    """A NumPy dtype as torch names it (torch.float64), for messages to torch callers."""
    if _torch is None:
        return str(np.dtype(dtype))
    if dtype == ml_dtypes.bfloat16:
        return str(_torch.bfloat16)
    try:
        return str(_torch.from_numpy(np.empty(0, dtype)).dtype)
    except TypeError:
        return str(np.dtype(dtype))


def torch_empty(shape: tuple, dtype: np.dtype):
    """An uninitialised contiguous torch CPU tensor of a NumPy dtype (ml_dtypes.bfloat16 for bf16)."""
    if dtype == ml_dtypes.bfloat16:
        return _torch.empty(shape, dtype=_torch.bfloat16)
    return _torch.from_numpy(np.empty(shape, dtype))


def torch_empty_like(t):
    """An uninitialised torch tensor of t's shape, dtype and (for a contiguous t) layout."""
    return _torch.empty_like(t)


def from_numpy(array: np.ndarray, kind: str):
    """Wraps a result as the caller's array kind, without a copy."""
    if kind != "torch":
        return array
    if array.dtype == ml_dtypes.bfloat16:
        return _torch.from_numpy(array.view(np.int16)).view(_torch.bfloat16)
    return _torch.from_numpy(array)
