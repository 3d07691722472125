"""Quantized K/V cache formats: the stored bytes, their scales and zero points, and the rules that quantize
rows.  The kernels decode the same bytes by native/cpu/include/graphattn/kv_format.hpp.

Each (token, head) row of D values is cut into D / G groups of G adjacent values, G in {16, 32, 64, 128, D};
group g has a scale s_g and a zero point z_g (0 where none is stored); a stored q means (q - z_g) * s_g:

=============  ======================  ==========================  ================================
format         stored (dtype)          zero points                 quantize_kv's rule per group
=============  ======================  ==========================  ================================
``"u8"``       q in [0, 255] (uint8)   uint8, one per group        asymmetric
``"u4"``       q in [0, 15], two a     uint8, one (unpacked) byte  asymmetric
               byte (uint8, D / 2)     per group
``"s8"``       q in [-128, 127] (int8) int8 (optional)             symmetric, no zero point
``"s4"``       q in [-8, 7], two a     int8 (optional)             symmetric, no zero point
               byte (uint8, D / 2)
``"fp8_e4m3"`` float8_e4m3fn (or its   none; one f32 scale per     x / s rounded to the format
``"fp8_e5m2"`` bytes as uint8)         tensor or per (B, H_kv)
=============  ======================  ==========================  ================================

4-bit rows hold column c in byte c // 2, the even column in the low nibble (oneDNN's order).  Scales are f16
by default (bf16 and f32 accepted), shaped like the data with D replaced by D / G, so G is D divided by the
scales' last dim.

The rules (b the format's bits, qmax = 2^b - 1; every division by a scale uses the stored, rounded scale; round
half to even):

- asymmetric: s = (max - min) / qmax, z = clamp(round(-min / s), 0, qmax), q = clamp(round(x / s) + z, 0, qmax).
  A constant group (max == min) takes s = |min| / qmax instead, so it decodes to itself; an all-zero group
  stores s = 0, z = 0, q = 0.
- symmetric: s = max|x| / (2^(b-1) - 1), q = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1); s = 0 stores q = 0.
- fp8: q = float8(clamp(x / s, -fmax, fmax)) (fmax 448 for e4m3, 57344 for e5m2); s = 0 stores 0.  Without a
  given scale, s = max|x| / fmax over the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import _cpu

__all__ = ["FORMATS", "KvFormat", "dequantize_kv", "quantize_kv"]


@dataclass(frozen=True)
class KvFormat:
    """One cache format: its name, graphattn::KvFormat code and how its values are stored."""
    name: str
    code: int
    bits: int
    signed: bool
    fp8: np.dtype | None  # the ml_dtypes float8 dtype of an fp8 format
    storage: np.dtype  # the dtype quantize_kv returns
    zero_point_dtype: np.dtype | None  # None: fp8, which takes none

    @property
    def four_bit(self) -> bool:
        return self.bits == 4

    @property
    def symmetric(self) -> bool:
        return self.signed

    def stored_cols(self, head_dim: int) -> int:
        """The last dim of the stored array of rows of head_dim values."""
        return head_dim // 2 if self.four_bit else head_dim

    def head_dim(self, stored_cols: int) -> int:
        """The values of a row whose stored array's last dim is stored_cols."""
        return stored_cols * 2 if self.four_bit else stored_cols

    def accepts_storage(self, dtype: np.dtype) -> bool:
        """Whether a cache of this dtype holds this format's bytes (uint8 holds any format's)."""
        return np.dtype(dtype) in (np.dtype(np.uint8), self.storage)


_U8, _S8 = np.dtype(np.uint8), np.dtype(np.int8)
FORMATS: dict[str, KvFormat] = {
    "u8": KvFormat("u8", int(_cpu.KvFormat.u8), 8, False, None, _U8, _U8),
    "s8": KvFormat("s8", int(_cpu.KvFormat.s8), 8, True, None, _S8, _S8),
    "u4": KvFormat("u4", int(_cpu.KvFormat.u4), 4, False, None, _U8, _U8),
    "s4": KvFormat("s4", int(_cpu.KvFormat.s4), 4, True, None, _U8, _S8),
    "fp8_e4m3": KvFormat("fp8_e4m3", int(_cpu.KvFormat.fp8_e4m3), 8, True, np.dtype(ml_dtypes.float8_e4m3fn),
                         np.dtype(ml_dtypes.float8_e4m3fn), None),
    "fp8_e5m2": KvFormat("fp8_e5m2", int(_cpu.KvFormat.fp8_e5m2), 8, True, np.dtype(ml_dtypes.float8_e5m2),
                         np.dtype(ml_dtypes.float8_e5m2), None),
}

# The group sizes a per-group format takes besides D itself.
GROUP_SIZES = (16, 32, 64, 128)
# The dtypes of scales, by name; f16 is the default.
SCALE_DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}


def format_named(name, argument: str = "kv_format") -> KvFormat:
    """The format of this name (a KvFormat passes as it is)."""
    if isinstance(name, KvFormat):
        return name
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"{argument} must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]


def checked_group(head_dim: int, groups: int, argument: str, fmt: KvFormat) -> int:
    """G = head_dim / groups, refused where it does not divide D or is not a group size the formats take."""
    if fmt.four_bit and head_dim % 2:
        raise ValueError(f"{argument}: 4-bit rows need an even head size and group size, got D = {head_dim} (G = "
                         f"{head_dim // groups if groups >= 1 and head_dim % groups == 0 else 'none'})")
    if groups < 1 or head_dim % groups:
        raise ValueError(f"{argument}: {groups} groups a row do not divide the head size D = {head_dim} into a "
                         f"group size (D % G != 0)")
    group = head_dim // groups
    if group != head_dim and group not in GROUP_SIZES:
        raise ValueError(f"{argument}: the group size G = {group} (D = {head_dim} over {groups} groups) must be one "
                         f"of {GROUP_SIZES} or D")
    return group


def _scale_dtype(scale_dtype) -> np.dtype:
    if isinstance(scale_dtype, str) and scale_dtype in SCALE_DTYPES:
        return SCALE_DTYPES[scale_dtype]
    dtype = np.dtype(scale_dtype)
    if dtype not in SCALE_DTYPES.values():
        raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
    return dtype


def fp8_max(fmt: KvFormat) -> float:
    """The largest finite value of an fp8 format (448 for e4m3, 57344 for e5m2)."""
    return float(ml_dtypes.finfo(fmt.fp8).max)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values in [-8, 15] two a byte along the last dim: column c in byte c // 2, the even one low."""
    nibbles = (q.astype(np.int16) & 15).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(data: np.ndarray, signed: bool) -> np.ndarray:
    """pack_nibbles undone, as int16 values (sign-extended where signed)."""
    data = np.asarray(data).view(np.uint8)
    out = np.empty(data.shape[:-1] + (data.shape[-1] * 2,), np.int16)
    out[..., 0::2], out[..., 1::2] = data & 15, data >> 4
    return np.where(out >= 8, out - 16, out) if signed else out


def quantize_kv(x, kv_format, *, group_size: int | None = None, scale_dtype="f16", scale=None):
    """Rows x (..., D) quantized by the module's rules: (data, scales, zero_points).  data is x's shape (D / 2
    for 4 bits) in the format's storage dtype; scales (..., D / G) in scale_dtype (fp8: f32, the given `scale` or
    one for the whole tensor, broadcast against x's dims but the last as dequantize_kv's); zero_points
    (..., D / G) for u8 and u4, None for the others.  group_size G defaults to 32 where it divides D, else D."""
    fmt = format_named(kv_format)
    x = np.asarray(x).astype(np.float32)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have rows of D >= 1 values, got shape {x.shape}")
    if fmt.fp8 is not None:
        return _quantize_fp8(x, fmt, scale)
    if scale is not None:
        raise ValueError(f"scale is for the fp8 formats; {fmt.name} computes a scale per group")
    head_dim = x.shape[-1]
    if group_size is None:
        group_size = 32 if head_dim % 32 == 0 else head_dim
    if group_size < 1 or head_dim % group_size:
        raise ValueError(f"group_size {group_size} must divide the head size D = {head_dim} (D % G != 0)")
    checked_group(head_dim, head_dim // group_size, "group_size", fmt)
    groups = x.reshape(x.shape[:-1] + (head_dim // group_size, group_size))
    dtype = _scale_dtype(scale_dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmt.symmetric:
            qmax = 2 ** (fmt.bits - 1) - 1
            s = (np.abs(groups).max(axis=-1) / qmax).astype(dtype)
            wide = s.astype(np.float32)[..., None]
            q = np.where(wide > 0, np.clip(np.rint(groups / wide), -qmax - 1, qmax), 0)
            zero_points = None
        else:
            qmax = 2 ** fmt.bits - 1
            lo, hi = groups.min(axis=-1), groups.max(axis=-1)
            s = np.where(hi > lo, (hi - lo) / qmax, np.abs(lo) / qmax).astype(dtype)
            wide = s.astype(np.float32)
            z = np.where(wide > 0, np.clip(np.rint(-lo / wide), 0, qmax), 0)
            q = np.where(wide[..., None] > 0, np.clip(np.rint(groups / wide[..., None]) + z[..., None], 0, qmax), 0)
            zero_points = z.astype(fmt.zero_point_dtype)
    q = q.reshape(x.shape)
    data = pack_nibbles(q) if fmt.four_bit else q.astype(fmt.storage)
    return data, s, zero_points


def _quantize_fp8(x: np.ndarray, fmt: KvFormat, scale):
    fmax = fp8_max(fmt)
    if scale is None:
        s = np.asarray(np.abs(x).max(initial=0.0) / fmax, np.float32)
    else:
        s = np.asarray(scale, np.float32)
    wide = s[..., None] if s.size > 1 else s.reshape(())  # broadcast against x's dims but the last
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.where(wide > 0, np.clip(x / wide, -fmax, fmax), 0.0)
    return values.astype(fmt.fp8), s, None


def dequantize_kv(data, kv_format, scales, zero_points=None) -> np.ndarray:
    """The f32 values of stored rows (the module's table): data (..., D) (D / 2 for 4 bits), scales (..., D / G)
    (fp8: a scale broadcast against data's dims but the last, e.g. 0-d for one), zero_points like scales or
    None (0)."""
    fmt = format_named(kv_format)
    data = np.asarray(data)
    if fmt.fp8 is not None:
        values = data.view(np.uint8).view(fmt.fp8).astype(np.float32)
        return values * np.asarray(scales, np.float32)[..., None]
    q = unpack_nibbles(data, fmt.signed) if fmt.four_bit else data.view(fmt.storage).astype(np.int16)
    s = np.asarray(scales).astype(np.float32)
    group = checked_group(q.shape[-1], s.shape[-1], "scales", fmt)
    z = np.zeros_like(s) if zero_points is None else \
        np.asarray(zero_points).view(fmt.zero_point_dtype).astype(np.float32)
    groups = q.reshape(q.shape[:-1] + (s.shape[-1], group)).astype(np.float32)
    return ((groups - z[..., None]) * s[..., None]).reshape(q.shape)


# llama.cpp's q8_0 and q4_0 blocks (the gguf package's layout): 32 values a block, an f16 scale d first, then
# q8_0's 32 int8 values (value = d * q) or q4_0's 16 bytes, value i in byte i % 16's low nibble for i < 16 and
# its high nibble after (value = d * (q - 8)).
GGUF_BLOCK = 32


def _gguf_blocks(raw, block_bytes: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % block_bytes:
        raise ValueError(f"{name} blocks must be uint8 rows of whole {block_bytes}-byte blocks, got "
                         f"{raw.dtype} {raw.shape}")
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[:-1] + (raw.shape[-1] // block_bytes, block_bytes))
    return blocks[..., :2].copy().view(np.float16)[..., 0], blocks[..., 2:]


def from_gguf_q8_0(raw):
    """Rows of q8_0 blocks (..., n * 34 bytes) as this module's "s8" with G = 32: (data, scales, None), the
    same values exactly."""
    d, qs = _gguf_blocks(raw, 2 + GGUF_BLOCK, "q8_0")
    return qs.view(np.int8).reshape(qs.shape[:-2] + (-1,)), d, None


def from_gguf_q4_0(raw):
    """Rows of q4_0 blocks (..., n * 18 bytes) as this module's "u4" with G = 32 and zero point 8: (data,
    scales, zero_points), the same values exactly."""
    d, qs = _gguf_blocks(raw, 2 + GGUF_BLOCK // 2, "q4_0")
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # a block's 32 values in order
    data = pack_nibbles(q.reshape(q.shape[:-2] + (-1,)))
    return data, d, np.full(d.shape, 8, np.uint8)
