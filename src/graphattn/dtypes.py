"""The data type table: every fact about a dtype lives here and nowhere else."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class DataType(enum.Enum):
    """oneDNN Graph data types; ``str(DataType.f32)`` ends with ``f32``."""

    f32 = "f32"
    bf16 = "bf16"
    f16 = "f16"
    boolean = "boolean"
    s32 = "s32"
    s64 = "s64"
    u8 = "u8"
    s8 = "s8"
    u4 = "u4"
    s4 = "s4"

    def __str__(self) -> str:
        return f"DataType.{self.value}"


@dataclass(frozen=True)
class DTypeInfo:
    numpy: np.dtype
    is_float: bool
    is_integer: bool
    kernel_code: int | None  # code of the native kernels' DType enum, None if they do not take it


# kernel codes mirror graphattn::DType in native/cpu/include/graphattn/sdpa.hpp
DTYPES: dict[DataType, DTypeInfo] = {
    DataType.f32: DTypeInfo(np.dtype(np.float32), True, False, 0),
    DataType.bf16: DTypeInfo(np.dtype(ml_dtypes.bfloat16), True, False, 1),
    DataType.f16: DTypeInfo(np.dtype(np.float16), True, False, 2),
    DataType.boolean: DTypeInfo(np.dtype(np.bool_), False, False, 3),
    DataType.s32: DTypeInfo(np.dtype(np.int32), False, True, None),
    DataType.s64: DTypeInfo(np.dtype(np.int64), False, True, None),
    # Quantized values (DynamicDequantize's inputs); 4-bit ones as ml_dtypes' int4/uint4, a byte each.
    DataType.u8: DTypeInfo(np.dtype(np.uint8), False, True, None),
    DataType.s8: DTypeInfo(np.dtype(np.int8), False, True, None),
    DataType.u4: DTypeInfo(np.dtype(ml_dtypes.uint4), False, True, None),
    DataType.s4: DTypeInfo(np.dtype(ml_dtypes.int4), False, True, None),
}
# The dtypes DynamicDequantize takes as quantized values.
QUANTIZED_TYPES = frozenset((DataType.u8, DataType.s8, DataType.u4, DataType.s4))

# graphattn::DType::u8: the bytes of a quantized K/V cache (graphattn.kv_quant's formats), any 1-byte dtype.
KERNEL_BYTES = 4

FLOAT_TYPES = frozenset(dt for dt, info in DTYPES.items() if info.is_float)
INTEGER_TYPES = frozenset(dt for dt, info in DTYPES.items() if info.is_integer and dt not in QUANTIZED_TYPES)

_BY_NUMPY = {info.numpy: dt for dt, info in DTYPES.items()}


def as_data_type(value: object) -> DataType:
    """Accepts a DataType, its name ("f32"), or any enum member whose str() ends with the name."""
    if isinstance(value, DataType):
        return value
    if isinstance(value, str):
        name = value
    elif isinstance(value, enum.Enum):
        name = str(value).rsplit(".", 1)[-1]
    else:
        raise TypeError(f"dtype must be one of {[d.value for d in DataType]} or a DataType, got {value!r}")
    try:
        return DataType(name)
    except ValueError:
        raise ValueError(f"unknown dtype {value!r}; expected one of {[d.value for d in DataType]}") from None


def numpy_dtype(dt: DataType) -> np.dtype:
    return DTYPES[dt].numpy


def from_numpy(dtype: np.dtype) -> DataType:
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"NumPy dtype {np.dtype(dtype)} has no graphattn equivalent; "
                        f"supported: {[str(i.numpy) for i in DTYPES.values()]}") from None


def kernel_code(dtype: np.dtype) -> int:
    """The native kernels' DType code of a NumPy dtype they take (f32, bf16, f16, bool)."""
    code = DTYPES[from_numpy(dtype)].kernel_code
    if code is None:
        raise TypeError(f"NumPy dtype {np.dtype(dtype)} is not one the kernels take")
    return code


def is_float(dt: DataType) -> bool:
    return DTYPES[dt].is_float
