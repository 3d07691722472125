"""The fused SDPA forward kernel of native/cpu, bound to one matched, compiled partition.

At compile time every operand becomes a 5-dim strided view (3 batch dims, row,
column): view ops are folded into strides, broadcast dims get stride 0, and
the output reorder is folded backwards into the output strides.  `build`
returns None with the reason when the partition's shapes or layouts are
outside what the kernel takes; the partition then runs on the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import functools
import math

import numpy as np

from .. import _cpu, score_mods, sycl_runtime
from ..attention_spec import AttentionSpec, NotUsable, Operand, lower
from ..dtypes import DTYPES, DataType
from ..ops import OpKind
from ..ops.philox import bits64
from ..patterns.sdpa import InputChain, SdpaMatch
from ..views import reshape_origin, reshape_strides, transpose_strides, untranspose_strides



def plan_window(bounds) -> tuple:
    """The window a plan is made for, before its calls give the bounds' values: a causal one where a right
    bound is matched, none otherwise (it steers only the plan's description; each call passes its own)."""
    return None, (0 if any(b.side == "right" for b in bounds) else None)


def operand(dtype: DataType, view: KernelView) -> Operand:
    return Operand(dtype, tuple(view.shape), tuple(view.strides), view.origin)


@dataclass
class KernelView:
    """An operand as the kernel walks it: shape and strides, and where each stride comes from in the
    partition port's array: origin, per dim (the array's axis, multiplier) or None for a size-1 dim (None
    where unknown: an empty array), and folds, the (outer, inner, inner size) sources of the dims a reshape
    merged, whose strides must keep outer = inner * size (see views.reshape_origin)."""
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    origin: tuple | None = None
    folds: tuple = ()


def port_view(lt) -> KernelView:
    """A partition port's array as it is: each dim its own stride source."""
    origin = None if 0 in lt.shape else tuple(None if d == 1 else (axis, 1) for axis, d in enumerate(lt.shape))
    return KernelView(lt.shape, lt.strides, origin)


def _transposed(view: KernelView, shape: tuple, order: list, strides: tuple) -> KernelView:
    origin = None if view.origin is None else tuple(view.origin[a] for a in order)
    return KernelView(shape, strides, origin, view.folds)


def _reshaped(view: KernelView, shape: tuple, strides: tuple) -> KernelView:
    if view.origin is None or 0 in view.shape:
        return KernelView(shape, strides, None, view.folds)
    origin, folds = reshape_origin(view.shape, view.origin, shape)
    return KernelView(shape, strides, origin, view.folds + folds)


def apply_chain(chain: InputChain, lts, shapes) -> KernelView:
    lt = lts[chain.tensor_id]
    view = port_view(lt)
    for op in chain.ops:
        out_shape = shapes[op.outputs[0].id]
        if op.kind == OpKind.StaticTranspose:
            order = [a % len(view.shape) for a in op.attrs["order"]]
            view = _transposed(view, out_shape, order, transpose_strides(view.strides, order))
        else:
            strides = reshape_strides(view.shape, view.strides, out_shape)
            if strides is None:
                raise NotUsable(f"{op.where} would need a copy of tensor {chain.tensor_id} with strides {lt.strides}")
            view = _reshaped(view, out_shape, strides)
    return view


def _swap_last(view: KernelView) -> KernelView:
    return _transposed(view, view.shape[:-2] + view.shape[-2:][::-1], list(range(len(view.shape) - 2)) +
                       [len(view.shape) - 1, len(view.shape) - 2], view.strides[:-2] + view.strides[-2:][::-1])


def output_view(out, output_ops, shapes) -> KernelView:
    """The view of a partition output as the op before `output_ops` (view ops) produced it: reorders and
    reshapes after a kernel's result are folded into its output strides."""
    view = port_view(out)
    for op in reversed(output_ops):
        in_shape = shapes[op.inputs[0].id]
        if op.kind == OpKind.StaticTranspose:
            order = [a % len(in_shape) for a in op.attrs["order"]]
            inverse = [0] * len(order)
            for k, axis in enumerate(order):
                inverse[axis] = k
            view = _transposed(view, in_shape, inverse, untranspose_strides(view.strides, order))
        else:
            strides = reshape_strides(view.shape, view.strides, in_shape)
            if strides is None:
                raise NotUsable(f"{op.where}: output strides {out.strides} cannot be reached without a copy")
            view = _reshaped(view, in_shape, strides)
    return view


def scalar_chain(chain: InputChain | None, lts, what: str) -> InputChain | None:
    if chain is not None and lts[chain.tensor_id].numel() != 1:
        raise NotUsable(f"{what} (tensor {chain.tensor_id}) has shape {lts[chain.tensor_id].shape}; "
                        "the kernel takes a single value")
    return chain


def _host(array) -> np.ndarray:
    """A scalar operand on the host (a USM one is copied, which waits for its producer)."""
    return array if isinstance(array, np.ndarray) else sycl_runtime.to_host(array)


_NEG_INF = float("-inf")


def host_scalar(array) -> float:
    return _host(array).item()  # a one-element array of any rank


def as_u64(array) -> int:
    """An s64 seed or offset tensor's value as the 64-bit pattern the Philox key/counter takes."""
    return bits64(_host(array).reshape(-1)[0])


class WindowOperands:
    """A match's key window bounds as the kernel takes them (see graphattn/key_window.hpp): the scalar
    operands of each bound, read per call into (left, right, fill) about the row itself."""

    def __init__(self, bounds, lts):
        self.bounds = [(b.side, b.adjust, [(scalar_chain(c, lts, "key window index offset"), sign)
                                           for c, sign in b.terms],
                        scalar_chain(b.fill, lts, "key window fill value")) for b in bounds]

    def __bool__(self) -> bool:
        return bool(self.bounds)

    def values(self, inputs: dict) -> tuple[int, int, float]:
        """(left, right, fill): row i sees keys i - left <= j <= i + right, _cpu.NO_KEY_LIMIT for a side
        without a bound; the other scores become the fill, one value for both bounds."""
        left = right = _cpu.NO_KEY_LIMIT
        fills = []
        for side, adjust, terms, fill in self.bounds:
            offset = adjust + sum(sign * int(host_scalar(inputs[c.tensor_id])) for c, sign in terms)
            if side == "right":  # j - i <= offset
                right = offset
            else:  # j - i >= offset
                left = -offset
            fills.append(float(host_scalar(inputs[fill.tensor_id])))
        if len(fills) == 2 and fills[0] != fills[1] and not (np.isnan(fills[0]) and np.isnan(fills[1])):
            raise ValueError(f"the key window's two bounds fill hidden scores with {fills[0]} and {fills[1]}; "
                             "the fused kernel takes one fill value for both")
        return left, right, fills[0] if fills else _NEG_INF


# The kernel's format (graphattn::KvFormat) of a DynamicDequantize's src dtype, and the zero points' dtype it
# reads with it: the graph's 4-bit tensors hold a value a byte (ml_dtypes' uint4 and int4), so u4 decodes as u8
# and s4 by its low nibble.
_DEQUANT_FORMATS = {DataType.u8: (_cpu.KvFormat.u8, (DataType.u8, DataType.u4)),
                    DataType.u4: (_cpu.KvFormat.u8, (DataType.u8, DataType.u4)),
                    DataType.s8: (_cpu.KvFormat.s8, (DataType.s8,)),
                    DataType.s4: (_cpu.KvFormat.s4_in_byte, (DataType.s8,))}


def dequant_spec(dequant, role: str, call, lts) -> tuple:
    """A DynamicDequantize fused before K or V as the plan's KvQuant (_cpu.ForwardPlan.with_kv_quant): its
    format, group and decoded dtype, and its scales' and zps' kernel strides, found from the sources of the
    role's own strides (the src's axes), so they fold as the src does.  NotUsable where the kernel cannot
    take it."""
    op, src = dequant.op, lts[dequant.src.tensor_id]
    fmt, zero_types = _DEQUANT_FORMATS[src.dtype]
    sources = call.sources[role]
    column = sources[-1]
    group_shape = list(op.attrs["group_shape"])
    grouped = [axis for axis, g in enumerate(group_shape) if g != 1]
    if grouped and (column is None or grouped != [column[0]]):
        raise NotUsable(f"{op.where} groups dim {grouped[0]}, not {role}'s head size")
    group = group_shape[column[0]] if column is not None else 1

    def kernel_strides(lt) -> tuple:
        strides = [0 if source is None or lt.shape[source[0]] == 1 else source[1] * lt.strides[source[0]]
                   for source in sources[:-1]]
        for r, outer, inner, size in call.folds:
            if r == role and outer is not None and inner is not None and \
                    outer[1] * lt.strides[outer[0]] != inner[1] * lt.strides[inner[0]] * size:
                raise NotUsable(f"{op.where}: tensor {lt.id}'s strides do not fold as {role}'s do")
        return tuple(strides) + (0 if column is None else lt.strides[column[0]],)

    scales = lts[dequant.scales.tensor_id]
    zps = None
    if dequant.zps is not None:
        zero = lts[dequant.zps.tensor_id]
        if zero.dtype not in zero_types:
            raise NotUsable(f"{op.where}: zps of {zero.dtype.value} beside src of {src.dtype.value}")
        zps = (int(_cpu.DType.u8), kernel_strides(zero))
    decoded = DTYPES[op.outputs[0].dtype].kernel_code
    return int(fmt), group, decoded, (DTYPES[scales.dtype].kernel_code, kernel_strides(scales)), zps


def usm_address(array, name: str) -> int:
    """The device address of a SYCL kernel operand, which must be a USM array."""
    if not sycl_runtime.is_usm_array(array):
        raise TypeError(f"{name}: the SYCL kernel needs a dpnp array or usm_ndarray, got {type(array).__name__}")
    return sycl_runtime.usm_address(array)


def check_sycl_usable(input_dtypes: set, head_dim: int, head_dim_v: int) -> None:
    """The SYCL kernels' limits beyond the CPU kernels' (one input dtype; head sizes the lanes hold)."""
    limit = sycl_runtime.plugin().MAX_HEAD_DIM
    if len(input_dtypes) != 1:
        raise NotUsable(f"inputs of dtypes {sorted(d.value for d in input_dtypes)}; the SYCL kernels take one")
    if max(head_dim, head_dim_v) > limit:
        raise NotUsable(f"head sizes {head_dim}/{head_dim_v}; the SYCL kernels take at most {limit}")


class ReplayedLengths:
    """What a fused kernel of a graph partition keeps to be replayed for other sequence lengths: the port of each
    operand (ports, role -> tensor id), where the lengths come from in the ports' arrays (length_axes: (port id,
    axis) of the query's rows and of the key's), the chains' folds (chain_folds, as KernelCall.folds), and
    whether every view knows its strides' sources (replayable).  The kernel sets self.call (its lowering)."""

    def note_views(self, views: dict, ports: dict, lts: dict) -> None:
        """views: role -> KernelView of each operand read from a port (ports: role -> tensor id)."""
        self.ports = ports
        self.length_axes = tuple(None if views[role].origin is None or views[role].origin[-2] is None else
                                 (ports[role], views[role].origin[-2][0]) for role in ("query", "key"))
        self.port_shapes = {ports[role]: lts[ports[role]].shape for role in ("query", "key")}
        self.chain_folds = tuple((role, outer, inner, size) for role, view in views.items()
                                 for outer, inner, size in view.folds)
        self.replayable = all(view.origin is not None for view in views.values())

    def replay_lengths(self, probe) -> tuple | None:
        """(seq_q, seq_kv) of a replay, each a fixed length or the (port id, axis) that gives it, or None where
        no replay can be made.  probe: the same partition compiled at other sequence lengths (dense arrays);
        the lowering must come out the same but for the lengths, which must each be one port's dim."""
        if type(probe) is not type(self) or not (self.replayable and probe.replayable):
            return None
        a, b = self.call, probe.call
        if (a.batch, a.head_dim, a.head_dim_v, a.sources, a.folds, a.options, self.chain_folds) != \
                (b.batch, b.head_dim, b.head_dim_v, b.sources, b.folds, b.options, probe.chain_folds) or \
                {r: code for r, (code, _) in a.roles.items()} != {r: code for r, (code, _) in b.roles.items()}:
            return None
        lengths = []
        for length, probe_length, source, probe_source in zip((a.seq_q, a.seq_kv), (b.seq_q, b.seq_kv),
                                                              self.length_axes, probe.length_axes):
            if length == probe_length:
                lengths.append(length)
            elif source is not None and source == probe_source and \
                    self.port_shapes[source[0]][source[1]] == length and \
                    probe.port_shapes[source[0]][source[1]] == probe_length:
                lengths.append(source)
            else:
                return None
        return tuple(lengths)


def replayed_lengths(lengths: tuple, arrays: dict) -> tuple:
    """(seq_q, seq_kv) of a call on these arrays (by port id), lengths as a length replay has them: each a fixed
    length or the (port id, axis) that gives it."""
    return tuple([n if type(n) is int else arrays[n[0]].shape[n[1]] for n in lengths])


class LengthReplay:
    """A FusedSdpaForward's lowering replayed for the sequence lengths of other calls (_cpu.LengthFreeForward):
    the strides of each operand follow its port's array, where the lowering's folds still hold."""

    def __init__(self, kernel: FusedSdpaForward, seq_q, seq_kv):
        self.kernel = kernel
        self.lengths = (seq_q, seq_kv)  # each a fixed length or the (port id, axis) that gives it
        call = kernel.call
        self.replay = kernel.plan.length_free(call.sources, call.folds + kernel.chain_folds, ())
        self.window = (call.options["window_left"], call.options["window_right"])
        ports = kernel.ports
        self.port_order = tuple(ports.get(role) for role in ("query", "key", "value", "mask", "output", "stats"))

    def plans_for(self, arrays: dict):
        """The kernel plan for the ports' NumPy arrays (by port id) at their lengths, or None where a fold of the
        lowering does not hold for their strides."""
        seq_q, seq_kv = replayed_lengths(self.lengths, arrays)
        q, k, v, mask, out, stats = map(arrays.get, self.port_order)  # an absent role's id is None: None
        return self.replay.plan_for(seq_q, seq_kv, q, k, v, mask, *self.window, out, stats)

    def shape_text(self, arrays: dict) -> str:
        """The shape of the call on these arrays for the verbose log."""
        seq_q, seq_kv = replayed_lengths(self.lengths, arrays)
        return self.kernel.call.shape_text_for(seq_q, seq_kv, *self.window)

    @staticmethod
    def dispatch_text(plan) -> str:
        """plans_for's plan's kernel build, the rule that chose it and its work layout (for the verbose log)."""
        return plan.dispatch_text()


class FusedSdpaForward(ReplayedLengths):
    """Runs one matched SDPA forward partition with graphattn::sdpa_forward."""

    name = "sdpa_forward_cpu"

    def __init__(self, match: SdpaMatch, lts: dict, shapes: dict, engine=None):
        self.match = match
        m = match
        q = apply_chain(m.query, lts, shapes)
        k = apply_chain(m.key, lts, shapes)
        v = apply_chain(m.value, lts, shapes)
        if m.qk.attrs["transpose_a"]:
            q = _swap_last(q)
        if not m.qk.attrs["transpose_b"]:
            k = _swap_last(k)
        if m.pv.attrs["transpose_b"]:
            v = _swap_last(v)
        seq_q, head_dim = q.shape[-2:]
        seq_kv, head_dim_v = k.shape[-2], v.shape[-1]
        masked_shape = shapes[m.softmax.inputs[0].id]
        if masked_shape[-2:] != (seq_q, seq_kv):
            raise NotUsable(f"the mask broadcasts the scores from {(seq_q, seq_kv)} to {masked_shape[-2:]}")
        batch = shapes[m.pv.outputs[0].id][:-2]
        views = {"query": q, "key": k, "value": v, "output": output_view(lts[m.output_id], m.output_ops, shapes)}
        if m.mask is not None:
            views["mask"] = apply_chain(m.mask, lts, shapes)
        if m.stats_id is not None:
            views["stats"] = port_view(lts[m.stats_id])
        ports = {role: tensor_id for role, tensor_id in (
            ("query", m.query.tensor_id), ("key", m.key.tensor_id), ("value", m.value.tensor_id),
            ("output", m.output_id), ("mask", None if m.mask is None else m.mask.tensor_id),
            ("stats", m.stats_id)) if tensor_id is not None}
        self.note_views(views, ports, lts)
        # A K or V decoded in the kernel enters the spec as the dtype its DynamicDequantize gives.
        self.dequants = {role: d for role, d in (("key", m.key_dequant), ("value", m.value_dequant)) if d is not None}
        given = {role: d.op.outputs[0].dtype for role, d in self.dequants.items()}
        operands = {role: operand(given.get(role, lts[self.ports[role]].dtype), view) for role, view in views.items()}
        self.scale = scalar_chain(m.scale, lts, "scale")
        self.scale_is_divisor = m.scale_op is not None and m.scale_op.kind == OpKind.Divide
        self.softcap = None if m.softcap_divisor is None else (
            scalar_chain(m.softcap_divisor, lts, "softcap divisor"),
            scalar_chain(m.softcap_multiplier, lts, "softcap multiplier"))
        self._capped_plans = {}  # softcap value -> the plan with it (the value comes per call)
        self.select_fill = scalar_chain(m.select_fill, lts, "Select fill value")
        self.window = WindowOperands(m.bounds, lts)
        spec = AttentionSpec(
            "forward", tuple(batch), seq_q, seq_kv, head_dim, head_dim_v, operands, mask_kind=m.mask_kind,
            select_keep_value=m.select_keep_value, has_scale=m.scale is not None,
            scale_is_divisor=self.scale_is_divisor, window=plan_window(m.bounds),
            inf_as_zero=m.softmax.attrs["mode"] == "inf_as_zero",
            dropout_p=m.dropout_op.attrs["p"] if m.dropout_op is not None else 0.0,
            softcap=0.0 if self.softcap is None else 1.0)  # a placeholder > 0: the call's value replaces it
        call = self.call = lower(spec)
        input_dtypes = {lts[c.tensor_id].dtype for c in (m.query, m.key, m.value)}
        self.on_sycl = engine is not None and engine.is_sycl
        if self.on_sycl:
            check_sycl_usable(input_dtypes, head_dim, head_dim_v)
        if self.dequants and self.on_sycl:
            raise NotUsable("DynamicDequantize before K or V: the SYCL kernels do not decode quantized rows")
        self.plan = call.forward_plan(engine.queue if self.on_sycl else None)
        if self.dequants:
            self.plan = self.plan.with_kv_quant({role: dequant_spec(d, role, call, lts)
                                                 for role, d in self.dequants.items()})
            self.replayable = False  # the replay knows no scales
        self.dropout_seed = scalar_chain(m.dropout_seed, lts, "Dropout seed")
        self.dropout_offset = scalar_chain(m.dropout_offset, lts, "Dropout offset")
        if self.on_sycl:
            self.name = "sdpa_forward_sycl"
        self.lengths = (seq_q, seq_kv)

    @property
    def shape_text(self) -> str:
        """The call's shape for the verbose log."""
        options = self.call.options
        return self.call.shape_text_for(*self.lengths, options["window_left"], options["window_right"])

    @property
    def isa(self) -> str:
        """The kernel build the plan runs."""
        return self.plan.kernel_name() if self.on_sycl else self.plan.isa()

    def length_replay(self, probe) -> LengthReplay | None:
        """A LengthReplay of this kernel for the lengths of other calls, or None where it cannot be made (see
        ReplayedLengths.replay_lengths)."""
        lengths = None if self.on_sycl else self.replay_lengths(probe)
        return None if lengths is None else LengthReplay(self, *lengths)

    def plan_for(self, inputs: dict, replayed=None):
        """The kernel plan for a call with these inputs: the compiled one (or a length replay's, replayed), or,
        with a softcap, its copy for the call's softcap value (the Divide's and the Multiply's, which must
        agree)."""
        if self.softcap is None:
            return self.plan if replayed is None else replayed
        divisor, multiplier = (float(host_scalar(inputs[c.tensor_id])) for c in self.softcap)
        if divisor != multiplier:
            raise ValueError(f"the softcap divides by {divisor} and multiplies by {multiplier}; the fused kernel "
                             "takes one value for both")
        score_mods.softcap_value(divisor)  # the functional API's range, named the same
        if replayed is not None:
            return replayed.with_softcap(divisor)
        plan = self._capped_plans.get(divisor)
        if plan is None:
            if len(self._capped_plans) >= 16:
                self._capped_plans.clear()
            plan = self._capped_plans[divisor] = self.plan.with_softcap(divisor)
        return plan

    def dispatch_text(self) -> str:
        """isa=<build> and, on the CPU, why=<the rule that chose it> and the work layout (for the verbose log)."""
        return f"isa={self.isa}" if self.on_sycl else self.plan.dispatch_text()

    def bound_runner(self, fixed_inputs: dict):
        """run(query, key, value, output, mask, stats, scale, dropout_seed, dropout_offset): execute's kernel
        call for calls whose other operands (fill values, key window offsets) are always those in
        fixed_inputs, with their lookups done once here.  None on SYCL (execute also orders the queue there)."""
        if self.on_sycl or self.dequants:
            return None
        left, right, window_fill = self.window.values(fixed_inputs)
        select_fill = host_scalar(fixed_inputs[self.select_fill.tensor_id]) if self.select_fill is not None else _NEG_INF
        return self.plan_for(fixed_inputs).bound(left, right, select_fill, window_fill).run

    def _saturated_scale(self, scale: float, query, key) -> float:
        """The scale operand under a softcap as the kernel takes it, by the functional API's rule
        (score_mods.saturating_scale): a Multiply's factor, or a Divide's divisor, whose 0 is an infinite
        factor."""
        if not self.scale_is_divisor:
            return score_mods.saturating_scale(scale, 1.0, query, key)
        if scale != 0.0:
            return scale
        factor = score_mods.saturating_scale(math.copysign(math.inf, scale), 1.0, query, key)
        return 1.0 / factor if math.isfinite(factor) else scale

    def execute(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray], replayed=None) -> None:
        """Runs the kernel on the ports' arrays; replayed: a length replay's plan for them (LengthReplay)."""
        m = self.match
        left, right, window_fill = self.window.values(inputs)
        plan = self.plan_for(inputs, replayed)
        if self.on_sycl:
            operands = {"query": inputs[m.query.tensor_id], "key": inputs[m.key.tensor_id],
                        "value": inputs[m.value.tensor_id], "output": outputs[m.output_id]}
            sycl_runtime.wait_for_producers(list(inputs.values()) + list(outputs.values()))
            data = [usm_address(a, name) for name, a in operands.items()]
            mask = usm_address(inputs[m.mask.tensor_id], "mask") if m.mask is not None else 0
            stats = usm_address(outputs[m.stats_id], "stats") if m.stats_id is not None else 0
            buffers = list(operands.values()) + [inputs[m.mask.tensor_id] if m.mask is not None else None,
                                                 outputs[m.stats_id] if m.stats_id is not None else None]
            extents = [None if a is None else sycl_runtime.usm_layout(a) for a in buffers]
            run = functools.partial(plan.run, extents=extents)
        else:
            run = plan.run_arrays
            data = [inputs[m.query.tensor_id], inputs[m.key.tensor_id], inputs[m.value.tensor_id], outputs[m.output_id]]
            mask = inputs[m.mask.tensor_id] if m.mask is not None else None
            stats = outputs[m.stats_id] if m.stats_id is not None else None
        scale = host_scalar(inputs[self.scale.tensor_id]) if self.scale is not None else 1.0
        if self.softcap is not None:
            scale = self._saturated_scale(scale, inputs[m.query.tensor_id], inputs[m.key.tensor_id])
        if self.dequants:
            run = functools.partial(run, kv_params=tuple(
                None if d is None or c is None else inputs[c.tensor_id]
                for d in (self.dequants.get("key"), self.dequants.get("value"))
                for c in ((None, None) if d is None else (d.scales, d.zps))))
        # Positional: the per-call cost of keyword parsing is visible on decode-sized calls.
        run(*data, mask, stats, scale,
            left, right,
            host_scalar(inputs[self.select_fill.tensor_id]) if self.select_fill is not None else _NEG_INF,
            window_fill,
            as_u64(inputs[self.dropout_seed.tensor_id]) if self.dropout_seed is not None else 0,
            as_u64(inputs[self.dropout_offset.tensor_id]) if self.dropout_offset is not None else 0)
