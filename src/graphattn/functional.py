"""The one-call API: scaled_dot_product_attention with PyTorch's arguments and OpenVINO SDPA-13 broadcasting.

A new signature (shapes, strides, dtypes and flags) is checked, described as an
AttentionSpec and lowered to its kernel call (attention_spec.py, the route the
backward and the graph API's fused partitions take too), and the plan is
cached; later calls with the same signature only bind data and run the kernel.
A call that differs from a planned one only in its sequence lengths (a decode
loop's growing K/V) runs through that plan's lowering replayed at the kernel's
call for its lengths and strides (_LengthFreePlan): nothing is checked, lowered
or kept per length, so a new length costs what a length seen before costs.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np

from . import _cpu, arguments, key_window, score_mods, sycl_runtime, verbose
from .dtypes import DataType, from_numpy as dtype_of, numpy_dtype
from .attention_spec import (AttentionSpec, KernelCall, NotUsable, Operand, default_scale, kernel_window,
                             lower_as_given_or_copied)
from .kernels.fused_sdpa import check_sycl_usable
from .logical_tensor import dense_strides
from .views import reshape_strides
from .ops.philox import bits64
from .ops.broadcast import broadcast_shapes
from .interop import (from_numpy, is_torch_tensor, plain_torch_tensors, to_numpy, torch_empty, torch_empty_like,
                      torch_compiling, torch_layout, torch_random_seed)
from .plan_cache import SignatureCache
from .tensor import array_strides

_NEG_INF = float("-inf")
_RUNS_ON_HOST = object()  # the cache's entry for USM calls the SYCL kernels cannot take
_NOT_REPLAYED = object()  # the length-free cache's entry for a class of calls planned per length (copies)
_cache = SignatureCache()  # compiled partitions of the forward
_by_length_free = SignatureCache()  # _LengthFreePlan by signature with the sequence lengths left out
# the sequence lengths in signature_key: dim -2 of Q, K and V, both of the mask's
_FREE_AXES = (0, 0b10) * 3 + (0, 0b11)

ALIGNMENTS = key_window.ALIGNMENTS
_NO_LIMIT = key_window.NO_LIMIT
_OPEN = (_NO_LIMIT, _NO_LIMIT)  # the bounds of a call without window or is_causal
# The dtypes of query, key and value the kernels take.
_KERNEL_FLOATS = frozenset(numpy_dtype(dt) for dt in (DataType.f32, DataType.bf16, DataType.f16))


@dataclass(slots=True)
class _ForwardPlan:
    """What one signature (layouts, dtypes and flags of the operands) fixes of a forward call: the checks
    passed, the lowered kernel call, and the shapes of the outputs and of any copies."""
    call: KernelCall          # the lowered call
    plan: object              # the kernel's plan (_cpu.ForwardPlan, or the SYCL plugin's)
    runner: object            # the host kernel's direct call (BoundForward.run), or None on SYCL
    copies: tuple | None      # the full shapes Q, K, V and the mask are copied to where the kernel cannot walk
                              # the caller's strides, and (grouped) their shapes with the GQA heads split
    grouped: tuple | None     # ((..., Hkv, rep, rows, cols)), which the copies are broadcast from
    out_shape: tuple
    stats_shape: tuple
    out_dtype: np.dtype       # the output's NumPy dtype
    default_scale: float      # 1 / sqrt(E), the scale of calls without one
    out_like_query: bool      # the output has the query's shape and C-contiguous layout (its dtype always)
    window: tuple             # the kernel's (left, right), as the runner has it


class _LengthFreePlan:
    """A forward plan made for one call, which calls that differ from it only in sequence lengths (each 2 or
    more) run through at their own lengths: their checks passed with its own (the lengths' rules are re-checked
    here) and native/cpu replays its lowering for their strides at the kernel's call, where the lowering's
    batch folds still hold.  Nothing is kept per length: such a call costs the same at any length, new or not."""

    def __init__(self, entry: _ForwardPlan, bounds: tuple, alignment: str):
        self.entry = entry
        self.bounds = bounds          # the window (left, right) before alignment, is_causal included
        self.alignment = alignment
        # the kernel's window is the template's at any length without a window or a row shift (top-left)
        self.fixed_window = bounds == _OPEN or key_window.row_shift(alignment, 1, 2) == 0
        self.out_head = entry.out_shape[:-2]
        self.head_dim_v = entry.out_shape[-1]
        self.out_dtype, self.default_scale = entry.out_dtype, entry.default_scale
        # the dense output's batch strides over seq_q * head_dim_v: the products of the inner batch dims
        call = entry.call
        self.replay = entry.plan.length_free(call.sources, call.folds, dense_strides(call.call_batch + (1,))[:-1])
        self.window = entry.window
        self.stats = "stats" in call.roles  # the plan returns the stats
        self.replay.set_results(self.out_head, self.out_dtype, self.stats)

    def run(self, q, k, v, mask, out, layouts, scale, seed: int, offset: int, mods, kind: str):
        """The call's results (as scaled_dot_product_attention returns them), or None where the template's
        lowering does not hold for it (nothing is written).  q, k, v, mask: NumPy arrays, or with layouts
        (interop.torch_layout's of Q, K and V) torch tensors and no mask; out: the caller's output array or
        None; seed and offset: the dropout's (_dropout_bits)."""
        if self.fixed_window and out is None and not verbose.enabled():  # all of it in one native call
            left, right = self.window
            scale_value = self.default_scale if scale is None else arguments.scale_value(scale)
            if layouts is not None:  # torch's: never a mask or modifiers
                return self.replay.call_layouts(layouts, q, k, v, left, right, scale_value, seed, offset,
                                                torch_empty_like, torch_empty)
            if mask is None and kind == "numpy":
                return self.replay.call_numpy(q, k, v, left, right, scale_value, seed, offset,
                                              *(() if mods is None else (mods.alibi_slopes, mods.sinks)))
        if layouts is None:
            q_shape, seq_kv, strides = q.shape, k.shape[-2], (q, k, v, mask)
            if v.shape[-2] != seq_kv or mask is not None and not _mask_fits(mask.shape, q_shape[-2], seq_kv):
                return None  # the call breaks a length rule: the full checks name it
        else:
            (q_shape, q_strides, _, _), (k_shape, k_strides, _, _), (v_shape, v_strides, _, _) = layouts
            seq_kv, strides = k_shape[-2], (q_strides, k_strides, v_strides, None)
            if v_shape[-2] != seq_kv:
                return None
        seq_q = q_shape[-2]
        if self.fixed_window:
            left, right = self.window
        else:
            left, right = replayed_window(self.bounds, self.alignment, seq_q, seq_kv)
        out_shape = self.out_head + (seq_q, self.head_dim_v)
        if layouts is not None:
            out = torch_empty_like(q) if q_shape == out_shape and _cpu.row_major(q_shape, strides[0]) else \
                torch_empty(out_shape, self.out_dtype)
            stats = torch_empty(out_shape[:-1] + (1,), np.float32) if self.stats else None
        else:
            out = np.empty(out_shape, self.out_dtype) if out is None else \
                checked_out(out, out_shape, self.out_dtype, {"query": q, "key": k, "value": v, "attn_mask": mask},
                            "out")
            stats = np.empty(out_shape[:-1] + (1,), np.float32) if self.stats else None
        scale_value = self.default_scale if scale is None else arguments.scale_value(scale)
        per_head = () if mods is None else (mods.alibi_slopes, mods.sinks)
        if verbose.enabled():
            return self._run_logged(seq_q, seq_kv, strides, left, right, q, k, v, out, mask, stats, scale_value,
                                    seed, offset, per_head, layouts is not None, kind)
        if not self.replay.run(seq_q, seq_kv, strides, left, right, q, k, v, out, mask, stats, scale_value, seed,
                               offset, *per_head):
            return None
        if layouts is not None or kind == "numpy":  # as they are
            return out if stats is None else (out, stats)
        return _results(out, stats, False, kind)

    def _run_logged(self, seq_q, seq_kv, strides, left, right, q, k, v, out, mask, stats, scale, seed, offset,
                    per_head, torch_input, kind):
        """run's kernel call with its verbose lines: the replayed plan and the call's time."""
        plan = self.replay.plan_for(seq_q, seq_kv, *strides, left, right)
        if plan is None:
            return None
        shape_text = self.entry.call.shape_text_for(seq_q, seq_kv, left, right)
        verbose.log("compile", "functional", "sdpa_forward_cpu", f"{plan.dispatch_text()},plan=replayed",
                    shape_text)
        start = time.perf_counter()
        self.replay.run(seq_q, seq_kv, strides, left, right, q, k, v, out, mask, stats, scale, seed, offset,
                        *per_head)
        verbose.log("exec", "functional", "sdpa_forward_cpu", shape_text,
                    f"{(time.perf_counter() - start) * 1e3:.4f}ms")
        return _results(out, stats, torch_input, kind)


def replayed_window(bounds: tuple, alignment: str, seq_q: int, seq_kv: int) -> tuple:
    """kernel_window's (left, right) at these lengths as a replayed plan takes them: NO_KEY_LIMIT for an open
    side."""
    return tuple([_cpu.NO_KEY_LIMIT if w is None else w for w in kernel_window(bounds, alignment, seq_q, seq_kv)])


def new_dropout_seed() -> int:
    """A fresh 63-bit seed from the OS's entropy (what dropout_seed=None uses)."""
    return secrets.randbits(63)


def _layout(a) -> tuple:
    if type(a) is np.ndarray:  # byte strides pin the layout as well as element strides, and cost nothing
        return a.shape, a.strides if a.size else a.shape, a.dtype.str
    return tuple(a.shape), array_strides(a) if a.size else tuple(a.shape), a.dtype.str


def _sycl_inputs(query, key, value, attn_mask):
    """(q, k, v, mask, queue) when the inputs are USM arrays (dpnp or usm_ndarray), else None."""
    arrays = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if all(type(a) is np.ndarray or is_torch_tensor(a) for a in arrays):  # host arrays: the common case, checked first
        return None
    on_device = [sycl_runtime.is_usm_array(a) for a in arrays]
    if not any(on_device):
        return None
    if not all(on_device):
        raise TypeError("query, key, value and attn_mask must all be USM arrays (dpnp) or all host arrays")
    queue = sycl_runtime.array_queue(query)
    for name, a in zip(("key", "value", "attn_mask"), arrays[1:]):
        if sycl_runtime.array_queue(a).sycl_context != queue.sycl_context:
            raise ValueError(f"{name} lives on another SYCL context than query")
    for name, a in zip(("query", "key", "value"), arrays[:3]):
        if a.dtype not in (np.float32, np.float16):
            raise TypeError(f"{name} dtype {a.dtype} is not supported on SYCL by the functional API (float32 or "
                            "float16; bf16 data runs through the graph API as uint16 bit patterns)")
    return query, key, value, attn_mask, queue


def _empty_like_kind(template, shape, dtype, queue):
    """An output array: NumPy on the CPU, else the USM kind of template (dpnp array or usm_ndarray)."""
    if queue is None:
        return np.empty(shape, dtype)
    if type(template).__module__.startswith("dpnp.tensor"):
        import dpnp.tensor as dpt

        return dpt.empty(shape, dtype=dtype, sycl_queue=queue)
    import dpnp

    return dpnp.empty(shape, dtype=dtype, sycl_queue=queue)


def _check_inputs(q, k, v, mask, is_causal, enable_gqa, causal_alignment, kind="numpy"):
    """The rules of a new signature (shapes, dtypes, flags) on NumPy or USM arrays; kind is the caller's array
    kind, for messages in its terms.  Returns whether the call is grouped-query (enable_gqa with fewer K/V
    heads)."""
    operands = (("query", q), ("key", k), ("value", v)) + ((("attn_mask", mask),) if mask is not None else ())
    for name, a in operands:
        if isinstance(a, np.ndarray):
            arguments.check_host_array(a, name)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., seq, head_dim), got shape {a.shape}")
        if a.dtype not in _KERNEL_FLOATS:
            raise arguments.unsupported_float(name, a.dtype, kind)
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {arguments.dtype_text(q.dtype, kind)}, "
                        f"{arguments.dtype_text(k.dtype, kind)}, {arguments.dtype_text(v.dtype, kind)}")
    if mask is not None and mask.dtype != np.bool_ and mask.dtype not in (q.dtype, np.float32):
        raise TypeError(f"attn_mask dtype {arguments.dtype_text(mask.dtype, kind)} is not supported; a mask is "
                        f"bool or float ({arguments.dtype_text(np.float32, kind)} or the query's "
                        f"{arguments.dtype_text(q.dtype, kind)})")
    arguments.check_head_sizes(q.shape, k.shape, v.shape)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head dims differ: query {q.shape} (E={q.shape[-1]}) vs key {k.shape} "
                         f"(E={k.shape[-1]})")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value sequence lengths differ: key {k.shape} vs value {v.shape}")
    if is_causal and mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both")
    key_window.checked_alignment(causal_alignment)
    hq, hkv = q.shape[-3], k.shape[-3]
    gqa = enable_gqa and hq != hkv
    if gqa:
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(f"key and value head counts differ: key {k.shape} vs value {v.shape}")
        if hq % hkv:
            raise ValueError(f"enable_gqa needs query heads divisible by key/value heads: Hq={hq}, Hkv={hkv} "
                             f"(query {q.shape}, key {k.shape})")
        batch_shapes = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    else:
        batch_shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    try:
        batch = broadcast_shapes(batch_shapes, "batch")
    except ValueError:
        hint = " (different head counts need enable_gqa=True)" if hq != hkv and not enable_gqa else ""
        raise ValueError(f"batch dims of query {q.shape}, key {k.shape} and value {v.shape} "
                         f"are not broadcastable{hint}") from None
    if gqa:
        batch = batch + (hq,)
    if mask is not None:
        target = batch + (q.shape[-2], k.shape[-2])
        try:
            if broadcast_shapes([target, mask.shape], "mask") != target:
                raise ValueError
        except ValueError:
            raise ValueError(f"attn_mask of shape {mask.shape} does not broadcast to {target} "
                             "(batch..., L, S)") from None
    return gqa


def _normalize_mask(mask):
    """None, or an array of rank >= 2; a scalar zero float mask means no mask."""
    if mask is None:
        return None
    if mask.dtype != np.bool_ and mask.ndim == 0 and float(mask) == 0.0:
        return None
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    return mask


def grouped_shapes(q, k, v, mask, gqa: bool) -> tuple:
    """Q, K, V and the mask's shapes with a GQA group's heads as two dims, (..., Hkv, rep, rows, cols) for Q
    and (..., Hkv, 1, rows, cols) for K and V, so that K and V broadcast over the group (stride 0, no copy);
    the shapes themselves without GQA."""
    if not gqa:
        return q.shape, k.shape, v.shape, None if mask is None else mask.shape
    hq, hkv = q.shape[-3], k.shape[-3]
    shapes = (q.shape[:-3] + (hkv, hq // hkv) + q.shape[-2:], k.shape[:-3] + (hkv, 1) + k.shape[-2:],
              v.shape[:-3] + (hkv, 1) + v.shape[-2:])
    if mask is None:
        return shapes + (None,)
    full = (1,) * (q.ndim - mask.ndim) + tuple(mask.shape)
    heads = (hkv, hq // hkv) if full[-3] == hq else (1, 1)
    return shapes + (full[:-3] + heads + full[-2:],)


def _grouped_origin(array_ndim: int, grouped: tuple) -> tuple:
    """Operand.origin of an array's view in its grouped shape (grouped_shapes): the array's dims, left-padded
    with size-1 dims to the query's rank (no array axis), its head dim (-3) split in two, (groups, rep), whose
    strides are the head's times rep and times 1; rep is the grouped shape's dim -3 (1 for K and V)."""
    pad = len(grouped) - 1 - array_ndim
    full = [(axis - pad, 1) if axis >= pad else None for axis in range(len(grouped) - 1)]
    head = full[-3]
    return tuple(full[:-3]) + (None if head is None else (head[0], grouped[-3]), head) + tuple(full[-2:])


def _mask_fits(mask_shape: tuple | None, seq_q: int, seq_kv: int) -> bool:
    """Whether a mask of this shape (None: no mask) broadcasts to a replayed call's (seq_q, seq_kv) scores: the
    length rule a replay re-checks (the others held for its template)."""
    return mask_shape is None or (mask_shape[-2] in (1, seq_q) and mask_shape[-1] in (1, seq_kv))


def _new_plan(q, k, v, mask, torch_direct, is_causal, enable_gqa, bounds, alignment, return_stats, dropout_p,
              queue, kind, mods=None):
    """The plan of a new signature: checked and built on NumPy views (the same memory); a torch tensor off the
    CPU is refused here."""
    qc, kc, vc = (to_numpy(x, name)[0] for x, name in ((q, "query"), (k, "key"), (v, "value"))) \
        if torch_direct else (q, k, v)
    gqa = _check_inputs(qc, kc, vc, mask, is_causal, enable_gqa, alignment, kind)
    try:
        return _build(qc, kc, vc, mask, gqa, bounds, alignment, return_stats, dropout_p, queue, mods)
    except NotUsable as why:  # only the SYCL kernels' limits: on the host, copies always fold
        verbose.log("fallback", "functional", f"the SYCL kernels cannot take this call ({why}): it runs on "
                    "the host")
        return _RUNS_ON_HOST


def _build(q, k, v, mask, gqa, bounds, alignment, return_stats, dropout_p, queue, mods=None) -> _ForwardPlan:
    """Describes a checked call as an AttentionSpec and lowers it (attention_spec.py); where the kernel cannot
    walk the caller's strides, the plan copies Q, K, V and the mask contiguous on each call."""
    grouped = grouped_shapes(q, k, v, mask, gqa)
    # (shape, element strides) of each operand viewed in its grouped shape: splitting a dim is always a view
    q2, k2, v2, m2 = (None if a is None else (shape, reshape_strides(a.shape, array_strides(a), shape)
                                              if a.size else dense_strides(shape))
                      for a, shape in zip((q, k, v, mask), grouped))
    seq_q, seq_kv, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    dt = dtype_of(q.dtype)
    if queue is not None:
        check_sycl_usable({dt}, head_dim, head_dim_v)
    # V's batch dims may broadcast the output beyond the scores, as in PyTorch: the output and stats take
    # them all, and lower() walks Q over them with stride 0.
    batch = broadcast_shapes([q2[0][:-2], k2[0][:-2], v2[0][:-2]], "batch")
    query_shape = batch + (seq_q, head_dim)
    out_grouped, stats_grouped = batch + (seq_q, head_dim_v), batch + (seq_q, 1)
    out_shape = out_grouped[:-4] + (q.shape[-3], seq_q, head_dim_v) if gqa else out_grouped
    mask_kind = "none" if m2 is None else ("select" if mask.dtype == np.bool_ else "additive")
    window = kernel_window(bounds, alignment, seq_q, seq_kv)

    def describe(copied: bool):
        if copied:
            copies = (query_shape, batch + k2[0][-2:], batch + v2[0][-2:],
                      None if m2 is None else batch + (seq_q, seq_kv))
            layouts = [None if shape is None else (shape, dense_strides(shape)) for shape in copies]
        else:
            copies, layouts = None, [q2, k2, v2, m2]
        operands = {role: Operand(dtype_of(a.dtype), tuple(layout[0]), tuple(layout[1]),
                                  None if copied or not gqa else _grouped_origin(a.ndim, tuple(layout[0])))
                    for role, a, layout in zip(("query", "key", "value", "mask"), (q, k, v, mask), layouts)
                    if layout is not None}
        operands["output"] = Operand(dt, out_grouped, dense_strides(out_grouped))
        if return_stats:
            operands["stats"] = Operand(DataType.f32, stats_grouped, dense_strides(stats_grouped))
        for role, a in ({} if mods is None else mods.arrays()).items():
            operands[role] = Operand(DataType.f32, *score_mods.per_head_view(a, q2[0], gqa))
        return AttentionSpec("forward", batch, seq_q, seq_kv, head_dim, head_dim_v, operands, mask_kind=mask_kind,
                             window=window, dropout_p=dropout_p, softcap=0.0 if mods is None else mods.softcap,
                             alibi_bottom_right=alignment == "bottom_right"), copies

    call, copies = lower_as_given_or_copied(describe)
    return _plan_entry(call, grouped, copies, out_shape, numpy_dtype(dt), default_scale(head_dim),
                       queue is None and q.flags.c_contiguous and tuple(q.shape) == out_shape, queue, "new signature")


def _plan_entry(call: KernelCall, grouped, copies, out_shape: tuple, out_dtype, scale: float, out_like_query: bool,
                queue, how: str) -> _ForwardPlan:
    """The cache entry of a lowered call: its kernel plan, bound to the call's window on the host."""
    plan = call.forward_plan(queue)
    left, right = call.options["window_left"], call.options["window_right"]
    runner = None if queue is not None else plan.bound(left, right, _NEG_INF, _NEG_INF).run
    result = _ForwardPlan(call, plan, runner, copies, grouped, out_shape, out_shape[:-1] + (1,), out_dtype, scale,
                          out_like_query, (left, right))
    if verbose.enabled():
        text = f"isa={plan.kernel_name()}" if queue is not None else plan.dispatch_text()
        verbose.log("compile", "functional", "sdpa_forward_sycl" if queue is not None else "sdpa_forward_cpu",
                    f"{text},plan={how}", call.shape_text)
    return result


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 causal_alignment: str = "top_left", return_stats: bool = False,
                                 dropout_seed: int | None = None, dropout_offset: int = 0, window=None,
                                 softcap: float | None = None, alibi_slopes=None, sinks=None, out=None):
    """softmax(Q K^T * scale + mask) V, fused, with PyTorch's arguments.

    query (..., L, E), key (..., S, E), value (..., S, Ev), at least 3 dims;
    batch dims broadcast across query, key, value and attn_mask.  A bool mask
    keeps the positions that are True, a float mask is added; a scalar 0 mask
    means no mask.  is_causal applies the implicit causal mask aligned
    "top_left" (PyTorch) or "bottom_right".  enable_gqa lets key/value have
    fewer heads (dim -3) than query, dividing it; K/V are never repeated.
    window=(left, right) limits the keys each row sees, as flash-attn's
    window_size: key j is visible to row i iff (left < 0 or j >= i' - left)
    and (right < 0 or j <= i' + right), i' the row aligned as causal_alignment
    says; is_causal sets right to 0.  It combines with attn_mask.
    Fully masked rows give 0.  dropout_p > 0 drops probabilities with the
    Philox keep-mask of (dropout_seed, dropout_offset) and scales the kept
    ones by 1 / (1 - dropout_p); the same seed and offset always drop the same
    elements (pass them to the backward too); dropout_seed=None draws a fresh
    seed.  Score modifiers, applied after the scale and before the mask:
    softcap=c caps the scores at c * tanh(s / c); alibi_slopes (f32, (H_q,) or
    (N, H_q)) subtracts slope * |i' - j|, i' aligned as causal_alignment says;
    sinks (f32, (H_q,)) adds exp(sink) to each row's softmax denominator (a
    row that sees no key then gives 0).  Returns an array of query's kind and
    dtype, or (out, stats) with return_stats, stats being the f32 logsumexp
    (..., L, 1) of the scores, the sink included (dropout does not change it).
    out: for NumPy inputs, a writable C-contiguous array of the result's shape
    and dtype, sharing no memory with the inputs, that the result is written
    to and returned as (a loop of equal calls then reuses its memory).
    """
    if out is not None:
        check_out_kind(out, query, "out")
    # torch operands that require grad, and calls torch.compile traces, go through graphattn's torch ops
    if type(query) is not np.ndarray and is_torch_tensor(query):
        if alibi_slopes is not None:
            score_mods.refuse_slopes_grad(alibi_slopes)
        # While torch.compile traces, the ops module is imported, not read from _torch_ops: a guard on that
        # global, None in a fresh process, would fail on the next call and compile the function again.
        torch_ops = _load_torch_ops() if torch_compiling() else _torch_ops or _load_torch_ops()
        if torch_ops.takes(query, key, value, attn_mask, sinks):
            return torch_ops.attention(query, key, value, attn_mask, return_stats, dropout_p, is_causal, scale,
                                       enable_gqa, causal_alignment, dropout_seed, dropout_offset, window, softcap,
                                       alibi_slopes, sinks)
    # torch Q, K, V without a mask go to the kernel as they are (no NumPy views): on decode-sized calls the
    # views cost more than torch's whole call.  New signatures are still checked and built through NumPy.
    mods = score_mods.checked(softcap, alibi_slopes, sinks, query)
    scale = score_mods.call_scale(scale, mods, query, key)
    numpy_in = type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray
    torch_direct = not numpy_in and attn_mask is None and mods is None and plain_torch_tensors(query, key, value)
    layouts = torch_layout(query, key, value) if torch_direct else None
    torch_direct = layouts is not None
    # NumPy arrays (the common case) are no USM arrays: that costs no call
    on_sycl = None if torch_direct or numpy_in and (attn_mask is None or type(attn_mask) is np.ndarray) else \
        _sycl_inputs(query, key, value, attn_mask)
    if on_sycl is not None:
        q, k, v, mask, queue = on_sycl
        kind = "usm"
        mask = _normalize_mask(mask)
    elif torch_direct:
        q, k, v, mask, queue, kind = query, key, value, None, None, "torch"
    else:
        q, kind = to_numpy(query, "query")
        k, _ = to_numpy(key, "key")
        v, _ = to_numpy(value, "value")
        mask = _normalize_mask(None if attn_mask is None else to_numpy(attn_mask, "attn_mask")[0])
        queue = None
    if type(dropout_p) is not float or not 0.0 <= dropout_p < 1.0:  # the common float in range costs no call
        dropout_p = arguments.dropout_probability(dropout_p)
    # The window as (left, right), is_causal included; a plain call costs no function call here.
    bounds = (_NO_LIMIT, 0 if is_causal else _NO_LIMIT) if window is None else \
        key_window.effective_window(window, is_causal)
    # A host call is looked up first without its sequence lengths: the plan made for one length runs every
    # other (_LengthFreePlan), so that a new length costs what a length seen before does.
    flags = (bool(enable_gqa), bounds, causal_alignment, bool(return_stats), dropout_p,
             None if mods is None else mods.signature())
    free = template = None
    if queue is None:
        free = _cpu.signature_key(layouts if torch_direct else (q, k, v, mask), _FREE_AXES, flags, True)
        template = None if free is None else _by_length_free.get(free)
        if template is not None and template is not _NOT_REPLAYED:
            seed, offset = (0, 0) if dropout_p == 0.0 else _dropout_bits(dropout_p, dropout_seed, dropout_offset, kind)
            result = template.run(q, k, v, mask, out, layouts, scale, seed, offset, mods, kind)
            if result is not None:
                return result
    # Else by the whole signature; one seen before was validated when it was planned: only new ones are checked.
    if torch_direct:
        signature = (layouts,) + flags
    else:  # NumPy arrays key on bytes (_cpu.signature_key), anything else on a tuple
        signature = None if queue is not None else _cpu.signature_key((q, k, v, mask), (), flags)
        if signature is None:
            signature = (_layout(q), _layout(k), _layout(v), _layout(mask) if mask is not None else None,
                         queue) + flags
    entry = _cache.get(signature)
    if entry is None:
        entry = _new_plan(q, k, v, mask, torch_direct, is_causal, enable_gqa, bounds, causal_alignment,
                          return_stats, dropout_p, queue, kind, mods)
        if template is None and free is not None and entry is not _RUNS_ON_HOST:
            # the first plan of its class of lengths: the template of the others, where it copies nothing
            _by_length_free.put(free, _LengthFreePlan(entry, bounds, causal_alignment) if entry.copies is None
                                else _NOT_REPLAYED)
        _cache.put(signature, entry)
    if entry is _RUNS_ON_HOST:
        host = [None if a is None else sycl_runtime.to_host(a) for a in (q, k, v, mask)]
        result = scaled_dot_product_attention(*host, dropout_p, is_causal, scale, enable_gqa,
                                              causal_alignment=causal_alignment, return_stats=return_stats,
                                              dropout_seed=dropout_seed, dropout_offset=dropout_offset, window=window,
                                              softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        results = result if return_stats else (result,)
        results = tuple(sycl_runtime.to_device(r, queue) for r in results)
        return results if return_stats else results[0]

    scale_value = entry.default_scale if scale is None else arguments.scale_value(scale)
    seed, offset = _dropout_bits(dropout_p, dropout_seed, dropout_offset, kind)
    if entry.copies is not None:  # strides the kernel cannot walk: contiguous copies (see _build)
        if torch_direct:
            q, k, v = (to_numpy(x, name)[0] for x, name in ((q, "query"), (k, "key"), (v, "value")))
            torch_direct = False
        if queue is None:
            xp = np
        else:
            import dpnp as xp
        q, k, v, mask = (None if a is None else xp.ascontiguousarray(xp.broadcast_to(xp.reshape(a, grouped), full))
                         for a, grouped, full in zip((q, k, v, mask), entry.grouped, entry.copies))
    if torch_direct:
        # empty_like where the output is laid out as Q: cheaper than from the shape and dtype
        out = torch_empty_like(q) if entry.out_like_query else torch_empty(entry.out_shape, entry.out_dtype)
        stats = torch_empty(entry.stats_shape, np.float32) if return_stats else None
    else:
        out = _empty_like_kind(q, entry.out_shape, entry.out_dtype, queue) if out is None else \
            checked_out(out, entry.out_shape, entry.out_dtype, {"query": q, "key": k, "value": v, "attn_mask": mask},
                        "out")
        stats = _empty_like_kind(q, entry.stats_shape, np.float32, queue) if return_stats else None
    if verbose.enabled():
        _run_logged(entry, q, k, v, out, mask, stats, scale_value, seed, offset, queue, mods)
    elif entry.runner is not None:
        # The signature pins every layout this plan was made for: the kernel is called directly.
        if mods is None:
            entry.runner(q, k, v, out, mask, stats, scale_value, seed, offset)
        else:
            entry.runner(q, k, v, out, mask, stats, scale_value, seed, offset, mods.alibi_slopes, mods.sinks)
    else:
        _run_sycl(entry, q, k, v, out, mask, stats, scale_value, seed, offset, queue, mods)
    return _results(out, stats, torch_direct, kind)


def _dropout_bits(dropout_p: float, dropout_seed, dropout_offset, kind: str) -> tuple[int, int]:
    """(seed, offset) of a call's dropout, (0, 0) without dropout; dropout_seed None draws a fresh seed, from
    torch's generator for torch callers (so that torch.manual_seed repeats it)."""
    if dropout_p == 0.0:
        return 0, 0
    if dropout_seed is None:
        seed = torch_random_seed() if kind == "torch" else new_dropout_seed()
    else:
        seed = _s64(dropout_seed, "dropout_seed")
    return seed, _s64(dropout_offset, "dropout_offset")


def _run_sycl(entry: _ForwardPlan, q, k, v, out, mask, stats, scale, seed, offset, queue, mods=None) -> None:
    """The SYCL kernel on USM arrays (the modifiers' host arrays copied to the queue); their results are ready on
    return (dpnp does not know the kernel's event)."""
    per_head = {} if mods is None else mods.arrays(queue)
    arrays = [q, k, v, out, mask, stats, per_head.get("alibi_slopes"), per_head.get("sinks")]
    sycl_runtime.wait_for_producers([a for a in arrays if a is not None])
    address = [0 if a is None else sycl_runtime.usm_address(a) for a in arrays]
    extents = [None if a is None else sycl_runtime.usm_layout(a) for a in arrays]
    left, right = entry.window
    entry.plan.run(*address[:6], scale, left, right, _NEG_INF, _NEG_INF, bits64(seed), bits64(offset),
                   extents=extents, alibi_slopes=address[6], sinks=address[7])
    queue.wait()


def _run_logged(entry: _ForwardPlan, q, k, v, out, mask, stats, scale, seed, offset, queue, mods=None) -> None:
    """A kernel call with its verbose exec line: the kernel, the call's shape and its time."""
    start = time.perf_counter()
    if entry.runner is not None:
        per_head = () if mods is None else (mods.alibi_slopes, mods.sinks)
        entry.runner(q, k, v, out, mask, stats, scale, seed, offset, *per_head)
    else:
        _run_sycl(entry, q, k, v, out, mask, stats, scale, seed, offset, queue, mods)
    verbose.log("exec", "functional", "sdpa_forward_cpu" if queue is None else "sdpa_forward_sycl",
                entry.call.shape_text, f"{(time.perf_counter() - start) * 1e3:.4f}ms")


_torch_ops = None  # graphattn.torch_autograd, once a torch call has been seen (it imports torch)


def _load_torch_ops():
    """graphattn.torch_autograd, imported once: an import statement on every torch call would cost a tiny call
    more than its checks."""
    global _torch_ops
    from . import torch_autograd

    _torch_ops = torch_autograd
    return _torch_ops


def check_out_kind(out, query, name: str) -> None:
    """An output array given to write into must be a NumPy array, for NumPy inputs (torch and USM calls make
    their own results)."""
    if type(out) is not np.ndarray:
        raise TypeError(f"{name} must be a NumPy array, got {type(out).__name__}")
    if not isinstance(query, np.ndarray):
        raise TypeError(f"{name} takes NumPy inputs; a call on {type(query).__name__} returns new arrays")


def checked_out(out: np.ndarray, shape: tuple, dtype, inputs: dict, name: str) -> np.ndarray:
    """out as the kernel writes it: of the result's shape and dtype, writable and C-contiguous (the kernel
    writes it densely), sharing no memory with any of inputs (name -> array or None), which it reads meanwhile."""
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"{name} must have the result's shape {tuple(shape)} and dtype {np.dtype(dtype)}, got "
                         f"{out.shape} {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be a writable C-contiguous array: the kernel writes it densely")
    shared = _cpu.first_shared_memory(tuple(inputs.values()) + (out,), len(inputs))
    if shared is not None:
        raise ValueError(f"{name} shares memory with {list(inputs)[shared[1]]}, which the kernel reads while it "
                         f"writes {name}")
    return out


def _s64(value, name: str) -> int:
    value = arguments.integer(value, name)
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value


def _results(out, stats, torch_direct: bool, kind: str):
    """out, or (out, stats), as the caller's array kind."""
    if stats is None:
        return out if torch_direct else from_numpy(out, kind)
    return (out, stats) if torch_direct else (from_numpy(out, kind), from_numpy(stats, kind))
