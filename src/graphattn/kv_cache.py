"""Attention over a KV cache that grows in place: dense or paged, appended before it attends (flash-attn's
``flash_attn_with_kvcache`` conventions, vLLM's ``slot_mapping``).

    out = attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table)

- q is (B, L, H_q, D), or packed (T_q, H_q, D) with ``cu_seqlens_q`` (B + 1 offsets), so one call mixes prefill
  chunks and decode steps of different sequences.
- A dense cache is (B_cache, S_cache, H_kv, D) (``cache_batch_idx`` (B,) picks sequence b's row, else row b);
  a paged cache is (num_blocks, block_size, H_kv, D) with ``block_table`` int32 (B, max_blocks): logical row r
  of sequence b lies in block ``block_table[b, r // block_size]`` at row ``r % block_size``.  Any strides: a
  head-major (num_blocks, H_kv, block_size, D) buffer passes as its permuted view.
- ``cache_seqlens`` (an int, or (B,) int32/int64) counts each sequence's rows already in the cache.  ``k``/``v``
  (B, L, H_kv, D), or packed as q, are written at rows [cache_seqlens, cache_seqlens + L) before the call
  attends; the call does not change ``cache_seqlens``.  Sequence b then attends to its first cache_seqlens[b]
  + L_b rows, causal bottom-right against them.  Rows past that and blocks it does not use are never read.
- Everything is checked before a byte is written: a used block_table entry outside [0, num_blocks) is an
  IndexError naming ``block_table``; rows beyond the capacity (max_blocks x block_size, or S_cache) a
  ValueError; a repeated ``cache_batch_idx`` with k given is refused.
- stats: (B, H_q, L), or (H_q, T_q) packed, f32 log-sum-exp.  No backward (as flash-attn's kvcache call).

The kernels read the cache's rows through its block table in place (native/cpu/include/graphattn/kv_rows.hpp);
nothing is gathered into a copy.
"""
from __future__ import annotations

import math

import numpy as np

from . import _cpu, arguments, key_window, kv_quant, score_mods
from .call_prep import KERNEL_FLOATS
from .dtypes import KERNEL_BYTES, kernel_code
from .interop import from_numpy, to_numpy
from .tensor import array_strides
from .varlen_call import (checked_cu_seqlens, host_operand, packed_per_head_view, packed_rows_view,
                          packed_stats_view, per_head_operand)

__all__ = ["attention_with_kv_cache", "kv_cache_append"]

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _host(x, name: str) -> tuple[np.ndarray, str]:
    array, kind = host_operand(x, name)
    if kind == "usm":
        raise NotImplementedError(f"{name}: KV caches on SYCL devices are not supported yet; pass host arrays")
    return array, kind


def index_operand(value, name: str, length: int | None) -> np.ndarray:
    """A 1-D int32/int64 operand as int64 (an int is broadcast to `length` entries where allowed)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if length is None:
            raise TypeError(f"{name} must be an array here")
        return np.full(length, int(value), np.int64)
    array, kind = to_numpy(value, name)
    if array.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {arguments.dtype_text(array.dtype, kind)}")
    if array.ndim != 1 or (length is not None and array.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ValueError(f"{name} must have shape {want}, one entry per sequence, got {tuple(array.shape)}")
    return array.astype(np.int64)


class _Rows:
    """One cache tensor, K or V: its array and, stored quantized (kv_quant), its format, group size, scales and
    zero points, checked.  head_dim counts values, not stored bytes."""

    def __init__(self, name: str, x, fmt: kv_quant.KvFormat | None, scales, zero_points, kind: str | None,
                 sequences: int):
        """kind: the array kind the other tensor of the pair has (None for the first)."""
        self.name = name
        self.array, self.kind = _host(x, f"{name}_cache")
        if kind is not None and self.kind != kind:
            raise TypeError("k_cache and v_cache must both be NumPy arrays or both torch tensors")
        kind = self.kind
        a = self.array
        if a.ndim != 4:
            raise ValueError(f"{name}_cache must be 4-D ((num_blocks, block_size, H_kv, D) paged, or (B_cache, "
                             f"S_cache, H_kv, D)), got shape {tuple(a.shape)}")
        self.fmt, self.group, self.scales, self.zero_points = fmt, 0, None, None
        if fmt is None:
            for extra in ("scales", "zero_points"):
                if (scales if extra == "scales" else zero_points) is not None:
                    raise ValueError(f"{name}_{extra} is for a quantized cache: pass kv_format too")
            if np.dtype(a.dtype) not in KERNEL_FLOATS:
                raise arguments.unsupported_float(f"{name}_cache", a.dtype, kind)
            self.head_dim = a.shape[3]
            return
        if not fmt.accepts_storage(a.dtype):
            raise TypeError(f"{name}_cache holds {fmt.name} values as {fmt.storage} (or uint8 bytes), got "
                            f"{arguments.dtype_text(a.dtype, kind)}")
        self.head_dim = fmt.head_dim(a.shape[3])
        if scales is None:
            raise ValueError(f"{name}_scales: a {fmt.name} cache needs its scales")
        self.scales, _ = _host(scales, f"{name}_scales")
        if fmt.fp8 is not None:
            if zero_points is not None:
                raise ValueError(f"{name}_zero_points: {fmt.name} caches take none")
            s = self.scales
            if s.dtype != np.float32 or not (s.size == 1 and s.ndim <= 1 or s.shape == (sequences, a.shape[2])):
                raise ValueError(f"{name}_scales of a {fmt.name} cache must be f32 of shape () or (1,) (one scale) "
                                 f"or ({sequences}, {a.shape[2]}) (one per sequence and K/V head), got "
                                 f"{arguments.dtype_text(s.dtype, kind)} {tuple(s.shape)}")
            return
        s = self.scales
        if s.ndim != 4 or s.shape[:3] != a.shape[:3]:
            raise ValueError(f"{name}_scales must have {name}_cache's blocks, rows and heads {tuple(a.shape[:3])} and "
                             f"D / G groups last, got shape {tuple(s.shape)}")
        if s.dtype not in kv_quant.SCALE_DTYPES.values():
            raise TypeError(f"{name}_scales must be f16, bf16 or f32, got {arguments.dtype_text(s.dtype, kind)}")
        self.group = kv_quant.checked_group(self.head_dim, s.shape[3], f"{name}_scales", fmt)
        if zero_points is not None:
            self.zero_points, _ = _host(zero_points, f"{name}_zero_points")
            z = self.zero_points
            if z.shape != s.shape or z.dtype != fmt.zero_point_dtype:
                raise ValueError(f"{name}_zero_points of a {fmt.name} cache must be {fmt.zero_point_dtype} shaped as "
                                 f"{name}_scales {tuple(s.shape)}, got {arguments.dtype_text(z.dtype, kind)} "
                                 f"{tuple(z.shape)}")

    def quant_spec(self, decoded: int) -> tuple | None:
        """The kernel's KvQuant of this tensor (_cpu.run_packed's kv_quant entry), None where plain."""
        if self.fmt is None:
            return None
        if self.fmt.fp8 is not None:
            s = self.scales
            strides = (0, 0, 0, 0, 0) if s.size == 1 else (*array_strides(s), 0, 0, 0)
            return self.fmt.code, 0, decoded, (kernel_code(s.dtype), strides, s), None
        params = [None if p is None else _group_view(p) for p in (self.scales, self.zero_points)]
        return self.fmt.code, self.group, decoded, params[0], params[1]

    def write(self, new: np.ndarray, blocks: np.ndarray, rows: np.ndarray, sequence: np.ndarray | None):
        """cache[blocks[t], rows[t]] = new[t] (T, H_kv, D), quantized on the way where the cache is (the scales
        and zero points of those rows with it; fp8's per-sequence scale picked by `sequence`), nothing else."""
        if self.fmt is None:
            self.array[blocks, rows] = new
            return
        if self.fmt.fp8 is not None:
            s = self.scales.reshape(()) if self.scales.size == 1 else self.scales[sequence]
            data, _, _ = kv_quant.quantize_kv(new, self.fmt, scale=s)
            self.array[blocks, rows] = data.view(self.array.dtype)
            return
        data, scales, zero_points = kv_quant.quantize_kv(new, self.fmt, group_size=self.group,
                                                         scale_dtype=self.scales.dtype)
        self.array[blocks, rows] = data.view(self.array.dtype)
        self.scales[blocks, rows] = scales
        if self.zero_points is not None:
            self.zero_points[blocks, rows] = 0 if zero_points is None else zero_points

    def check_writable(self, new: np.ndarray, dtype: np.dtype):
        """The checks of write(), before any tensor is written."""
        if self.fmt is None and new.dtype != self.array.dtype:
            raise TypeError(f"{self.name} must have the cache's dtype {self.array.dtype}, got {new.dtype}")
        if self.fmt is not None and np.dtype(new.dtype) not in KERNEL_FLOATS:
            raise arguments.unsupported_float(self.name, new.dtype, "numpy")
        if self.fmt is not None and new.dtype != dtype:
            raise TypeError(f"{self.name} must have q's dtype {dtype} (the cache quantizes it), got {new.dtype}")
        for what, a in (("cache", self.array), ("scales", None if self.fmt is None or self.fmt.fp8 is not None
                                                 else self.scales), ("zero_points", self.zero_points)):
            if a is not None and not a.flags.writeable:
                raise ValueError(f"{self.name}_{what} is read-only")
        if self.fmt is not None and not self.fmt.symmetric and self.zero_points is None:
            raise ValueError(f"{self.name}_zero_points: appending to an asymmetric {self.fmt.name} cache writes a "
                             "zero point per group: pass the cache's zero points")

    def kernel_view(self) -> tuple:
        """(code, strides, array): batch dims (block, K/V head, query head of its group), row, column."""
        a = self.array
        blocks, rows, heads, cols = array_strides(a)
        code = kernel_code(a.dtype) if self.fmt is None else KERNEL_BYTES
        return code, (blocks, heads, 0, rows, cols), a


def _group_view(p: np.ndarray) -> tuple:
    """Per-group scales or zero points (blocks, rows, heads, groups) as the kernel's KvQuantParams."""
    blocks, rows, heads, groups = array_strides(p)
    code = kernel_code(p.dtype) if p.dtype in kv_quant.SCALE_DTYPES.values() else KERNEL_BYTES
    return code, (blocks, heads, 0, rows, groups), p


def _formats(kv_format) -> tuple:
    """(K's, V's) KvFormat or None (plain) of a kv_format argument: None, a name, or a pair of them."""
    if kv_format is None:
        return None, None
    pair = tuple(kv_format) if isinstance(kv_format, (tuple, list)) else (kv_format, kv_format)
    if len(pair) != 2:
        raise ValueError(f"kv_format must be a format name or a pair (K's, V's), got {kv_format!r}")
    return tuple(None if f is None else kv_quant.format_named(f, "kv_format") for f in pair)


class _Cache:
    """A checked K/V cache pair and how sequence b's logical rows are found: block `table[b, r // rows]`, row
    r % rows.  A dense cache is the case of one block of S_cache rows per sequence (its cache_batch_idx row)."""

    def __init__(self, k_cache, v_cache, block_table, cache_batch_idx, sequences: int, quant: dict | None = None):
        quant = quant or {}
        k_fmt, v_fmt = _formats(quant.get("kv_format"))
        self.k_rows = _Rows("k", k_cache, k_fmt, quant.get("k_scales"), quant.get("k_zero_points"), None, sequences)
        self.kind = self.k_rows.kind
        self.v_rows = _Rows("v", v_cache, v_fmt, quant.get("v_scales"), quant.get("v_zero_points"), self.kind,
                            sequences)
        self.k, self.v = self.k_rows.array, self.v_rows.array
        self.quantized = k_fmt is not None or v_fmt is not None
        if self.k.shape[:3] != self.v.shape[:3]:
            raise ValueError(f"v_cache must have k_cache's blocks, rows and heads {tuple(self.k.shape[:3])}, got "
                             f"{tuple(self.v.shape[:3])}")
        if not self.quantized and self.k.dtype != self.v.dtype:
            raise TypeError(f"k_cache and v_cache must have one dtype, got {self.k.dtype} and {self.v.dtype}")
        self.num_blocks, self.block_rows, self.kv_heads = self.k.shape[:3]
        self.head_dim, self.head_dim_v = self.k_rows.head_dim, self.v_rows.head_dim
        if min(self.head_dim, self.head_dim_v, self.kv_heads) < 1:
            raise ValueError(f"k_cache and v_cache need heads and head sizes >= 1, got shapes {tuple(self.k.shape)} "
                             f"and {tuple(self.v.shape)}")
        self.paged = block_table is not None
        if self.paged:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx picks rows of a dense cache; with block_table the table does")
            table, kind = to_numpy(block_table, "block_table")
            if table.dtype != np.int32:
                raise TypeError(f"block_table must be int32, got {arguments.dtype_text(table.dtype, kind)}")
            if table.ndim != 2 or table.shape[0] != sequences:
                raise ValueError(f"block_table must have shape ({sequences}, max_blocks), got {tuple(table.shape)}")
            self.table = np.ascontiguousarray(table)
            self.picked = None
        else:
            if cache_batch_idx is None:
                if sequences > self.num_blocks:
                    raise ValueError(f"k_cache holds {self.num_blocks} sequences, fewer than the call's {sequences}; "
                                     "pass cache_batch_idx to pick rows")
                picked = np.arange(sequences, dtype=np.int64)
            else:
                picked = index_operand(cache_batch_idx, "cache_batch_idx", sequences)
                bad = (picked < 0) | (picked >= self.num_blocks)
                if bad.any():
                    at = int(np.argmax(bad))
                    raise IndexError(f"cache_batch_idx[{at}] is {int(picked[at])}, outside the cache's rows "
                                     f"[0, {self.num_blocks})")
            self.picked = picked
            self.table = picked.astype(np.int32).reshape(sequences, 1)
        self.capacity = self.table.shape[1] * self.block_rows

    def check_rows(self, rows: np.ndarray, first: np.ndarray | None = None):
        """Sequence b uses logical rows [first[b], rows[b]): within the capacity, its blocks in the cache."""
        over = rows > self.capacity
        if over.any():
            at = int(np.argmax(over))
            what = (f"{self.table.shape[1]} blocks of {self.block_rows} rows" if self.paged else
                    f"S_cache = {self.block_rows} rows")
            raise ValueError(f"sequence {at} needs {int(rows[at])} cache rows (cache_seqlens plus the new rows), "
                             f"beyond the capacity of {what}")
        if not self.paged:
            return
        used = np.arange(self.table.shape[1])[None, :] * self.block_rows
        lo = np.zeros_like(rows) if first is None else first
        used = (used < rows[:, None]) & (used + self.block_rows > lo[:, None])
        bad = used & ((self.table < 0) | (self.table >= self.num_blocks))
        if bad.any():
            b, e = (int(x[0]) for x in np.nonzero(bad))
            raise IndexError(f"block_table[{b}, {e}] is {int(self.table[b, e])}, outside the cache's blocks "
                             f"[0, {self.num_blocks})")

    def slots(self, sequence: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block, row) of logical row `position` of each `sequence` entry."""
        return self.table[sequence, position // self.block_rows].astype(np.int64), position % self.block_rows

    def write(self, k_rows: np.ndarray, v_rows: np.ndarray, blocks: np.ndarray, rows: np.ndarray, dtype: np.dtype,
              sequence: np.ndarray | None = None):
        """k_cache[blocks[t], rows[t]] = k_rows[t] (and v), quantized where the cache is, nothing else; every
        check before the first write.  dtype: what new rows of a quantized cache must be (q's)."""
        self.k_rows.check_writable(k_rows, dtype)
        self.v_rows.check_writable(v_rows, dtype)
        self.k_rows.write(k_rows, blocks, rows, sequence)
        self.v_rows.write(v_rows, blocks, rows, sequence)

    def kernel_views(self, decoded: int) -> tuple[dict, dict | None]:
        """The key and value views of the kernel call, and its kv_quant (None where neither is quantized)."""
        views = {"key": self.k_rows.kernel_view(), "value": self.v_rows.kernel_view()}
        if not self.quantized:
            return views, None
        quant = {name: rows.quant_spec(decoded) for name, rows in (("key", self.k_rows), ("value", self.v_rows))}
        return views, {name: spec for name, spec in quant.items() if spec is not None}


def _decoded_dtype(q_dtype: np.dtype) -> np.dtype:
    """What the kernels decode a quantized cache's rows to beside a query of this dtype: its own, so that the
    call's kernel is the one of q's dtype (bf16 products on bf16 pairs, f16 on AMX's f16 candidate)."""
    return np.dtype(q_dtype)


def _new_rows(x, name: str, sequences: int, kv_heads: int, head_dim: int, cu: np.ndarray | None,
              dense_rows: int | None) -> np.ndarray:
    """New K or V rows as a packed (T, H_kv, E) view: dense (B, L, H_kv, E) flattened, or packed as given."""
    array, _ = _host(x, name)
    if cu is None:
        if array.ndim != 4 or array.shape[0] != sequences or array.shape[2] != kv_heads or array.shape[3] != head_dim:
            raise ValueError(f"{name} must have shape ({sequences}, L, {kv_heads}, {head_dim}), got "
                             f"{tuple(array.shape)}")
        if dense_rows is not None and array.shape[1] != dense_rows:
            raise ValueError(f"{name} must have q's {dense_rows} rows per sequence, got {array.shape[1]}")
        return array.reshape(-1, kv_heads, head_dim)
    if array.ndim != 3 or array.shape[1:] != (kv_heads, head_dim) or array.shape[0] != int(cu[-1]):
        raise ValueError(f"{name} must have shape ({int(cu[-1])}, {kv_heads}, {head_dim}) (packed rows), got "
                         f"{tuple(array.shape)}")
    return array


def _append_slots(cache: _Cache, seqlens: np.ndarray, new_lengths: np.ndarray):
    """(block, row, sequence) of every new row, sequence by sequence, at rows [seqlens, seqlens + new_lengths)."""
    sequence = np.repeat(np.arange(seqlens.shape[0]), new_lengths)
    starts = np.concatenate([[0], np.cumsum(new_lengths)[:-1]]) if new_lengths.size else np.zeros(0, np.int64)
    position = seqlens[sequence] + (np.arange(int(new_lengths.sum())) - np.repeat(starts, new_lengths))
    return (*cache.slots(sequence, position), sequence)


def attention_with_kv_cache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                            cache_batch_idx=None, cu_seqlens_q=None, max_seqlen_q=None, scale=None, is_causal=False,
                            window=None, softcap=None, alibi_slopes=None, sinks=None, return_stats=False, out=None,
                            cache_leftpad=None, kv_format=None, k_scales=None, v_scales=None, k_zero_points=None,
                            v_zero_points=None):
    """Attention of q over each sequence's cached rows, after appending k and v (this module's docstring).
    out (B, L, H_q, Dv) or packed (T_q, H_q, Dv) in q's dtype, and with return_stats the f32 log-sum-exp.
    cache_leftpad (B,): sequence b's keys start at cache row cache_leftpad[b] (flash-attn's left padding).
    kv_format (a name of graphattn.kv_quant's, or a pair for K and V) with k_scales, v_scales and, where the
    format has them, k_zero_points and v_zero_points: the caches hold quantized rows, read in place and decoded
    as the kernels go; appended rows are quantized on write by kv_quant's rules."""
    q_array, kind = _host(q, "q")
    if q_array.dtype not in KERNEL_FLOATS:
        raise arguments.unsupported_float("q", q_array.dtype, kind)
    packed = q_array.ndim == 3
    if packed:
        if cu_seqlens_q is None:
            raise ValueError("q is packed (T_q, H_q, D): pass cu_seqlens_q, or q as (B, L, H_q, D)")
        cu, lengths = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q_array.shape[0])
        q_rows = q_array
    elif q_array.ndim == 4:
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q is for a packed q (T_q, H_q, D); q is (B, L, H_q, D)")
        b, rows = q_array.shape[:2]
        cu, lengths = np.arange(b + 1, dtype=np.int64) * rows, np.full(b, rows, np.int64)
        q_rows = q_array.reshape(b * rows, *q_array.shape[2:])
    else:
        raise ValueError(f"q must be (B, L, H_q, D) or packed (T_q, H_q, D), got shape {tuple(q_array.shape)}")
    sequences = cu.shape[0] - 1
    heads, head_dim = q_rows.shape[1:]
    quant = dict(kv_format=kv_format, k_scales=k_scales, v_scales=v_scales, k_zero_points=k_zero_points,
                 v_zero_points=v_zero_points)
    cache = _Cache(k_cache, v_cache, block_table, cache_batch_idx, sequences, quant)
    if cache.kind != kind:
        raise TypeError("q and the caches must both be NumPy arrays or both torch tensors")
    if cache.head_dim != head_dim:
        raise ValueError(f"q and k_cache must have one head size, got {head_dim} and {cache.head_dim}")
    if heads % cache.kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's ({cache.kv_heads})")
    if not cache.quantized and q_rows.dtype != cache.k.dtype:
        raise TypeError(f"q and the caches must have one dtype, got {q_rows.dtype} and {cache.k.dtype}")
    seqlens = index_operand(cache_seqlens, "cache_seqlens", sequences)
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {int(seqlens.min())}")
    leftpad = np.zeros(sequences, np.int64) if cache_leftpad is None else \
        index_operand(cache_leftpad, "cache_leftpad", sequences)
    if ((leftpad < 0) | (leftpad > seqlens)).any():
        raise ValueError("cache_leftpad must lie in [0, cache_seqlens] for every sequence")
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    new_lengths = np.zeros(sequences, np.int64)
    if k is not None:
        k_new = _new_rows(k, "k", sequences, cache.kv_heads, head_dim, cu if packed else None,
                          None if packed else q_array.shape[1])
        v_new = _new_rows(v, "v", sequences, cache.kv_heads, cache.head_dim_v, cu if packed else None,
                          None if packed else q_array.shape[1])
        new_lengths = lengths.copy()
        if cache.picked is not None and np.unique(cache.picked).size != sequences:
            raise ValueError("cache_batch_idx repeats a cache row: appending k and v there would write one row "
                             "for two sequences")
    key_rows = seqlens + new_lengths
    cache.check_rows(key_rows, leftpad)
    # The call's own checks, before anything is written.
    left, right = key_window.effective_window(window, bool(is_causal))
    cap = score_mods.softcap_value(softcap)
    alibi = per_head_operand(alibi_slopes, "alibi_slopes", heads, sequences, True)
    sink_values = per_head_operand(sinks, "sinks", heads, sequences, False)
    scale = arguments.scale_value(scale)
    if cache.quantized and cap and scale in (math.inf, -math.inf):
        raise ValueError("scale: an infinite scale with a softcap is not taken over a quantized cache")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else \
        score_mods.saturating_scale(scale, cap, q_rows, cache.k)
    result_shape = (q_rows.shape[0], heads, cache.head_dim_v)
    given = None
    if out is not None:
        given, out_kind = _host(out, "out")
        want = result_shape if packed else q_array.shape[:3] + (cache.head_dim_v,)
        if out_kind != kind or tuple(given.shape) != want or given.dtype != q_rows.dtype:
            raise ValueError(f"out must be a {'torch tensor' if kind == 'torch' else 'NumPy array'} of shape "
                             f"{want} and dtype {q_rows.dtype}")
        if not given.flags.writeable:
            raise ValueError("out is read-only")
    if k is not None:
        blocks, rows, sequence = _append_slots(cache, seqlens, new_lengths)
        cache.write(k_new, v_new, blocks, rows, q_rows.dtype, sequence)
    result = np.empty(result_shape, q_rows.dtype) if given is None or packed else given.reshape(result_shape)
    if given is not None and packed:
        result = given
    elif given is not None and not np.may_share_memory(result, given):
        raise ValueError("out must be reshapeable to packed (T, H_q, Dv) rows without a copy")
    stats = np.empty((heads, q_rows.shape[0]), np.float32) if return_stats else None
    group = heads // cache.kv_heads
    kv_views, kv_quant_specs = cache.kernel_views(kernel_code(_decoded_dtype(q_rows.dtype)))
    views = {"query": packed_rows_view(q_rows, group, True), "output": packed_rows_view(result, group, True),
             **kv_views}
    if stats is not None:
        views["stats"] = packed_stats_view(stats, group)
    for name, values in (("alibi_slopes", alibi), ("sinks", sink_values)):
        if values is not None:
            views[name] = packed_per_head_view(values, group)
    spans = np.empty((sequences, 4), np.int64)
    spans[:, 0], spans[:, 1], spans[:, 2], spans[:, 3] = cu[:-1], lengths, leftpad, key_rows - leftpad
    no_limit = _cpu.NO_KEY_LIMIT
    if sequences:
        _cpu.run_packed(views, spans, (sequences, cache.kv_heads, group), int(lengths.max(initial=0)),
                        int((key_rows - leftpad).max(initial=0)), head_dim, cache.head_dim_v, scale=scale,
                        window_left=no_limit if left == key_window.NO_LIMIT else left,
                        window_right=no_limit if right == key_window.NO_LIMIT else right,
                        alignment="bottom_right", softcap=cap, block_table=cache.table,
                        block_rows=cache.block_rows, num_blocks=cache.num_blocks, kv_quant=kv_quant_specs)
    if given is not None:
        result_out = out
    else:
        result_out = from_numpy(result if packed else result.reshape(q_array.shape[:3] + (cache.head_dim_v,)), kind)
    if not return_stats:
        return result_out
    if not packed:
        stats = np.ascontiguousarray(stats.reshape(heads, sequences, -1).transpose(1, 0, 2))
    return result_out, from_numpy(stats, kind)


def kv_cache_append(k_cache, v_cache, k, v, *, cache_seqlens=None, block_table=None, slot_mapping=None,
                    cu_seqlens=None, kv_format=None, k_scales=None, v_scales=None, k_zero_points=None,
                    v_zero_points=None):
    """Writes k and v into the cache without attending.  By position: sequence b's new rows go to its rows
    [cache_seqlens[b], cache_seqlens[b] + L_b) (k (B, L, H_kv, D), or packed (T, H_kv, D) with cu_seqlens; a
    dense cache's row b, or block_table's blocks).  By slot (vLLM): k (T, H_kv, D) and slot_mapping (T,), row t
    to block slot // block_size, row slot % block_size of the cache viewed as blocks; -1 skips the row, a
    repeated slot is refused.  Nothing but those rows is written; every check runs before the first write.
    kv_format and the scales and zero points as attention_with_kv_cache's: the rows are quantized on write (by
    slot, an fp8 cache takes one scale, not one per sequence)."""
    quant = dict(kv_format=kv_format, k_scales=k_scales, v_scales=v_scales, k_zero_points=k_zero_points,
                 v_zero_points=v_zero_points)
    if slot_mapping is not None:
        if cache_seqlens is not None or block_table is not None or cu_seqlens is not None:
            raise ValueError("slot_mapping addresses rows by itself: leave cache_seqlens, block_table and "
                             "cu_seqlens out")
        cache = _Cache(k_cache, v_cache, None, None, 0, quant)
        k_new = _new_rows(k, "k", 0, cache.kv_heads, cache.head_dim, np.array([0, _rows_of(k, "k")]), None)
        v_new = _new_rows(v, "v", 0, cache.kv_heads, cache.head_dim_v, np.array([0, k_new.shape[0]]), None)
        slots = index_operand(slot_mapping, "slot_mapping", k_new.shape[0])
        keep = slots >= 0
        slots = slots[keep]
        total = cache.num_blocks * cache.block_rows
        if (slots >= total).any():
            at = int(np.argmax(slots >= total))
            raise IndexError(f"slot_mapping holds {int(slots[at])}, beyond the cache's {total} slots")
        if np.unique(slots).size != slots.size:
            raise ValueError("slot_mapping repeats a slot: two rows would be written to one place")
        cache.write(k_new[keep], v_new[keep], slots // cache.block_rows, slots % cache.block_rows, k_new.dtype)
        return
    if cache_seqlens is None:
        raise ValueError("kv_cache_append needs cache_seqlens (or slot_mapping)")
    k_array, _ = _host(k, "k")
    if cu_seqlens is not None:
        cu, lengths = checked_cu_seqlens(cu_seqlens, "cu_seqlens", k_array.shape[0] if k_array.ndim == 3 else -1)
        sequences, rows = cu.shape[0] - 1, None
    else:
        if k_array.ndim != 4:
            raise ValueError(f"k must be (B, L, H_kv, D), or packed (T, H_kv, D) with cu_seqlens, got shape "
                             f"{tuple(k_array.shape)}")
        sequences, rows = k_array.shape[:2]
        cu, lengths = None, np.full(sequences, rows, np.int64)
    cache = _Cache(k_cache, v_cache, block_table, None, sequences, quant)
    k_new = _new_rows(k, "k", sequences, cache.kv_heads, cache.head_dim, cu, None)
    v_new = _new_rows(v, "v", sequences, cache.kv_heads, cache.head_dim_v, cu, rows)
    seqlens = index_operand(cache_seqlens, "cache_seqlens", sequences)
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {int(seqlens.min())}")
    cache.check_rows(seqlens + lengths, seqlens)
    blocks, rows, sequence = _append_slots(cache, seqlens, lengths)
    cache.write(k_new, v_new, blocks, rows, k_new.dtype, sequence)


def _rows_of(x, name: str) -> int:
    array, _ = _host(x, name)
    if array.ndim != 3:
        raise ValueError(f"{name} must be (T, H_kv, D) with slot_mapping, got shape {tuple(array.shape)}")
    return array.shape[0]
