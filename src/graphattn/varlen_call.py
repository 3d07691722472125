"""The varlen calls' kernel route: the packed-sequence record (_Call) and the runs of varlen_attention and
varlen_attention_backward (varlen.py states the conventions).  varlen.py routes torch calls that need autograd
to varlen_torch's custom ops, which come back here; neither of those imports varlen.py.
"""
from __future__ import annotations

import math
import time

import numpy as np

from . import _cpu, arguments, call_prep, key_window, score_mods, sycl_runtime, verbose
from .dtypes import kernel_code
from .interop import from_numpy, is_torch_tensor, to_numpy
from .logical_tensor import dense_strides
from .tensor import array_strides, element_strides

_INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


# ---- a packed call's kernel views: batch dims (sequence, K/V head, query head in its group), row, column ----
# (varlen and the KV-cache calls)

def packed_rows_view(a: np.ndarray, group: int, grouped: bool) -> tuple:
    """(code, strides, array) of a (T, H, E) operand: H_q heads split into (H_kv, group), or H_kv heads."""
    t, h, e = _strides(a)
    heads = (group * h, h) if grouped else (h, 0)
    return kernel_code(a.dtype), (0,) + heads + (t, e), a


def packed_stats_view(stats: np.ndarray, group: int) -> tuple:
    """The same for (H_q, T) f32 stats."""
    h, t = _strides(stats)
    return kernel_code(stats.dtype), (0, group * h, h, t, 0), stats


def packed_per_head_view(a: np.ndarray, group: int) -> tuple:
    """The same for a per-head operand, (H_q,) or (B, H_q) (per_head_operand's)."""
    steps = element_strides(a)
    per_sequence = steps[0] if a.ndim == 2 else 0
    h = steps[-1]
    return kernel_code(a.dtype), (per_sequence, group * h, h, 0, 0), a


def host_operand(x, name: str) -> tuple[np.ndarray, str]:
    """x as the kernels read it: a NumPy view of a host array or torch tensor, or a USM array (dpnp,
    usm_ndarray) as it is (kind "usm")."""
    if sycl_runtime.is_usm_array(x):
        return x, "usm"
    array, kind = to_numpy(x, name)
    arguments.check_host_array(array, name)
    return array, kind


def checked_cu_seqlens(cu_seqlens, name: str, total: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) as int64 of cu_seqlens: a 1-D int32 or int64 array of B + 1 offsets, 0 first,
    non-decreasing, `total` last (a USM array is read on the host: the planner needs the lengths)."""
    array, kind = (sycl_runtime.tohost_operand(cu_seqlens), "usm") if sycl_runtime.is_usm_array(cu_seqlens) else \
        to_numpy(cu_seqlens, name)
    if array.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {arguments.dtype_text(array.dtype, kind)}")
    if array.ndim != 1 or array.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with B + 1 entries (B >= 0 sequences), got shape {tuple(array.shape)}")
    offsets = array.astype(np.int64)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(offsets[0])}")
    steps = offsets[1:] - offsets[:-1]
    if steps.size and int(steps.min()) < 0:
        at = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing, but entry {at + 1} ({int(offsets[at + 1])}) is below entry "
                         f"{at} ({int(offsets[at])})")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total} (rows of the packed tensor), got "
                         f"{int(offsets[-1])}")
    return offsets, steps


def _max_seqlen(given, lengths: np.ndarray, name: str) -> int:
    longest = int(lengths.max()) if lengths.size else 0
    if given is None:
        return longest
    value = arguments.integer(given, name)
    if value < longest:
        raise ValueError(f"{name} is {value}, below the longest sequence's {longest} rows")
    return value


def per_head_operand(value, name: str, heads: int, sequences: int, per_sequence: bool):
    """A per-head operand of a call of packed sequences as a contiguous f32 host array: (H_q,), or (B, H_q)
    where per_sequence (ALiBi slopes by sequence); None stays None."""
    if value is None:
        return None
    if name == "alibi_slopes":
        score_mods.refuse_slopes_grad(value)
    array, kind = to_numpy(value, name)
    if array.dtype != np.float32:
        raise TypeError(f"{name} dtype {arguments.dtype_text(array.dtype, kind)} is not supported; it must be "
                        f"{arguments.dtype_text(np.float32, kind)}")
    shapes = [(heads,)] + ([(sequences, heads)] if per_sequence else [])
    if tuple(array.shape) not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))} (one value per query head"
                         f"{' or per sequence and query head' if per_sequence else ''}), got {tuple(array.shape)}")
    return np.ascontiguousarray(array)


class _Call:
    """One varlen call's checked operands as the kernel takes them (NumPy views of the caller's memory)."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                 causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset):
        names = ("q", "k", "v")
        arrays = [host_operand(x, n) for x, n in zip((q, k, v), names)]
        kinds = {kind for _, kind in arrays}
        if len(kinds) != 1:
            raise TypeError("q, k and v must all be NumPy arrays, all torch tensors or all USM arrays (dpnp)")
        self.kind = kinds.pop()
        self.q, self.k, self.v = (a for a, _ in arrays)
        for name, a in zip(names, (self.q, self.k, self.v)):
            if a.ndim != 3:
                raise ValueError(f"{name} must be 3-D (total rows, heads, head size), got shape {tuple(a.shape)}")
            if a.dtype not in call_prep.KERNEL_FLOATS:
                raise arguments.unsupported_float(name, a.dtype, self.kind)
        (t_q, h_q, d), (t_k, h_kv, d_k), (t_v, h_v, d_v) = self.q.shape, self.k.shape, self.v.shape
        if d != d_k:
            raise ValueError(f"q and k must have one head size, got {d} and {d_k}")
        if (t_v, h_v) != (t_k, h_kv):
            raise ValueError(f"v must have k's rows and heads {(t_k, h_kv)}, got {(t_v, h_v)}")
        if min(d, d_v) < 1:
            raise ValueError(f"head sizes must be at least 1, got q/k {d} and v {d_v}")
        if h_kv < 1 or h_q % h_kv:
            raise ValueError(f"q's heads ({h_q}) must be a multiple of k's and v's ({h_kv})")
        self.total_q, self.heads, self.kv_heads, self.head_dim, self.head_dim_v = t_q, h_q, h_kv, d, d_v
        self.group = h_q // h_kv
        cu_q, rows_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", t_q)
        cu_k, rows_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", t_k)
        if cu_q.shape != cu_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence and one more, got "
                             f"{cu_q.shape[0]} and {cu_k.shape[0]}")
        self.sequences = cu_q.shape[0] - 1
        self.max_q = _max_seqlen(max_seqlen_q, rows_q, "max_seqlen_q")
        self.max_k = _max_seqlen(max_seqlen_k, rows_k, "max_seqlen_k")
        self.spans = np.empty((self.sequences, 4), np.int64)  # (query_begin, query_rows, key_begin, key_rows)
        self.spans[:, 0], self.spans[:, 1], self.spans[:, 2], self.spans[:, 3] = cu_q[:-1], rows_q, cu_k[:-1], rows_k
        self.alignment = key_window.checked_alignment(causal_alignment)
        self.left, self.right = key_window.effective_window(window, bool(is_causal))
        self.softcap = score_mods.softcap_value(softcap)
        self.alibi = per_head_operand(alibi_slopes, "alibi_slopes", self.heads, self.sequences, True)
        self.sinks = per_head_operand(sinks, "sinks", self.heads, self.sequences, False)
        self.dropout_p = arguments.dropout_probability(dropout_p)
        self.dropout_seed = 0 if dropout_seed is None else arguments.integer(dropout_seed, "dropout_seed")
        self.dropout_offset = arguments.integer(dropout_offset, "dropout_offset")
        for name, value in (("dropout_seed", self.dropout_seed), ("dropout_offset", self.dropout_offset)):
            if not 0 <= value < 1 << 64:
                raise ValueError(f"{name} must be in [0, 2**64), got {value}")
        scale = arguments.scale_value(scale)
        self.scale = 1.0 / math.sqrt(d) if scale is None else \
            score_mods.saturating_scale(scale, self.softcap, self.q, self.k)

    # ---- the kernel's views: batch dims (sequence, K/V head, query head in its group), row, column ----

    def rows_view(self, a: np.ndarray, grouped: bool) -> tuple:
        return packed_rows_view(a, self.group, grouped)

    def stats_view(self, stats: np.ndarray) -> tuple:
        return packed_stats_view(stats, self.group)

    def per_head_view(self, a: np.ndarray) -> tuple:
        return packed_per_head_view(a, self.group)

    def forward_views(self, out: np.ndarray, stats: np.ndarray) -> dict:
        views = {"query": self.rows_view(self.q, True), "key": self.rows_view(self.k, False),
                 "value": self.rows_view(self.v, False), "output": self.rows_view(out, True)}
        if stats is not None:
            views["stats"] = self.stats_view(stats)
        if self.alibi is not None:
            views["alibi_slopes"] = self.per_head_view(self.alibi)
        if self.sinks is not None:
            views["sinks"] = self.per_head_view(self.sinks)
        return views

    def run(self, views: dict, backward: bool, plan_only: bool = False):
        """The kernel call (or its plan's text); with verbose output on, its plan and time are logged."""
        if verbose.enabled() and not plan_only:
            entry = "varlen_backward_cpu" if backward else "varlen_forward_cpu"
            shape = (f"sequences={self.sequences},tq={self.total_q},tk={self.k.shape[0]},heads={self.heads}x"
                     f"{self.kv_heads},d={self.head_dim},dv={self.head_dim_v},dtype={self.q.dtype}")
            verbose.log("compile", "varlen", entry, self._call(views, backward, True), shape)
            start = time.perf_counter()
            self._call(views, backward, False)
            verbose.log("exec", "varlen", entry, shape, f"{(time.perf_counter() - start) * 1e3:.4f}ms")
            return None
        return self._call(views, backward, plan_only)

    def _call(self, views: dict, backward: bool, plan_only: bool):
        no_limit = _cpu.NO_KEY_LIMIT
        return _cpu.run_packed(
            views, self.spans, (self.sequences, self.kv_heads, self.group), self.max_q, self.max_k, self.head_dim,
            self.head_dim_v, scale=self.scale,
            window_left=no_limit if self.left == key_window.NO_LIMIT else self.left,
            window_right=no_limit if self.right == key_window.NO_LIMIT else self.right,
            alignment=self.alignment, softcap=self.softcap, dropout_p=self.dropout_p,
            dropout_seed=self.dropout_seed, dropout_offset=self.dropout_offset, backward=backward,
            plan_only=plan_only)


def head_major(shape: tuple, dtype) -> np.ndarray:
    """A new (T, H, E) result laid out head-major, (H, T, E) in memory: each head's rows lie together, as a dense
    call's (B, H, L, E) output does, which the kernels write faster than rows of all heads interleaved
    (docs/performance.md, "Packed sequences").  A view of it: reshape copies where a layout needs it."""
    rows, heads, cols = shape
    return np.empty((heads, rows, cols), dtype).swapaxes(0, 1)


def _strides(a) -> tuple:
    """Element strides, dense ones for an empty array (NumPy may give it any, 0 included: no element is read)."""
    return array_strides(a) if a.size else dense_strides(a.shape)


def _checked_result(given, shape: tuple, dtype, kind: str, name: str) -> np.ndarray:
    """An output array the caller passed, as a NumPy view: its shape and dtype as the call's, writable."""
    array, given_kind = host_operand(given, name)
    if given_kind != kind:
        raise TypeError(f"{name} must be a {'torch tensor' if kind == 'torch' else 'NumPy array'} like q")
    if tuple(array.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(array.shape)}")
    if array.dtype != dtype:
        raise TypeError(f"{name} must have dtype {arguments.dtype_text(dtype, kind)}, got "
                        f"{arguments.dtype_text(array.dtype, kind)}")
    if not array.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return array


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal, causal_alignment,
              window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset, return_stats, out):
    """varlen.varlen_attention's call (its arguments in its order) without autograd: checked and run."""
    if dropout_seed is None and arguments.dropout_probability(dropout_p):
        dropout_seed = new_dropout_seed(q)
    call = _Call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                 causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset)
    if call.kind == "usm":
        return _sycl_forward(call, out, return_stats)
    shape = (call.total_q, call.heads, call.head_dim_v)
    result = head_major(shape, call.q.dtype) if out is None else \
        _checked_result(out, shape, call.q.dtype, call.kind, "out")
    stats = np.empty((call.heads, call.total_q), np.float32) if return_stats else None  # written where asked for
    call.run(call.forward_views(result, stats), backward=False)
    if out is not None:
        result = out
    else:
        result = from_numpy(result, call.kind)
    return (result, from_numpy(stats, call.kind)) if return_stats else result


def _sycl_forward(call: _Call, out, return_stats: bool):
    """varlen_attention on USM arrays: the SYCL plugin's sub-group forward, the same length record; results
    on q's queue, ready on return."""
    queue = sycl_runtime.array_queue(call.q)
    for name, a in (("k", call.k), ("v", call.v)):
        if sycl_runtime.array_queue(a).sycl_context != queue.sycl_context:
            raise ValueError(f"{name} lives on another SYCL context than q")
    if not (call.q.dtype == call.k.dtype == call.v.dtype) or call.q.dtype not in (np.float32, np.float16):
        raise TypeError(f"q, k and v on SYCL must share one dtype, float32 or float16, got {call.q.dtype}, "
                        f"{call.k.dtype} and {call.v.dtype}")
    if out is not None:
        raise ValueError("out: not taken with USM arrays yet")
    shape = (call.total_q, call.heads, call.head_dim_v)
    result = sycl_runtime.empty((shape[1], shape[0], shape[2]), call.q.dtype, queue).swapaxes(0, 1)
    stats = sycl_runtime.empty((call.heads, call.total_q), np.float32, queue) if return_stats else None
    host = {"alibi_slopes": call.alibi, "sinks": call.sinks}
    arrays = {"query": (call.q, True), "key": (call.k, False), "value": (call.v, False), "output": (result, True)}
    views = {name: call.rows_view(a, grouped)[:2] for name, (a, grouped) in arrays.items()}
    usm = {name: a for name, (a, _) in arrays.items()}
    if stats is not None:
        views["stats"], usm["stats"] = call.stats_view(stats)[:2], stats
    for name, a in host.items():
        if a is not None:
            views[name], usm[name] = call.per_head_view(a)[:2], sycl_runtime.to_device(a, queue)
    sycl_runtime.wait_for_producers(list(usm.values()))
    no_limit = _cpu.NO_KEY_LIMIT
    sycl_runtime.plugin().forward_packed(
        queue, {name: view + (sycl_runtime.usm_address(usm[name]),) for name, view in views.items()}, call.spans,
        (call.sequences, call.kv_heads, call.group), call.max_q, call.max_k, call.head_dim, call.head_dim_v,
        scale=call.scale, window_left=no_limit if call.left == key_window.NO_LIMIT else call.left,
        window_right=no_limit if call.right == key_window.NO_LIMIT else call.right, alignment=call.alignment,
        softcap=call.softcap, dropout_p=call.dropout_p, dropout_seed=call.dropout_seed,
        dropout_offset=call.dropout_offset, extents={name: sycl_runtime.usm_layout(a) for name, a in usm.items()})
    queue.wait()
    return (result, stats) if return_stats else result


def new_dropout_seed(q) -> int:
    """A fresh dropout seed: from torch's generator for torch tensors (torch.manual_seed repeats it), else the
    OS's entropy."""
    if is_torch_tensor(q):
        from .interop import torch_random_seed

        return torch_random_seed()
    return call_prep.new_dropout_seed()


def backward(grad_out, q, k, v, out, stats, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
             causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset,
             return_sinks_grad, grads_out):
    """varlen.varlen_attention_backward's call (its arguments in its order): checked and run."""
    if arguments.dropout_probability(dropout_p) and dropout_seed is None:
        raise ValueError("dropout_seed: the backward of a call with dropout needs the forward's seed")
    if return_sinks_grad and sinks is None:
        raise ValueError("return_sinks_grad: the call has no sinks")
    call = _Call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, is_causal,
                 causal_alignment, window, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset)
    if call.kind == "usm":
        raise NotImplementedError("varlen_attention_backward on USM arrays: the SYCL backward does not take packed "
                                  "sequences yet; pass host arrays")
    o_shape = (call.total_q, call.heads, call.head_dim_v)
    checked = {}
    for name, given, shape, dtype in (("grad_out", grad_out, o_shape, None), ("out", out, o_shape, None),
                                      ("stats", stats, (call.heads, call.total_q), np.dtype(np.float32))):
        array, kind = host_operand(given, name)
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(array.shape)}")
        if dtype is not None and array.dtype != dtype:
            raise TypeError(f"{name} must be {arguments.dtype_text(dtype, kind)}, got "
                            f"{arguments.dtype_text(array.dtype, kind)}")
        if dtype is None and array.dtype not in call_prep.KERNEL_FLOATS:
            raise arguments.unsupported_float(name, array.dtype, kind)
        checked[name] = array
    like = (call.q, call.k, call.v)
    if grads_out is None:
        grads = [head_major(a.shape, a.dtype) for a in like]
    else:
        if len(grads_out) != 3:
            raise ValueError(f"grads_out must be (dq, dk, dv), got {len(grads_out)} arrays")
        grads = [_checked_result(g, a.shape, a.dtype, call.kind, f"grads_out[{i}]")
                 for i, (g, a) in enumerate(zip(grads_out, like))]
    views = call.forward_views(checked["out"], checked["stats"])
    views["grad_output"] = call.rows_view(checked["grad_out"], True)
    views["grad_query"] = call.rows_view(grads[0], True)
    views["grad_key"] = call.rows_view(grads[1], False)
    views["grad_value"] = call.rows_view(grads[2], False)
    dsinks = None
    if return_sinks_grad:
        dsinks = np.empty((call.heads,), np.float32)
        views["grad_sinks"] = call.per_head_view(dsinks)
    call.run(views, backward=True)
    results = list(grads_out) if grads_out is not None else [from_numpy(g, call.kind) for g in grads]
    if return_sinks_grad:
        results.append(from_numpy(dsinks, call.kind))
    return tuple(results)


def dispatch_text(q, k, v, cu_seqlens_q, cu_seqlens_k, *, backward: bool = False, **options) -> str:
    """The kernel plan of a varlen call, as the verbose log gives it: how its sequences go to dense calls and
    threads (layout=packed, team_calls, pooled_tasks), then the largest dense call's kernel and layout."""
    call = _Call(q, k, v, cu_seqlens_q, cu_seqlens_k, options.get("max_seqlen_q"), options.get("max_seqlen_k"),
                 options.get("scale"), options.get("is_causal", False), options.get("causal_alignment",
                 "bottom_right"), options.get("window"), options.get("softcap"), options.get("alibi_slopes"),
                 options.get("sinks"), options.get("dropout_p", 0.0), options.get("dropout_seed", 0),
                 options.get("dropout_offset", 0))
    out = np.empty((call.total_q, call.heads, call.head_dim_v), call.q.dtype)
    stats = np.empty((call.heads, call.total_q), np.float32)
    views = call.forward_views(out, stats)
    if backward:
        views["grad_output"] = call.rows_view(out, True)
        views["grad_query"] = call.rows_view(np.empty(call.q.shape, call.q.dtype), True)
        views["grad_key"] = call.rows_view(np.empty(call.k.shape, call.k.dtype), False)
        views["grad_value"] = call.rows_view(np.empty(call.v.shape, call.v.dtype), False)
    return call.run(views, backward=backward, plan_only=True)
