"""The fused SDPA backward kernel of native/cpu, bound to one matched, compiled backward partition.

The backward graph has no forward output O, which the kernel needs for
D = rowsum(dO * O); it is recomputed by the fused forward kernel into an f32
buffer (the same cost as one forward pass) before the backward runs.  Every
operand becomes a 5-dim strided view as in the forward; dK and dV are written
in K's and V's broadcast layout, so the GQA ReduceSum happens inside the kernel.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import _cpu, sycl_runtime
from ..dtypes import DTYPES, DataType, FLOAT_TYPES
from ..ops import OpKind
from ..patterns.sdpa_backward import GradientOutput, SdpaBackwardMatch
from .fused_sdpa import (NotUsable, WindowOperands, plan_window, fold_kernel_batch, _apply_chain, _code, _kernel_strides, _scalar, _scalar_chain,
                         _u64, _View, check_sycl_usable, output_view, usm_address)


def _gradient_view(grad: GradientOutput, lts, shapes) -> _View:
    return output_view(lts[grad.tensor_id], grad.view_ops, shapes)


def _check_reduction(grad: GradientOutput, operand: _View, batch: tuple, name: str, lts, shapes) -> _View:
    """The gradient of K or V must be summed over exactly the batch dims the operand is broadcast over."""
    view = _gradient_view(grad, lts, shapes)
    pad = len(batch) - (len(operand.shape) - 2)
    broadcast = [pad > i or operand.shape[i - pad] == 1 for i in range(len(batch))]
    gpad = len(batch) - (len(view.shape) - 2)
    reduced = [gpad > i or view.shape[i - gpad] == 1 for i in range(len(batch))]
    for i, size in enumerate(batch):
        if size > 1 and broadcast[i] != reduced[i]:
            raise NotUsable(f"d{name} of shape {view.shape} is not {name}'s gradient summed over its broadcast "
                            f"dims ({name} {operand.shape}, batch {tuple(batch)}); the kernel writes only that")
    return view


class FusedSdpaBackward:
    """Runs one matched SDPA backward partition with graphattn::sdpa_forward (for O) and sdpa_backward."""

    name = "sdpa_backward_cpu"

    def __init__(self, match: SdpaBackwardMatch, lts: dict, shapes: dict, engine=None):
        self.match = m = match
        q = _apply_chain(m.query, lts, shapes)
        k = _apply_chain(m.key, lts, shapes)
        v = _apply_chain(m.value, lts, shapes)
        grad_out = _apply_chain(m.grad_output, lts, shapes)
        stats = _apply_chain(m.stats, lts, shapes)
        seq_q, head_dim = q.shape[-2:]
        seq_kv, head_dim_v = k.shape[-2], v.shape[-1]
        score_shape = shapes[m.subtract.inputs[0].id]
        if score_shape[-2:] != (seq_q, seq_kv):
            raise NotUsable(f"the mask broadcasts the scores from {(seq_q, seq_kv)} to {score_shape[-2:]}")
        batch = score_shape[:-2]
        self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v = seq_q, seq_kv, head_dim, head_dim_v

        def spec(name, view, rows, cols, tensor_id, allowed=FLOAT_TYPES):
            return (_code(lts[tensor_id].dtype, allowed, name), _kernel_strides(view, batch, rows, cols, name))

        dq = _gradient_view(m.dq, lts, shapes)
        for axis, size in enumerate(q.shape[:-2]):
            if size == 1 and batch[len(batch) - len(q.shape) + 2 + axis] > 1:
                raise NotUsable("query is broadcast over a batch dim; its gradient would need a reduction")
        dk = _check_reduction(m.dk, k, batch, "K", lts, shapes)
        dv = _check_reduction(m.dv, v, batch, "V", lts, shapes)
        self.specs = {
            "query": spec("query", q, seq_q, head_dim, m.query.tensor_id),
            "key": spec("key", k, seq_kv, head_dim, m.key.tensor_id),
            "value": spec("value", v, seq_kv, head_dim_v, m.value.tensor_id),
            "grad_output": spec("grad_output", grad_out, seq_q, head_dim_v, m.grad_output.tensor_id),
            "stats": spec("stats", stats, seq_q, 1, m.stats.tensor_id, {DataType.f32}),
            "grad_query": spec("grad_query", dq, seq_q, head_dim, m.dq.tensor_id),
            "grad_key": spec("grad_key", dk, seq_kv, head_dim, m.dk.tensor_id),
            "grad_value": spec("grad_value", dv, seq_kv, head_dim_v, m.dv.tensor_id),
        }
        if m.mask is not None:
            allowed = FLOAT_TYPES if m.mask_kind == "additive" else {DataType.boolean}
            self.specs["mask"] = spec("mask", _apply_chain(m.mask, lts, shapes), seq_q, seq_kv, m.mask.tensor_id,
                                      allowed)
        if m.grad_mask_id is not None:
            grad_mask = lts[m.grad_mask_id]
            self.specs["grad_mask"] = spec("grad_mask", _View(grad_mask.shape, grad_mask.strides), seq_q, seq_kv,
                                           m.grad_mask_id, {DataType.f32})
        self.batch, self.specs = fold_kernel_batch(batch, self.specs)
        self.scale = _scalar_chain(m.scale, lts, "scale")
        self.select_fill = _scalar_chain(m.select_fill, lts, "Select fill value")
        self.window = WindowOperands(m.bounds, lts)
        self.plan_window = plan_window(m.bounds)
        self.dropout_seed = _scalar_chain(m.dropout_seed, lts, "Dropout seed")
        self.dropout_offset = _scalar_chain(m.dropout_offset, lts, "Dropout offset")
        self.options = dict(
            mask_kind=_cpu.MASK_KIND_CODES[m.mask_kind], select_keep_value=m.select_keep_value,
            has_scale=m.scale is not None, inf_as_zero=True,
            dropout_p=m.dropouts[0].attrs["p"] if m.dropouts else 0.0)
        self.scale_is_divisor = m.scale_op is not None and m.scale_op.kind == OpKind.Divide
        # The recomputed O: f32, contiguous over the kernel's (batch, Sq, Dv).
        self.o_shape = self.batch + (seq_q, head_dim_v)
        o_strides = (0 if self.batch[0] == 1 else self.batch[1] * self.batch[2] * seq_q * head_dim_v,
                     self.batch[2] * seq_q * head_dim_v, seq_q * head_dim_v, head_dim_v, 1)
        self.o_spec = (DTYPES[DataType.f32].kernel_code, o_strides)
        views = {name: (code, strides) for name, (code, strides) in self.specs.items()}
        input_dtypes = {lts[c.tensor_id].dtype for c in (m.query, m.key, m.value, m.grad_output)}
        self.queue = engine.queue if engine is not None and engine.is_sycl else None
        plan_type = _cpu.ForwardPlan
        if self.queue is not None:
            check_sycl_usable(input_dtypes, head_dim, head_dim_v)
            self.name = "sdpa_backward_sycl"
            plan_type = functools.partial(sycl_runtime.plugin().ForwardPlan, self.queue)
        self.forward_plan = plan_type(
            self.batch, seq_q, seq_kv, head_dim, head_dim_v, views["query"], views["key"], views["value"],
            self.o_spec, views.get("mask"), None, scale_is_divisor=self.scale_is_divisor, **self.options,
            **self.plan_window)
        self.shape_text = (f"batch={'x'.join(map(str, batch))},sq={seq_q},skv={seq_kv},d={head_dim},dv={head_dim_v},"
                           f"dtype={lts[m.query.tensor_id].dtype.value},mask={m.mask_kind},"
                           f"window={'+'.join(b.side for b in m.bounds) or 'none'},"
                           f"dropout={self.options['dropout_p']}")
        self.isa = "subgroup" if self.queue is not None else _cpu.backward_isa([dt.value for dt in input_dtypes],
                                                                                seq_q, seq_kv)

    def dispatch_text(self) -> str:
        """isa=<build> and, on the CPU, why=<the rule that chose it> and the key pass's layout (for the verbose
        log)."""
        if self.queue is not None:
            return f"isa={self.isa}"
        roles = {name: (code, strides) for name, (code, strides) in self.specs.items()}
        roles["output"] = self.o_spec
        return _cpu.backward_dispatch_text(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v, roles,
                                           **self.options, **self.plan_window)

    def execute(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> None:
        m = self.match
        left, right, window_fill = self.window.values(inputs)
        runtime = dict(
            scale=_scalar(inputs[self.scale.tensor_id]) if self.scale is not None else 1.0,
            window_left=left, window_right=right, window_fill=window_fill,
            select_fill=_scalar(inputs[self.select_fill.tensor_id]) if self.select_fill is not None else float("-inf"),
            dropout_seed=_u64(inputs[self.dropout_seed.tensor_id]) if self.dropout_seed is not None else 0,
            dropout_offset=_u64(inputs[self.dropout_offset.tensor_id]) if self.dropout_offset is not None else 0)
        arrays = {"query": inputs[m.query.tensor_id], "key": inputs[m.key.tensor_id],
                  "value": inputs[m.value.tensor_id], "grad_output": inputs[m.grad_output.tensor_id],
                  "stats": inputs[m.stats.tensor_id], "grad_query": outputs[m.dq.tensor_id],
                  "grad_key": outputs[m.dk.tensor_id], "grad_value": outputs[m.dv.tensor_id]}
        if m.mask is not None:
            arrays["mask"] = inputs[m.mask.tensor_id]
        if m.grad_mask_id is not None:
            arrays["grad_mask"] = outputs[m.grad_mask_id]
        if self.queue is not None:
            import dpnp

            sycl_runtime.wait_for_producers(list(arrays.values()))
            o = dpnp.empty(self.o_shape, dtype=np.float32, sycl_queue=self.queue)
            address = {name: usm_address(a, name) for name, a in arrays.items()}
            self.forward_plan.run(address["query"], address["key"], address["value"], usm_address(o, "output"),
                                  mask=address.get("mask", 0), **runtime)
            specs = {name: spec + (address[name],) for name, spec in self.specs.items()}
            specs["output"] = self.o_spec + (usm_address(o, "output"),)
            run_backward = functools.partial(sycl_runtime.plugin().backward, self.queue)
        else:
            o = np.empty(self.o_shape, np.float32)
            self.forward_plan.run_arrays(arrays["query"], arrays["key"], arrays["value"], o, mask=arrays.get("mask"),
                                         **runtime)
            specs = {name: spec + (arrays[name],) for name, spec in self.specs.items()}
            specs["output"] = self.o_spec + (o,)
            run_backward = _cpu.backward
        scale = runtime.pop("scale")
        if self.scale_is_divisor:
            scale = 1.0 / scale
        run_backward(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v, specs,
                     scale=scale, **runtime, **self.options)
        if self.queue is not None:
            self.queue.wait()  # o is freed when this returns
