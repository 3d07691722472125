"""The functional forward's kernel route: scaled_dot_product_attention's work once torch autograd is out of
the way (functional.py routes such calls to torch_autograd, which comes back here with detached tensors).

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
from .interop import (from_numpy, plain_torch_tensors, to_numpy, torch_empty, torch_empty_like,
                      torch_layout, torch_random_seed)
from .plan_cache import SignatureCache
from .tensor import array_strides

from .call_prep import (check_inputs, checked_out, grouped_origin, grouped_shapes,
                        layout_key, mask_fits, new_dropout_seed, normalize_mask, s64, sycl_inputs)

_NEG_INF = float("-inf")
_RUNS_ON_HOST = object()  # the cache's entry for USM calls the SYCL kernels cannot take
_NOT_REPLAYED = object()  # the length-free cache's entry for a class of calls planned per length (copies)
_cache = SignatureCache()  # compiled partitions of the forward
_by_length_free = SignatureCache()  # _LengthFreePlan by signature with the sequence lengths left out
# the sequence lengths in signature_key: dim -2 of Q, K and V, both of the mask's
_FREE_AXES = (0, 0b10) * 3 + (0, 0b11)

_NO_LIMIT = key_window.NO_LIMIT
# The dtypes of query, key and value the kernels take.


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

    def __init__(self, entry: _ForwardPlan):
        self.entry = entry
        self.out_head = entry.out_shape[:-2]
        self.head_dim_v = entry.out_shape[-1]
        self.out_dtype, self.default_scale = entry.out_dtype, entry.default_scale
        # the dense output's batch strides over seq_q * head_dim_v: the products of the inner batch dims
        call = entry.call
        self.replay = entry.plan.length_free(call.sources, call.folds, dense_strides(call.call_batch + (1,))[:-1])
        self.window = entry.window  # about the aligned row: the kernel aligns it at each call's lengths
        self.stats = "stats" in call.roles  # the plan returns the stats
        self.replay.set_results(self.out_head, self.out_dtype, self.stats)

    def run(self, q, k, v, mask, out, layouts, scale, seed: int, offset: int, mods, kind: str):
        """The call's results (as scaled_dot_product_attention returns them), or None where the template's
        lowering does not hold for it (nothing is written).  q, k, v, mask: NumPy arrays, or with layouts
        (interop.torch_layout's of Q, K and V) torch tensors and no mask; out: the caller's output array or
        None; seed and offset: the dropout's (_dropout_bits)."""
        if out is None and not verbose.enabled():  # all of it in one native call
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
            if v.shape[-2] != seq_kv or mask is not None and not mask_fits(mask.shape, q_shape[-2], seq_kv):
                return None  # the call breaks a length rule: the full checks name it
        else:
            (q_shape, q_strides, _, _), (k_shape, k_strides, _, _), (v_shape, v_strides, _, _) = layouts
            seq_kv, strides = k_shape[-2], (q_strides, k_strides, v_strides, None)
            if v_shape[-2] != seq_kv:
                return None
        seq_q = q_shape[-2]
        left, right = self.window
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


def _empty_like_kind(template, shape, dtype, queue):
    """An output array: NumPy on the CPU, else the USM kind of template (dpnp array or usm_ndarray)."""
    if queue is None:
        return np.empty(shape, dtype)
    if type(template).__module__.startswith("dpnp.tensor"):
        import dpnp.tensor as dpt

        return dpt.empty(shape, dtype=dtype, sycl_queue=queue)
    import dpnp

    return dpnp.empty(shape, dtype=dtype, sycl_queue=queue)


def _new_plan(q, k, v, mask, torch_direct, is_causal, enable_gqa, bounds, alignment, return_stats, dropout_p,
              queue, kind, mods=None):
    """The plan of a new signature: checked and built on NumPy views (the same memory); a torch tensor off the
    CPU is refused here."""
    qc, kc, vc = (to_numpy(x, name)[0] for x, name in ((q, "query"), (k, "key"), (v, "value"))) \
        if torch_direct else (q, k, v)
    gqa = check_inputs(qc, kc, vc, mask, is_causal, enable_gqa, alignment, kind)
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
    window = kernel_window(bounds)

    def describe(copied: bool):
        if copied:
            copies = (query_shape, batch + k2[0][-2:], batch + v2[0][-2:],
                      None if m2 is None else batch + (seq_q, seq_kv))
            layouts = [None if shape is None else (shape, dense_strides(shape)) for shape in copies]
        else:
            copies, layouts = None, [q2, k2, v2, m2]
        operands = {role: Operand(dtype_of(a.dtype), tuple(layout[0]), tuple(layout[1]),
                                  None if copied or not gqa else grouped_origin(a.ndim, tuple(layout[0])))
                    for role, a, layout in zip(("query", "key", "value", "mask"), (q, k, v, mask), layouts)
                    if layout is not None}
        operands["output"] = Operand(dt, out_grouped, dense_strides(out_grouped))
        if return_stats:
            operands["stats"] = Operand(DataType.f32, stats_grouped, dense_strides(stats_grouped))
        for role, a in ({} if mods is None else mods.arrays()).items():
            operands[role] = Operand(DataType.f32, *score_mods.per_head_view(a, q2[0], gqa))
        return AttentionSpec("forward", batch, seq_q, seq_kv, head_dim, head_dim_v, operands, mask_kind=mask_kind,
                             window=window, dropout_p=dropout_p, softcap=0.0 if mods is None else mods.softcap,
                             alignment=alignment), copies

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


def attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment, return_stats,
              dropout_seed, dropout_offset, window, softcap, alibi_slopes, sinks, out):
    """functional.scaled_dot_product_attention's call (its arguments in its order) for NumPy arrays, USM arrays
    and torch tensors that need no autograd: checked, planned or replayed, and run."""
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
        sycl_inputs(query, key, value, attn_mask)
    if on_sycl is not None:
        q, k, v, mask, queue = on_sycl
        kind = "usm"
        mask = normalize_mask(mask)
    elif torch_direct:
        q, k, v, mask, queue, kind = query, key, value, None, None, "torch"
    else:
        q, kind = to_numpy(query, "query")
        k, _ = to_numpy(key, "key")
        v, _ = to_numpy(value, "value")
        mask = normalize_mask(None if attn_mask is None else to_numpy(attn_mask, "attn_mask")[0])
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
            signature = (layout_key(q), layout_key(k), layout_key(v), layout_key(mask) if mask is not None else None,
                         queue) + flags
    entry = _cache.get(signature)
    if entry is None:
        entry = _new_plan(q, k, v, mask, torch_direct, is_causal, enable_gqa, bounds, causal_alignment,
                          return_stats, dropout_p, queue, kind, mods)
        if template is None and free is not None and entry is not _RUNS_ON_HOST:
            # the first plan of its class of lengths: the template of the others, where it copies nothing
            _by_length_free.put(free, _LengthFreePlan(entry) if entry.copies is None
                                else _NOT_REPLAYED)
        _cache.put(signature, entry)
    if entry is _RUNS_ON_HOST:
        host = [None if a is None else sycl_runtime.to_host(a) for a in (q, k, v, mask)]
        result = attention(*host, dropout_p, is_causal, scale, enable_gqa, causal_alignment, return_stats,
                           dropout_seed, dropout_offset, window, softcap, alibi_slopes, sinks, None)
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
        seed = s64(dropout_seed, "dropout_seed")
    return seed, s64(dropout_offset, "dropout_offset")


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


def _results(out, stats, torch_direct: bool, kind: str):
    """out, or (out, stats), as the caller's array kind."""
    if stats is None:
        return out if torch_direct else from_numpy(out, kind)
    return (out, stats) if torch_direct else (from_numpy(out, kind), from_numpy(stats, kind))
