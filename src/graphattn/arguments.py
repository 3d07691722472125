"""The functional API's argument rules, in one place: what each argument may be, and the error that names it.

Every rule raises a TypeError (wrong kind of value) or a ValueError (right kind, wrong value) whose message
names the argument and says what would be accepted, in the caller's framework's terms (torch dtypes for torch
tensors, NumPy's for NumPy arrays).
"""
from __future__ import annotations

import math
import operator

import numpy as np

from . import _cpu
from .tensor import element_strides

_FINITE_SCALE_BOUND = _cpu.finite_scale_bound()

# The dtypes query, key and value may have, as each framework spells them.
_FLOAT_NAMES = {"numpy": "float32, ml_dtypes.bfloat16 or float16",
                "torch": "torch.float32, torch.bfloat16 or torch.float16"}


def real_number(value, name: str) -> float:
    """value as a float; a TypeError naming the argument for anything that is not a real number (strings
    included: '0.1' is not taken for 0.1)."""
    if isinstance(value, (str, bytes, bool, np.bool_)) or value is None or not hasattr(type(value), "__float__"):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as why:  # e.g. a torch tensor of several elements
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}: {why}") from None


def integer(value, name: str) -> int:
    """value as an int; a TypeError naming the argument for a float (1.7 is not truncated to 1), a string or a
    bool."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def dropout_probability(value) -> float:
    """dropout_p as a float in [0, 1)."""
    p = value if type(value) is float else real_number(value, "dropout_p")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return p


def scale_value(value) -> float | None:
    """scale as a float (None: 1 / sqrt(E)): a finite one within +-_cpu.finite_scale_bound() (the kernels hold it
    in float32 base-2 units, which must not overflow), an infinite one or NaN, as in PyTorch."""
    if value is None:
        return value
    scale = value if type(value) is float else real_number(value, "scale")
    if abs(scale) > _FINITE_SCALE_BOUND and scale not in (math.inf, -math.inf):
        raise ValueError(f"scale must be within +-{_FINITE_SCALE_BOUND:.9g} (the kernels hold it in float32 base-2 "
                         f"units), or infinite, got {value!r}")
    return scale


def dtype_text(dtype, kind: str) -> str:
    """A dtype as the caller's framework names it (torch.float64 for torch tensors)."""
    if kind == "torch":
        from .interop import torch_dtype_name

        return torch_dtype_name(dtype)
    return str(np.dtype(dtype))


def unsupported_float(name: str, dtype, kind: str) -> TypeError:
    """The error for a query, key or value of a dtype the kernels do not take."""
    accepted = _FLOAT_NAMES.get(kind, _FLOAT_NAMES["numpy"])
    return TypeError(f"{name} dtype {dtype_text(dtype, kind)} is not supported; use {accepted}")


def check_host_array(a: np.ndarray, name: str) -> None:
    """A host array the kernels can read in place: a plain ndarray (not a masked array, whose mask they would
    ignore) whose byte strides are whole elements."""
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name} is a NumPy masked array; its mask would be ignored: pass {name}.filled(value) or, "
                        "to mask attention, attn_mask")
    element_strides(a, name)  # raises, naming the array, where the byte strides are not whole elements


def check_head_sizes(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> None:
    """Head sizes (the last dims) of query, key and value: at least 1 each."""
    for name, shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        if shape[-1] < 1:
            raise ValueError(f"{name} must have a head size (last dim) of at least 1, got shape {tuple(shape)}")
