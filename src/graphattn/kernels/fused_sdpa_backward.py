"""The fused SDPA backward kernel of native/cpu, bound to one matched, compiled backward partition.

The backward graph has no forward output O, which the kernel needs for
D = rowsum(dO * O); it is recomputed by the fused forward kernel into an f32
buffer (the same cost as one forward pass) before the backward runs.  Every
operand becomes a 5-dim strided view as in the forward; dK and dV are written
in K's and V's broadcast layout, so the GQA ReduceSum happens inside the kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import _cpu, sycl_runtime
from ..dtypes import DataType
from ..ops import OpKind
from ..patterns.sdpa_backward import GradientOutput, SdpaBackwardMatch
from ..attention_spec import AttentionSpec, NotUsable, Operand, lower
from ..logical_tensor import dense_strides
from .fused_sdpa import (ReplayedLengths, WindowOperands, apply_chain, host_scalar, scalar_chain, as_u64, KernelView,
                         check_sycl_usable, operand, output_view, plan_window, port_view, replayed_lengths,
                         usm_address)


def _gradient_view(grad: GradientOutput, lts, shapes) -> KernelView:
    return output_view(lts[grad.tensor_id], grad.view_ops, shapes)


def _check_reduction(grad: GradientOutput, operand: KernelView, batch: tuple, name: str, lts, shapes) -> KernelView:
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


RECOMPUTE_ROLES = ("query", "key", "value", "output", "mask")  # what the backward's O recompute reads and writes


class BackwardLengthReplay:
    """A FusedSdpaBackward's lowering replayed for the sequence lengths of other calls: the backward's plan and
    the plan of its O recompute (native/cpu's LengthFreeBackward and LengthFreeForward), each operand's
    strides following its port's array and O dense at the new lengths."""

    def __init__(self, kernel: FusedSdpaBackward, seq_q, seq_kv):
        self.kernel = kernel
        self.lengths = (seq_q, seq_kv)  # each a fixed length or the (port id, axis) that gives it
        call = kernel.call
        folds = call.folds + kernel.chain_folds
        self.backward = kernel.backward_plan.length_free(call.sources, folds, ((), (), ()))
        self.forward = kernel.forward_plan.length_free(
            {role: call.sources[role] for role in RECOMPUTE_ROLES if role in call.sources},
            tuple(fold for fold in folds if fold[0] in RECOMPUTE_ROLES), ())
        self.window = (call.options["window_left"], call.options["window_right"])
        ports = kernel.ports
        self.port_order = tuple(ports.get(role) for role in ("query", "key", "value", "stats", "grad_output", "mask",
                                                             "grad_query", "grad_key", "grad_value", "grad_mask"))

    def plans_for(self, arrays: dict):
        """(backward plan, O recompute's plan, O's shape) for the ports' NumPy arrays (by port id) at their
        lengths, or None where a fold of the lowering does not hold for their strides."""
        seq_q, seq_kv = replayed_lengths(self.lengths, arrays)
        kernel = self.kernel
        # an absent role's id is None: None
        q, k, v, stats, grad_out, mask, dq, dk, dv, dmask = map(arrays.get, self.port_order)
        o = dense_strides(kernel.batch + (seq_q, kernel.call.head_dim_v))  # O's strides by the ports' batch dims
        grads = (dq, dk, dv) if dmask is None else (dq, dk, dv, dmask)
        backward = self.backward.plan_for(seq_q, seq_kv, q, k, v, o, stats, grad_out, *self.window, grads, mask)
        forward = self.forward.plan_for(seq_q, seq_kv, q, k, v, mask, *self.window, o, None)
        if backward is None or forward is None:
            return None
        return backward, forward, kernel.call.batch + (seq_q, kernel.call.head_dim_v)

    def shape_text(self, arrays: dict) -> str:
        """The shape of the call on these arrays for the verbose log."""
        seq_q, seq_kv = replayed_lengths(self.lengths, arrays)
        return self.kernel.call.shape_text_for(seq_q, seq_kv, *self.window)

    @staticmethod
    def dispatch_text(plans: tuple) -> str:
        """The backward plan's kernel build, the rule that chose it and its layout (for the verbose log)."""
        return plans[0].dispatch_text()


class FusedSdpaBackward(ReplayedLengths):
    """Runs one matched SDPA backward partition with graphattn::sdpa_forward (for O) and sdpa_backward."""

    name = "sdpa_backward_cpu"

    def __init__(self, match: SdpaBackwardMatch, lts: dict, shapes: dict, engine=None):
        self.match = m = match
        q = apply_chain(m.query, lts, shapes)
        k = apply_chain(m.key, lts, shapes)
        v = apply_chain(m.value, lts, shapes)
        grad_out = apply_chain(m.grad_output, lts, shapes)
        stats = apply_chain(m.stats, lts, shapes)
        seq_q, head_dim = q.shape[-2:]
        seq_kv, head_dim_v = k.shape[-2], v.shape[-1]
        score_shape = shapes[m.subtract.inputs[0].id]
        if score_shape[-2:] != (seq_q, seq_kv):
            raise NotUsable(f"the mask broadcasts the scores from {(seq_q, seq_kv)} to {score_shape[-2:]}")
        batch = score_shape[:-2]

        dq = _gradient_view(m.dq, lts, shapes)
        for axis, size in enumerate(q.shape[:-2]):
            if size == 1 and batch[len(batch) - len(q.shape) + 2 + axis] > 1:
                raise NotUsable("query is broadcast over a batch dim; its gradient would need a reduction")
        dk = _check_reduction(m.dk, k, batch, "K", lts, shapes)
        dv = _check_reduction(m.dv, v, batch, "V", lts, shapes)

        views = {"query": q, "key": k, "value": v, "grad_output": grad_out, "stats": stats,
                 "grad_query": dq, "grad_key": dk, "grad_value": dv}
        ports = {"query": m.query.tensor_id, "key": m.key.tensor_id, "value": m.value.tensor_id,
                 "grad_output": m.grad_output.tensor_id, "stats": m.stats.tensor_id,
                 "grad_query": m.dq.tensor_id, "grad_key": m.dk.tensor_id, "grad_value": m.dv.tensor_id}
        if m.mask is not None:
            views["mask"], ports["mask"] = apply_chain(m.mask, lts, shapes), m.mask.tensor_id
        if m.grad_mask_id is not None:
            views["grad_mask"], ports["grad_mask"] = port_view(lts[m.grad_mask_id]), m.grad_mask_id
        operands = {role: operand(lts[ports[role]].dtype, view) for role, view in views.items()}
        # The recomputed O: f32, contiguous over (batch, Sq, Dv).
        operands["output"] = Operand(DataType.f32, tuple(batch) + (seq_q, head_dim_v),
                                     dense_strides(tuple(batch) + (seq_q, head_dim_v)))
        self.note_views(views, ports, lts)  # replays for other lengths (see ReplayedLengths)
        self.batch = tuple(batch)
        self.scale = scalar_chain(m.scale, lts, "scale")
        self.select_fill = scalar_chain(m.select_fill, lts, "Select fill value")
        self.window = WindowOperands(m.bounds, lts)
        self.dropout_seed = scalar_chain(m.dropout_seed, lts, "Dropout seed")
        self.dropout_offset = scalar_chain(m.dropout_offset, lts, "Dropout offset")
        self.scale_is_divisor = m.scale_op is not None and m.scale_op.kind == OpKind.Divide
        spec = AttentionSpec(
            "backward", tuple(batch), seq_q, seq_kv, head_dim, head_dim_v, operands, mask_kind=m.mask_kind,
            select_keep_value=m.select_keep_value, has_scale=m.scale is not None,
            scale_is_divisor=self.scale_is_divisor, window=plan_window(m.bounds), inf_as_zero=True,
            dropout_p=m.dropouts[0].attrs["p"] if m.dropouts else 0.0)
        self.call = call = lower(spec)
        self.o_shape = call.batch + (seq_q, head_dim_v)
        input_dtypes = {lts[c.tensor_id].dtype for c in (m.query, m.key, m.value, m.grad_output)}
        self.queue = engine.queue if engine is not None and engine.is_sycl else None
        if self.queue is not None:
            check_sycl_usable(input_dtypes, head_dim, head_dim_v)
            self.name = "sdpa_backward_sycl"
        # The forward recomputing O writes it where the backward reads it, and no stats.
        forward_roles = {r: call.roles[r] for r in RECOMPUTE_ROLES if r in call.roles}
        self.forward_plan = dataclasses.replace(call, roles=forward_roles).forward_plan(self.queue)
        self.backward_plan = None if self.queue is not None else call.backward_plan()
        self.lengths = (seq_q, seq_kv)
        self.isa = "subgroup" if self.queue is not None else _cpu.backward_isa([dt.value for dt in input_dtypes],
                                                                                seq_q, seq_kv)

    @property
    def shape_text(self) -> str:
        """The call's shape for the verbose log."""
        options = self.call.options
        return self.call.shape_text_for(*self.lengths, options["window_left"], options["window_right"])

    def length_replay(self, probe) -> BackwardLengthReplay | None:
        """A BackwardLengthReplay of this kernel for the lengths of other calls, or None where it cannot be made
        (see ReplayedLengths.replay_lengths)."""
        lengths = None if self.queue is not None else self.replay_lengths(probe)
        return None if lengths is None else BackwardLengthReplay(self, *lengths)

    def dispatch_text(self) -> str:
        """isa=<build> and, on the CPU, why=<the rule that chose it> and the key pass's layout (for the verbose
        log)."""
        return f"isa={self.isa}" if self.queue is not None else self.backward_plan.dispatch_text()

    def execute(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray], replayed=None) -> None:
        """Runs the kernel on the ports' arrays; replayed: a length replay's plans for them
        (BackwardLengthReplay.plans_for)."""
        backward_plan, forward_plan, o_shape = (self.backward_plan, self.forward_plan, self.o_shape) \
            if replayed is None else replayed
        m = self.match
        left, right, window_fill = self.window.values(inputs)
        runtime = dict(
            scale=host_scalar(inputs[self.scale.tensor_id]) if self.scale is not None else 1.0,
            window_left=left, window_right=right, window_fill=window_fill,
            select_fill=host_scalar(inputs[self.select_fill.tensor_id]) if self.select_fill is not None else float("-inf"),
            dropout_seed=as_u64(inputs[self.dropout_seed.tensor_id]) if self.dropout_seed is not None else 0,
            dropout_offset=as_u64(inputs[self.dropout_offset.tensor_id]) if self.dropout_offset is not None else 0)
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
            o = dpnp.empty(o_shape, dtype=np.float32, sycl_queue=self.queue)
            address = {name: usm_address(a, name) for name, a in arrays.items()}
            forward_plan.run(address["query"], address["key"], address["value"], usm_address(o, "output"),
                             mask=address.get("mask", 0), **runtime)
            address["output"] = usm_address(o, "output")
            specs = {name: spec + (address[name],) for name, spec in self.call.roles.items()}
        else:
            o = np.empty(o_shape, np.float32)
            forward_plan.run_arrays(arrays["query"], arrays["key"], arrays["value"], o, mask=arrays.get("mask"),
                                    **runtime)
            arrays["output"] = o
        scale = runtime.pop("scale")
        if self.scale_is_divisor:
            scale = 1.0 / scale
        if self.queue is None:
            backward_plan.run(arrays, scale, runtime["dropout_seed"], runtime["dropout_offset"],
                              runtime["select_fill"], runtime["window_fill"], (left, right))
            return
        self.call.run_backward(functools.partial(sycl_runtime.plugin().backward, self.queue), specs, scale=scale,
                               **runtime)
        self.queue.wait()  # o is freed when this returns
