"""The one-call backward: scaled_dot_product_attention_backward, the gradients of
scaled_dot_product_attention with the same arguments and broadcasting rules.

It recomputes the attention probabilities from the forward's stats (the f32
log-sum-exp that scaled_dot_product_attention(..., return_stats=True) returns),
so nothing of size L x S is stored between the passes.  The heads of a GQA
group reduce into dK/dV inside the kernel; only operands broadcast in other
ways (5D batch broadcasting) are summed here after the kernel.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from . import _cpu
from .dtypes import DataType, from_numpy as dtype_of
from . import arguments, key_window, score_mods, sycl_runtime, verbose
from .call_prep import (check_inputs, check_out_kind, checked_out, grouped_origin, grouped_shapes,
                        layout_key, mask_fits, normalize_mask, s64, sycl_inputs)
from .plan_cache import SignatureCache
from .tensor import array_strides
from .attention_spec import AttentionSpec, KernelCall, Operand, default_scale, kernel_window, lower_as_given_or_copied
from .interop import from_numpy, plain_torch_tensors, to_numpy, torch_empty, torch_layout
from .logical_tensor import dense_strides
from .ops.broadcast import broadcast_shapes
from .ops.philox import bits64

def _reduce_to(full: np.ndarray, shape: tuple) -> np.ndarray:
    """Sums a gradient of broadcast shape back to the operand's own shape (f32 accumulation)."""
    lead = full.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and full.shape[lead + i] != 1)
    if not axes:
        return full.reshape(shape)
    return full.astype(np.float32).sum(axis=axes, keepdims=True).reshape(shape)


@dataclass
class _BackwardPlan:
    """What one signature (layouts, dtypes and flags of the operands) fixes of a backward call: the checks
    passed, the lowered kernel call, and the shapes of the copies and gradient buffers."""
    call: KernelCall          # the kernel's batch, lengths, per-role strides, flags and window
    query_copy: tuple | None  # full shape Q is copied to when broadcast in a way the kernel does not reduce
    kv_copy: tuple | None     # full shapes of K and V when they are broadcast differently
    mask_copy: tuple | None   # full shape of the mask where the batch dims do not fold into the kernel's 3
    dense: bool               # out, grad_out and stats copied contiguous (the same case)
    grouped: tuple            # Q, K, V and mask shapes with the GQA heads split ((..., Hkv, rep, rows, cols))
    grad_shapes: tuple        # dQ, dK, dV buffers the kernel writes
    grad_mask_shape: tuple | None
    default_scale: float
    operand_shapes: tuple     # shapes of Q, K, V (and of their gradients)
    grad_dtypes: tuple        # NumPy dtypes of dQ, dK, dV
    kernel: object = None     # the host kernel's plan (_cpu.BackwardPlan), None on SYCL
    lengths: tuple | None = None  # (seq_q, seq_kv, left, right) of a plan re-made for new lengths: call is the
                                  # template's

    @property
    def shape_text(self) -> str:
        """The call's shape for the verbose log."""
        return self.call.shape_text if self.lengths is None else self.call.shape_text_for(*self.lengths)

    @property
    def direct(self) -> bool:
        """Whether the kernel's gradient buffers are the gradients themselves (no copied operand to sum back)
        and it has work: then torch tensors can go to it as they are."""
        return self.query_copy is None and self.kv_copy is None and not self.dense and self.has_scores

    @property
    def has_scores(self) -> bool:
        """Whether any score exists (no empty batch dim or sequence): else every gradient is zero and the kernel,
        which takes no empty views, is not called."""
        seq_q, seq_kv = (self.call.seq_q, self.call.seq_kv) if self.lengths is None else self.lengths[:2]
        return seq_q > 0 and seq_kv > 0 and 0 not in self.call.batch


_GRADS_OUT_NAMES = ("grads_out[0] (dq)", "grads_out[1] (dk)", "grads_out[2] (dv)")
_plans = SignatureCache()
_by_length_free = SignatureCache()  # _LengthFreeBackward by signature with the sequence lengths left out
# the sequence lengths in signature_key: dim -2 of Q, K, V, O, dO and the stats, both of the mask's
_FREE_AXES = (0, 0b10) * 6 + (0, 0b11)


def _lengths_agree(shapes: tuple, mask) -> bool:
    """Whether the shapes of Q, K, V, O, dO and the stats, and the mask (or None), keep the length rules a
    replay re-checks (the others held for its template): V as long as K, O, dO and the stats as Q, the mask
    broadcasting to the scores."""
    q_shape, k_shape, v_shape, o_shape, do_shape, st_shape = shapes
    seq_q, seq_kv = q_shape[-2], k_shape[-2]
    return v_shape[-2] == seq_kv and o_shape[-2] == seq_q and do_shape[-2] == seq_q and st_shape[-2] == seq_q and \
        mask_fits(None if mask is None else mask.shape, seq_q, seq_kv)


class _LengthFreeBackward:
    """A direct host backward plan (no copies) that calls differing from it only in sequence lengths re-make for
    theirs: native/cpu replays its lowering (_cpu.LengthFreeBackward), each kernel stride the lowering's
    multiple of one of their arrays' strides, where the batch dims it folded still fold; the checks passed
    with the template's."""

    def __init__(self, plan: _BackwardPlan):
        self.plan = plan
        call = plan.call
        # the dense gradients' batch strides over rows * cols (dMask's where the call has it)
        dense = plan.grad_shapes + (() if plan.grad_mask_shape is None else (plan.grad_mask_shape,))
        grad_steps = tuple(dense_strides(shape[:-2] + (1,))[:-1] for shape in dense)
        self.replay = plan.kernel.length_free(call.sources, call.folds, grad_steps)
        # about the aligned row: the kernel aligns it at each call's lengths
        self.window = (call.options["window_left"], call.options["window_right"])

    def run(self, q, k, v, o, do, st, mask, layouts, scale, dropout_seed, dropout_offset, mods, sinks_grad: bool):
        """The gradients (dq, dk, dv, then d(sinks) where sinks_grad) of a call at its own lengths through the
        template's lowering, or None where it does not hold for the call (nothing is written): NumPy arrays, or
        torch tensors with layouts (interop.torch_layout's of Q, K, V, O, dO and the stats; no mask, no
        modifiers).  The gradients are new arrays of the operands' shapes, dense: a direct plan's own buffers."""
        if layouts is None:
            shapes, strides = (q.shape, k.shape, v.shape, o.shape, do.shape, st.shape), (q, k, v, o, st, do)
        else:
            shapes = tuple([layout[0] for layout in layouts])
            strides = (layouts[0][1], layouts[1][1], layouts[2][1], layouts[3][1], layouts[5][1], layouts[4][1])
        if not _lengths_agree(shapes, mask):
            return None  # a length rule broken: the full checks name it
        q_shape, k_shape, v_shape = shapes[:3]
        seq_q, seq_kv = q_shape[-2], k_shape[-2]
        left, right = self.window
        kernel = self.replay.plan_for(seq_q, seq_kv, *strides, left, right, None, mask)
        if kernel is None:
            return None
        plan = self.plan
        empty = np.empty if layouts is None else torch_empty
        dq, dk, dv = (empty(shape, dtype) for shape, dtype in zip((q_shape, k_shape, v_shape), plan.grad_dtypes))
        arrays = {"query": q, "key": k, "value": v, "output": o, "stats": st, "grad_output": do, "grad_query": dq,
                  "grad_key": dk, "grad_value": dv, "mask": mask}
        grads = (dq, dk, dv)
        if mods is not None:
            arrays.update(mods.arrays())
            if sinks_grad:
                arrays["grad_sinks"] = grad_sinks = np.empty(mods.sinks.shape, np.float32)
                grads += (grad_sinks,)
        if verbose.enabled():
            verbose.log("compile", "functional_backward", "sdpa_backward_cpu",
                        f"{kernel.dispatch_text()},plan=replayed", plan.call.shape_text_for(seq_q, seq_kv, left, right))
        _run_kernel(plan, arrays, scale, dropout_seed, dropout_offset, kernel=kernel,
                    lengths=(seq_q, seq_kv, left, right))
        return grads

    def remade(self, q, k, v, o, do, st, mask) -> _BackwardPlan | None:
        plan = self.plan
        if not _lengths_agree((q.shape, k.shape, v.shape, o.shape, do.shape, st.shape), mask):
            return None  # a length rule broken: the full checks name it
        seq_q, seq_kv = q.shape[-2], k.shape[-2]
        left, right = self.window
        kernel = self.replay.plan_for(seq_q, seq_kv, q, k, v, o, st, do, left, right, None, mask)
        if kernel is None:
            return None
        (gq, gk, gv, gm), (dq, dk, dv), dm = plan.grouped, plan.grad_shapes, plan.grad_mask_shape
        # built field by field: cheaper than dataclasses.replace's walk over every field
        return _BackwardPlan(
            call=plan.call, query_copy=None, kv_copy=None, mask_copy=None, dense=False,
            grouped=(gq[:-2] + (seq_q, gq[-1]), gk[:-2] + (seq_kv, gk[-1]), gv[:-2] + (seq_kv, gv[-1]),
                     None if gm is None else gm[:-2] + mask.shape[-2:]),
            grad_shapes=(dq[:-2] + (seq_q, dq[-1]), dk[:-2] + (seq_kv, dk[-1]), dv[:-2] + (seq_kv, dv[-1])),
            grad_mask_shape=None if dm is None else dm[:-2] + (seq_q, seq_kv), default_scale=plan.default_scale,
            operand_shapes=(q.shape, k.shape, v.shape), grad_dtypes=plan.grad_dtypes, kernel=kernel,
            lengths=(seq_q, seq_kv, left, right))


def _plan(q, k, v, o, do, st, mask, dropout_p, is_causal, enable_gqa, causal_alignment, return_mask_grad,
          bounds, kind="numpy", mods=None, return_sinks_grad=False):
    """Checks a new signature and derives its _BackwardPlan (the arrays' data are not read)."""
    gqa = check_inputs(q, k, v, mask, is_causal, enable_gqa, causal_alignment, kind)
    for name, a in (("out", o), ("grad_out", do), ("stats", st)):
        if isinstance(a, np.ndarray):
            arguments.check_host_array(a, name)
    hq = q.shape[-3]
    lead = [q.shape[:-3], k.shape[:-3], v.shape[:-3]] if gqa else [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    out_shape = broadcast_shapes(lead, "batch") + ((hq,) if gqa else ()) + (q.shape[-2], v.shape[-1])
    for name, a in (("out", o), ("grad_out", do)):
        if tuple(a.shape) != out_shape:
            raise ValueError(f"{name} must have the forward output's shape {out_shape}, got {a.shape}")
        if a.dtype != q.dtype:
            raise TypeError(f"{name} dtype {a.dtype} differs from query's {q.dtype}")
    if tuple(st.shape) != out_shape[:-1] + (1,) or st.dtype != np.float32:
        raise ValueError(f"stats must be float32 of shape {out_shape[:-1] + (1,)} (the forward's return_stats), "
                         f"got {st.dtype} {st.shape}")

    grouped = grouped_shapes(q, k, v, mask, gqa)
    q2, k2, v2 = (a.reshape(shape) for a, shape in zip((q, k, v), grouped))
    o2, do2, st2 = (a.reshape(a.shape[:-3] + grouped[0][-4:-2] + a.shape[-2:]) if gqa else a for a in (o, do, st))
    m2 = None if mask is None else mask.reshape(grouped[3])
    shapes = [a.shape[:-2] for a in (q2, k2, v2, o2, do2, st2) + ((m2,) if m2 is not None else ())]
    batch = broadcast_shapes(shapes, "batch")

    def is_broadcast(a) -> list[bool]:
        padded = (1,) * (len(batch) - (a.ndim - 2)) + a.shape[:-2]
        return [p == 1 and b > 1 for p, b in zip(padded, batch)]

    # The kernel reduces dK/dV over dims where K and V are both broadcast; any
    # other broadcast operand is given to it in full and its gradient summed after.
    # Where the operands' batch dims do not fold into the kernel's three
    # (unmergeable broadcasts and strides), every operand goes in full and
    # contiguous, which always folds into one.
    def fresh(shape, dtype):  # (shape, element strides, dtype) of a fresh C-contiguous array
        return shape, dense_strides(shape), dtype

    def given(a, dtype, dense):  # a caller's array as it is, or its contiguous copy
        return fresh(a.shape, dtype) if dense else (a.shape, array_strides(a), dtype)

    def stride_0(a) -> bool:  # a caller's broadcast view (stride 0 over a batch dim of 2 or more)
        return any(s == 0 and d > 1 for d, s in zip(a.shape[:-2], array_strides(a)[:-2]))

    # A caller's stride-0 view of Q, K or V has a gradient element per index, as any other tensor of its shape
    # does (torch's gradient of an expand()ed tensor): it is copied, like a broadcast operand, so the kernel
    # does not sum over its stride-0 dims.
    def describe(dense: bool):
        query_copy = batch + tuple(q2.shape[-2:]) if dense or any(is_broadcast(q2)) or stride_0(q2) else None
        kv_alike = is_broadcast(k2) == is_broadcast(v2) and not stride_0(k2) and not stride_0(v2)
        kv_copy = None if kv_alike and not dense else (batch + tuple(k2.shape[-2:]), batch + tuple(v2.shape[-2:]))
        mask_copy = batch + (q.shape[-2], k.shape[-2]) if dense and m2 is not None else None
        grad_shapes = (batch + tuple(q2.shape[-2:]), kv_copy[0] if kv_copy else tuple(k2.shape),
                       kv_copy[1] if kv_copy else tuple(v2.shape))
        grad_mask_shape = None
        if return_mask_grad and m2 is not None and m2.dtype != np.bool_:
            grad_mask_shape = batch + (q.shape[-2], k.shape[-2])

        # (shape, element strides, dtype) per kernel operand; copies and gradient buffers are fresh
        # C-contiguous arrays on every call.
        layouts = {"query": fresh(query_copy, q.dtype) if query_copy else (q2.shape, array_strides(q2), q.dtype),
                   "key": fresh(kv_copy[0], k.dtype) if kv_copy else (k2.shape, array_strides(k2), k.dtype),
                   "value": fresh(kv_copy[1], v.dtype) if kv_copy else (v2.shape, array_strides(v2), v.dtype),
                   "output": given(o2, o.dtype, dense), "stats": given(st2, st.dtype, dense),
                   "grad_output": given(do2, do.dtype, dense),
                   "grad_query": fresh(grad_shapes[0], q.dtype), "grad_key": fresh(grad_shapes[1], k.dtype),
                   "grad_value": fresh(grad_shapes[2], v.dtype)}
        if m2 is not None:
            layouts["mask"] = fresh(mask_copy, m2.dtype) if mask_copy else (m2.shape, array_strides(m2), m2.dtype)
        mask_kind = "none" if m2 is None else ("select" if m2.dtype == np.bool_ else "additive")
        if grad_mask_shape is not None:
            layouts["grad_mask"] = fresh(grad_mask_shape, np.dtype(np.float32))
        # Under GQA, the caller's arrays given as they are are viewed with their heads split: each stride's
        # origin is one of the array's own (a new length's replay reads them there).
        given_arrays = {"query": (q, query_copy), "key": (k, kv_copy), "value": (v, kv_copy), "output": (o, dense),
                        "stats": (st, dense), "grad_output": (do, dense), "mask": (mask, mask_copy)} if gqa else {}
        operands = {name: Operand(dtype_of(dtype), tuple(shape), tuple(strides),
                                  grouped_origin(given_arrays[name][0].ndim, tuple(shape))
                                  if name in given_arrays and not given_arrays[name][1] else None)
                    for name, (shape, strides, dtype) in layouts.items()}
        per_head = {} if mods is None else dict(mods.arrays())
        if return_sinks_grad:  # a fresh f32 array of the sinks' shape, viewed as they are
            per_head["grad_sinks"] = mods.sinks
        for role, a in per_head.items():
            operands[role] = Operand(DataType.f32, *score_mods.per_head_view(a, q2.shape, gqa))
        return AttentionSpec("backward", batch, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], operands,
                             mask_kind=mask_kind, window=kernel_window(bounds),
                             dropout_p=dropout_p, softcap=0.0 if mods is None else mods.softcap,
                             alignment=causal_alignment), (query_copy, kv_copy, mask_copy, dense, grad_shapes,
                                                    grad_mask_shape)

    call, choice = lower_as_given_or_copied(describe)
    query_copy, kv_copy, mask_copy, dense, grad_shapes, grad_mask_shape = choice
    return _BackwardPlan(
        call, query_copy, kv_copy, mask_copy, dense,
        (q2.shape, k2.shape, v2.shape, None if m2 is None else m2.shape), grad_shapes, grad_mask_shape,
        default_scale(q.shape[-1]), (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
        None if kind == "usm" else call.backward_plan())


def _log_plan(plan: _BackwardPlan, queue) -> None:
    """The verbose compile line of a new backward signature: the kernel, the rule that chose its build and its
    work layout, the shape."""
    if queue is not None:
        verbose.log("compile", "functional_backward", "sdpa_backward_sycl", "isa=subgroup", plan.call.shape_text)
        return
    how = "new lengths" if plan.lengths is not None else "new signature"
    verbose.log("compile", "functional_backward", "sdpa_backward_cpu", f"{plan.kernel.dispatch_text()},plan={how}",
                plan.shape_text)


def _run_kernel(plan: _BackwardPlan, arrays: dict, scale, dropout_seed, dropout_offset, sycl_run=None, kernel=None,
                lengths=None) -> None:
    """One kernel call on the plan's views of `arrays`: NumPy arrays or torch CPU tensors for the host kernel
    (plan's, or kernel, its replay at lengths (seq_q, seq_kv, left, right)), USM addresses for sycl_run (the
    SYCL plugin's backward)."""
    scale_value = plan.default_scale if scale is None else arguments.scale_value(scale)
    seed, offset = bits64(s64(dropout_seed or 0, "dropout_seed")), bits64(s64(dropout_offset, "dropout_offset"))
    start = time.perf_counter() if verbose.enabled() else None
    if sycl_run is None:
        (plan.kernel if kernel is None else kernel).run(arrays, scale_value, seed, offset)
    else:
        specs = {name: (code, strides, arrays[name]) for name, (code, strides) in plan.call.roles.items()}
        plan.call.run_backward(sycl_run, specs, scale=scale_value, dropout_seed=seed, dropout_offset=offset)
    if start is not None:
        verbose.log("exec", "functional_backward", "sdpa_backward_cpu" if sycl_run is None else "sdpa_backward_sycl",
                    plan.shape_text if lengths is None else plan.call.shape_text_for(*lengths),
                    f"{(time.perf_counter() - start) * 1e3:.4f}ms")


def scaled_dot_product_attention_backward(grad_out, query, key, value, out, stats, attn_mask=None,
                                          dropout_p: float = 0.0, is_causal: bool = False,
                                          scale: float | None = None, enable_gqa: bool = False, *,
                                          causal_alignment: str = "top_left", dropout_seed: int | None = None,
                                          dropout_offset: int = 0, return_mask_grad: bool = False, window=None,
                                          softcap: float | None = None, alibi_slopes=None, sinks=None,
                                          return_sinks_grad: bool = False, grads_out=None):
    """Gradients (dq, dk, dv) of scaled_dot_product_attention, fused.

    grad_out and out have the forward output's shape (..., L, Ev); stats is
    the forward's f32 log-sum-exp (..., L, 1) (return_stats=True).  The other
    arguments are the forward's.  dk and dv have key's and value's own shapes
    (Hkv heads under enable_gqa).  return_mask_grad=True appends the gradient
    of a float attn_mask, of the mask's shape (None for a bool mask).
    With dropout, pass the forward's dropout_p, dropout_seed and
    dropout_offset: the kernel regenerates the same keep-mask.  softcap,
    alibi_slopes and sinks are the forward's (stats include the sink);
    return_sinks_grad=True appends the f32 gradient of sinks, of its shape.
    grads_out: for NumPy inputs, (dq, dk, dv) arrays to write the three
    gradients to and return, each writable, C-contiguous, of its operand's
    shape and dtype and sharing no memory with an input or another.
    """
    if grads_out is not None:
        if not isinstance(grads_out, (tuple, list)) or len(grads_out) != 3:
            raise TypeError(f"grads_out must be a tuple of three arrays (dq, dk, dv), got "
                            f"{type(grads_out).__name__}")
        for name, a in zip(_GRADS_OUT_NAMES, grads_out):
            check_out_kind(a, query, name)
    dropout_p = arguments.dropout_probability(dropout_p)
    mods = score_mods.checked(softcap, alibi_slopes, sinks, query)
    scale = score_mods.call_scale(scale, mods, query, key)
    if return_sinks_grad and sinks is None:
        raise ValueError("return_sinks_grad=True needs sinks")
    bounds = key_window.effective_window(window, is_causal)
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs the forward's dropout_seed (and dropout_offset) to rebuild its mask")
    # torch tensors without a mask go to the kernel as they are once their signature has a plan, as in the
    # forward: the NumPy views of six operands and wraps of three gradients cost a small call more than its
    # kernel.  A new signature is checked and planned through NumPy first.
    tensors = (grad_out, query, key, value, out, stats)
    torch_signature = torch_free = None
    flags = (bool(enable_gqa), bounds, causal_alignment, dropout_p, bool(return_mask_grad),
             None if mods is None else mods.signature(), bool(return_sinks_grad))
    # A direct plan made for one length runs every other of its class (_LengthFreeBackward.run): looked up
    # first, without the lengths, for calls whose gradients are new arrays of the operands' shapes.
    replayable = grads_out is None and not (return_mask_grad and attn_mask is not None)
    layouts = torch_layout(*tensors) if attn_mask is None and mods is None and plain_torch_tensors(*tensors) \
        else None
    if layouts is not None:
        ordered = (layouts[1], layouts[2], layouts[3], layouts[4], layouts[0], layouts[5])  # Q, K, V, O, dO, stats
        torch_free = _cpu.signature_key(ordered, _FREE_AXES, flags, True)
        template = None if torch_free is None or not replayable else _by_length_free.get(torch_free)
        if template is not None:
            grads = template.run(query, key, value, out, grad_out, stats, None, ordered, scale, dropout_seed,
                                 dropout_offset, None, False)
            if grads is not None:
                return grads + (None,) if return_mask_grad else grads
        torch_signature = (layouts, bool(enable_gqa), bounds, causal_alignment, dropout_p,
                           bool(return_mask_grad))
        plan = _plans.get(torch_signature)
        if plan is not None:  # direct: the kernel's contiguous gradient buffers have the operands' own shapes
            grads = tuple(torch_empty(shape, dtype) for shape, dtype in zip(plan.operand_shapes, plan.grad_dtypes))
            arrays = {"query": query, "key": key, "value": value, "output": out, "stats": stats,
                      "grad_output": grad_out, "grad_query": grads[0], "grad_key": grads[1], "grad_value": grads[2]}
            _run_kernel(plan, arrays, scale, dropout_seed, dropout_offset)
            return grads + (None,) if return_mask_grad else grads

    on_sycl = sycl_inputs(query, key, value, attn_mask)
    if on_sycl is not None:  # dpnp / usm_ndarray in: the same steps with dpnp, the SYCL kernels, USM out
        import dpnp as xp

        q, k, v, user_mask, queue = on_sycl
        kind = "usm"
        if not all(sycl_runtime.is_usm_array(a) for a in (out, grad_out, stats)):
            raise TypeError("out, grad_out and stats must be USM arrays like query")
        o, do, st = out, grad_out, stats
    else:
        xp, queue = np, None
        q, kind = to_numpy(query, "query")
        k, _ = to_numpy(key, "key")
        v, _ = to_numpy(value, "value")
        o, _ = to_numpy(out, "out")
        do, _ = to_numpy(grad_out, "grad_out")
        st, _ = to_numpy(stats, "stats")
        user_mask = None if attn_mask is None else to_numpy(attn_mask, "attn_mask")[0]
    mask = normalize_mask(user_mask)
    # A signature seen before was checked when its plan was made: repeated calls only bind data (a small call
    # spent most of its time in these checks and stride walks).
    operands = (q, k, v, o, do, st, mask)
    free = None if queue is not None else _cpu.signature_key(operands, _FREE_AXES, flags, True)
    template = None if free is None else _by_length_free.get(free)
    if template is not None and replayable and kind == "numpy":
        grads = template.run(q, k, v, o, do, st, mask, None, scale, dropout_seed, dropout_offset, mods,
                             return_sinks_grad)
        if grads is not None:
            if return_sinks_grad:
                return grads[:3] + ((None,) if return_mask_grad else ()) + grads[3:]
            return grads + (None,) if return_mask_grad else grads
    # Else by the whole signature: NumPy arrays key on bytes (_cpu.signature_key), anything else on a tuple.
    signature = _cpu.signature_key(operands, _FREE_AXES, flags) if queue is None else None
    if signature is None:
        signature = ((layout_key(q), layout_key(k), layout_key(v), layout_key(o), layout_key(do), layout_key(st)),
                     layout_key(mask) if mask is not None else None) + flags + (queue,)
    plan = _plans.get(signature)
    if plan is None:
        # New lengths of a planned call that the class's run does not take (gradients into given arrays, a
        # mask's gradient) re-make its plan; anything else is checked and planned anew.
        if template is not None:
            plan = template.remade(q, k, v, o, do, st, mask)
        if plan is None:
            plan = _plan(q, k, v, o, do, st, mask, dropout_p, is_causal, enable_gqa, causal_alignment,
                         return_mask_grad, bounds, kind, mods, return_sinks_grad)
            keys = [key for key in (free, torch_free) if key is not None]  # host calls only
            if template is None and keys and plan.direct:
                made = _LengthFreeBackward(plan)
                for key in keys:
                    _by_length_free.put(key, made)
        replayed = plan.lengths is not None
        _plans.put(signature, plan, replayed)
        if torch_signature is not None and plan.direct:
            _plans.put(torch_signature, plan, replayed)
        if verbose.enabled():
            _log_plan(plan, queue)

    def empty(shape, dtype):
        return np.empty(shape, dtype) if queue is None else xp.empty(shape, dtype=dtype, sycl_queue=queue)
    q_shape2, k_shape2, v_shape2, m_shape2 = plan.grouped
    q_in = q if plan.query_copy is None else xp.ascontiguousarray(xp.broadcast_to(q.reshape(q_shape2),
                                                                                   plan.query_copy))
    if plan.dense:  # batch dims the kernel's three cannot walk: see _plan
        o, do, st = (xp.ascontiguousarray(a) for a in (o, do, st))
    mask_in = mask if plan.mask_copy is None else xp.ascontiguousarray(xp.broadcast_to(mask.reshape(m_shape2),
                                                                                       plan.mask_copy))
    k_in, v_in = k, v
    if plan.kv_copy is not None:
        k_in = xp.ascontiguousarray(xp.broadcast_to(k.reshape(k_shape2), plan.kv_copy[0]))
        v_in = xp.ascontiguousarray(xp.broadcast_to(v.reshape(v_shape2), plan.kv_copy[1]))
    given = None
    if grads_out is not None:  # each checked against the inputs and the gradients before it
        given = []
        read = {"query": q, "key": k, "value": v, "out": o, "grad_out": do, "stats": st, "attn_mask": mask}
        for a, operand, name in zip(grads_out, (q, k, v), _GRADS_OUT_NAMES):
            given.append(checked_out(a, operand.shape, operand.dtype, read, name))
            read[name] = a
    if given is not None and plan.direct:  # the kernel's gradient buffers are the gradients: it writes out
        dq_full, dk_own, dv_own = (a.reshape(shape) for a, shape in zip(given, plan.grad_shapes))
    else:
        dq_full, dk_own, dv_own = (empty(shape, a.dtype) for shape, a in zip(plan.grad_shapes, (q, k, v)))
    dmask_full = None if plan.grad_mask_shape is None else empty(plan.grad_mask_shape, np.float32)
    dsinks = empty(mods.sinks.shape, np.float32) if return_sinks_grad else None
    per_head = {} if mods is None else mods.arrays(queue)  # held here until the kernels are done
    arrays = {"query": q_in, "key": k_in, "value": v_in, "output": o, "stats": st, "grad_output": do,
              "grad_query": dq_full, "grad_key": dk_own, "grad_value": dv_own, "mask": mask_in, "grad_mask": dmask_full,
              "grad_sinks": dsinks, **per_head}
    if not plan.has_scores:
        for a in (dq_full, dk_own, dv_own, dmask_full, dsinks):
            if a is not None:
                a[...] = 0
    else:
        if queue is not None:
            sycl_runtime.wait_for_producers([a for a in arrays.values() if a is not None])
            extents = {name: sycl_runtime.usm_layout(a) for name, a in arrays.items() if a is not None}
            arrays = {name: None if a is None else sycl_runtime.usm_address(a) for name, a in arrays.items()}
            sycl_run = functools.partial(sycl_runtime.plugin().backward, queue, extents=extents)
        else:
            sycl_run = None
        _run_kernel(plan, arrays, scale, dropout_seed, dropout_offset, sycl_run)
        if queue is not None:
            queue.wait()  # the gradients are ready on return, as on the CPU

    dq = _reduce_to(dq_full, q_shape2).astype(q.dtype, copy=False).reshape(q.shape)
    kv_alike = plan.kv_copy is None
    dk = (dk_own if kv_alike else _reduce_to(dk_own, k_shape2).astype(k.dtype, copy=False)).reshape(k.shape)
    dv = (dv_own if kv_alike else _reduce_to(dv_own, v_shape2).astype(v.dtype, copy=False)).reshape(v.shape)
    if given is not None:
        for target, result in zip(given, (dq, dk, dv)):
            if not np.may_share_memory(target, result):  # computed in buffers of their own
                np.copyto(target, result)
        dq, dk, dv = given
    grads = (from_numpy(dq, kind), from_numpy(dk, kind), from_numpy(dv, kind))
    if return_mask_grad:
        dmask = None
        if dmask_full is not None:
            dmask = _reduce_to(dmask_full, m_shape2).astype(mask.dtype, copy=False).reshape(user_mask.shape)
            dmask = from_numpy(dmask, kind)
        grads += (dmask,)
    if return_sinks_grad:
        grads += (from_numpy(dsinks, kind),)
    return grads
