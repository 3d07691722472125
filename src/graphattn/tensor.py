"""Tensor: a logical tensor bound to data on an engine."""
from __future__ import annotations

import numpy as np

from . import sycl_runtime
from .dtypes import numpy_dtype
from .engine import Engine
from .logical_tensor import LogicalTensor


def element_strides(array: np.ndarray, name: str = "array") -> tuple[int, ...]:
    """NumPy byte strides converted to element strides; a ValueError naming the array (`name`) if they are not
    whole elements."""
    itemsize = array.itemsize
    if array.flags.aligned:  # every stride is then a multiple of the alignment, which is the itemsize here
        return tuple([s // itemsize for s in array.strides])
    if any(s % itemsize for s in array.strides):
        raise ValueError(f"{name} has byte strides {array.strides} that are not multiples of its element size "
                         f"{itemsize}; pass a copy (np.ascontiguousarray)")
    return tuple(s // itemsize for s in array.strides)


def array_strides(array) -> tuple[int, ...]:
    """Element strides of a NumPy array or of a USM array (dpnp, usm_ndarray)."""
    return sycl_runtime.usm_element_strides(array) if sycl_runtime.is_usm_array(array) else element_strides(array)


class Tensor:
    """Binds a LogicalTensor to its data, never copied: a NumPy array on the CPU engine; on a SYCL engine a
    dpnp array or usm_ndarray on the engine's queue (strided views and offsets honoured), or a NumPy array for
    host scalars (scale, fill values, seeds)."""

    __slots__ = ("logical_tensor", "engine", "data")

    def __init__(self, logical_tensor: LogicalTensor, engine: Engine, data):
        if not isinstance(logical_tensor, LogicalTensor):
            raise TypeError(f"Tensor needs a LogicalTensor, got {type(logical_tensor).__name__}")
        if not isinstance(engine, Engine):
            raise TypeError(f"Tensor needs an Engine, got {type(engine).__name__}")
        on_device = engine.is_sycl and sycl_runtime.is_usm_array(data)
        if not on_device and not isinstance(data, np.ndarray):
            want = "a dpnp array or usm_ndarray" if engine.is_sycl else "a NumPy array"
            raise TypeError(f"tensor {logical_tensor.id}: data must be {want}, got {type(data).__name__}")
        if on_device and sycl_runtime.array_queue(data).sycl_context != engine.queue.sycl_context:
            raise ValueError(f"tensor {logical_tensor.id}: data lives on another SYCL context than the engine's queue")
        lt = logical_tensor
        expected = numpy_dtype(lt.dtype)
        # USM arrays have no bfloat16 dtype: bf16 data comes as its 16-bit patterns.
        bf16_bits = on_device and lt.dtype.value == "bf16" and data.dtype in (np.uint16, np.int16)
        if data.dtype != expected and not bf16_bits:
            raise TypeError(f"tensor {lt.id}: data dtype {data.dtype} does not match the logical tensor's "
                            f"{lt.dtype.value} ({expected})")
        if data.shape != lt.shape and (data.ndim != lt.ndim or any(d not in (-1, s) for d, s in zip(lt.shape, data.shape))):
            raise ValueError(f"tensor {lt.id}: data shape {data.shape} does not match the logical tensor's {lt.shape}")
        self.logical_tensor = lt
        self.engine = engine
        self.data = data

    @property
    def id(self) -> int:
        return self.logical_tensor.id

    def get_data_handle(self) -> np.ndarray:
        """The NumPy array (a view, never a copy) this tensor wraps."""
        return self.data

    def __repr__(self) -> str:
        return f"Tensor(id={self.id}, shape={self.data.shape}, dtype={self.logical_tensor.dtype.value})"
