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

import numpy as np

from .. import _cpu, sycl_runtime
from ..dtypes import DTYPES, DataType, FLOAT_TYPES
from ..ops import OpKind
from ..ops.philox import bits64
from ..patterns.sdpa import InputChain, SdpaMatch
from .batch_fold import KERNEL_BATCH_DIMS, fold_batch_dims
from ..views import overlaps_itself, reshape_strides, transpose_strides, untranspose_strides



def plan_window(bounds) -> dict:
    """The window a plan is made for, before its calls give the bounds' values: a causal one where a right
    bound is matched, none otherwise (it steers only the plan's description; each call passes its own)."""
    return {"window_right": 0} if any(b.side == "right" for b in bounds) else {}


class NotUsable(Exception):
    """The fused kernel cannot take this partition; the message says why."""


@dataclass
class _View:
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def _apply_chain(chain: InputChain, lts, shapes) -> _View:
    lt = lts[chain.tensor_id]
    view = _View(lt.shape, lt.strides)
    for op in chain.ops:
        out_shape = shapes[op.outputs[0].id]
        if op.kind == OpKind.StaticTranspose:
            order = [a % len(view.shape) for a in op.attrs["order"]]
            view = _View(out_shape, transpose_strides(view.strides, order))
        else:
            strides = reshape_strides(view.shape, view.strides, out_shape)
            if strides is None:
                raise NotUsable(f"{op.where} would need a copy of tensor {chain.tensor_id} with strides {lt.strides}")
            view = _View(out_shape, strides)
    return view


def _swap_last(view: _View) -> _View:
    return _View(view.shape[:-2] + view.shape[-2:][::-1], view.strides[:-2] + view.strides[-2:][::-1])


def _kernel_strides(view: _View, batch: tuple[int, ...], rows: int, cols: int, name: str) -> tuple[int, ...]:
    """The strides of `view` broadcast to batch + (rows, cols), one per dim; size-1 dims get stride 0.
    fold_kernel_batch then brings the batch dims to the kernel's three."""
    rank = len(view.shape)
    if rank < 2 or rank - 2 > len(batch):
        raise NotUsable(f"{name} has rank {rank}; the kernel takes 2 to {len(batch) + 2}")
    strides = []
    for axis, size in enumerate(batch):
        view_axis = axis - (len(batch) + 2 - rank)
        dim = view.shape[view_axis] if view_axis >= 0 else 1
        if dim not in (1, size):
            raise NotUsable(f"{name} batch shape {view.shape[:-2]} does not broadcast to {tuple(batch)}")
        strides.append(view.strides[view_axis] if dim != 1 else 0)
    for dim, stride, want in ((view.shape[-2], view.strides[-2], rows), (view.shape[-1], view.strides[-1], cols)):
        if dim not in (1, want):
            raise NotUsable(f"{name} matrix shape {view.shape[-2:]} does not broadcast to ({rows}, {cols})")
        strides.append(stride if dim != 1 else 0)
    return tuple(strides)


def fold_kernel_batch(batch: tuple, views: dict) -> tuple[tuple, dict]:
    """(the kernel's three batch dims, views with five strides each) for views of (dtype code, strides over
    batch + 2 dims); NotUsable where the batch dims do not fold into three."""
    names = list(views)
    folded = fold_batch_dims(tuple(batch), [list(views[n][1][:-2]) for n in names])
    if folded is None:
        raise NotUsable(f"batch dims {tuple(batch)} do not fold into {KERNEL_BATCH_DIMS}: the operands' strides "
                        "walk them differently")
    kernel_batch, strides = folded
    return kernel_batch, {n: (views[n][0], tuple(st) + tuple(views[n][1][-2:])) for n, st in zip(names, strides)}


def output_view(out, output_ops, shapes) -> _View:
    """The view of a partition output as the op before `output_ops` (view ops) produced it: reorders and
    reshapes after a kernel's result are folded into its output strides."""
    view = _View(out.shape, out.strides)
    for op in reversed(output_ops):
        in_shape = shapes[op.inputs[0].id]
        if op.kind == OpKind.StaticTranspose:
            order = [a % len(in_shape) for a in op.attrs["order"]]
            view = _View(in_shape, untranspose_strides(view.strides, order))
        else:
            strides = reshape_strides(view.shape, view.strides, in_shape)
            if strides is None:
                raise NotUsable(f"{op.where}: output strides {out.strides} cannot be reached without a copy")
            view = _View(in_shape, strides)
    return view


def _scalar_chain(chain: InputChain | None, lts, what: str) -> InputChain | None:
    if chain is not None and lts[chain.tensor_id].numel() != 1:
        raise NotUsable(f"{what} (tensor {chain.tensor_id}) has shape {lts[chain.tensor_id].shape}; "
                        "the kernel takes a single value")
    return chain


def _code(dtype: DataType, allowed, what: str) -> int:
    if dtype not in allowed:
        raise NotUsable(f"{what} dtype {dtype.value} is not supported by the kernel")
    return DTYPES[dtype].kernel_code


def _host(array) -> np.ndarray:
    """A scalar operand on the host (a USM one is copied, which waits for its producer)."""
    return array if isinstance(array, np.ndarray) else sycl_runtime.to_host(array)


_NEG_INF = float("-inf")


def _scalar(array) -> float:
    return _host(array).item()  # a one-element array of any rank


def _u64(array) -> int:
    """An s64 seed or offset tensor's value as the 64-bit pattern the Philox key/counter takes."""
    return bits64(_host(array).reshape(-1)[0])


class WindowOperands:
    """A match's key window bounds as the kernel takes them (see graphattn/key_window.hpp): the scalar
    operands of each bound, read per call into (left, right, fill) about the row itself."""

    def __init__(self, bounds, lts):
        self.bounds = [(b.side, b.adjust, [(_scalar_chain(c, lts, "key window index offset"), sign)
                                           for c, sign in b.terms],
                        _scalar_chain(b.fill, lts, "key window fill value")) for b in bounds]

    def __bool__(self) -> bool:
        return bool(self.bounds)

    def values(self, inputs: dict) -> tuple[int, int, float]:
        """(left, right, fill): row i sees keys i - left <= j <= i + right, _cpu.NO_KEY_LIMIT for a side
        without a bound; the other scores become the fill, one value for both bounds."""
        left = right = _cpu.NO_KEY_LIMIT
        fills = []
        for side, adjust, terms, fill in self.bounds:
            offset = adjust + sum(sign * int(_scalar(inputs[c.tensor_id])) for c, sign in terms)
            if side == "right":  # j - i <= offset
                right = offset
            else:  # j - i >= offset
                left = -offset
            fills.append(float(_scalar(inputs[fill.tensor_id])))
        if len(fills) == 2 and fills[0] != fills[1] and not (np.isnan(fills[0]) and np.isnan(fills[1])):
            raise ValueError(f"the key window's two bounds fill hidden scores with {fills[0]} and {fills[1]}; "
                             "the fused kernel takes one fill value for both")
        return left, right, fills[0] if fills else _NEG_INF


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


class FusedSdpaForward:
    """Runs one matched SDPA forward partition with graphattn::sdpa_forward."""

    name = "sdpa_forward_cpu"

    def __init__(self, match: SdpaMatch, lts: dict, shapes: dict, engine=None):
        self.match = match
        m = match
        q = _apply_chain(m.query, lts, shapes)
        k = _apply_chain(m.key, lts, shapes)
        v = _apply_chain(m.value, lts, shapes)
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
        views = {
            "query": (_code(lts[m.query.tensor_id].dtype, FLOAT_TYPES, "query"),
                      _kernel_strides(q, batch, seq_q, head_dim, "query")),
            "key": (_code(lts[m.key.tensor_id].dtype, FLOAT_TYPES, "key"),
                    _kernel_strides(k, batch, seq_kv, head_dim, "key")),
            "value": (_code(lts[m.value.tensor_id].dtype, FLOAT_TYPES, "value"),
                      _kernel_strides(v, batch, seq_kv, head_dim_v, "value")),
            "output": (_code(lts[m.output_id].dtype, FLOAT_TYPES, "output"),
                       _kernel_strides(output_view(lts[m.output_id], m.output_ops, shapes), batch, seq_q, head_dim_v, "output")),
        }
        if m.mask is not None:
            allowed = FLOAT_TYPES if m.mask_kind == "additive" else {DataType.boolean}
            views["mask"] = (_code(lts[m.mask.tensor_id].dtype, allowed, "mask"),
                             _kernel_strides(_apply_chain(m.mask, lts, shapes), batch, seq_q, seq_kv, "mask"))
        if m.stats_id is not None:
            stats = lts[m.stats_id]
            views["stats"] = (_code(stats.dtype, {DataType.f32}, "stats"),
                              _kernel_strides(_View(stats.shape, stats.strides), batch, seq_q, 1, "stats"))
            if overlaps_itself(tuple(batch) + (seq_q, 1), views["stats"][1]):
                # V's batch dims broadcast the output beyond the scores: the kernel would write each row's
                # stats once per output batch index, from several threads.
                raise NotUsable(f"stats {stats.shape} would be written once per index of the output's batch "
                                f"{tuple(batch)}")
        self.scale = _scalar_chain(m.scale, lts, "scale")
        self.select_fill = _scalar_chain(m.select_fill, lts, "Select fill value")
        self.window = WindowOperands(m.bounds, lts)
        padded, views = fold_kernel_batch(batch, views)
        input_dtypes = {lts[c.tensor_id].dtype for c in (m.query, m.key, m.value)}
        self.on_sycl = engine is not None and engine.is_sycl
        plan_type = _cpu.ForwardPlan
        if self.on_sycl:
            check_sycl_usable(input_dtypes, head_dim, head_dim_v)
            queue = engine.queue
            plan_type = functools.partial(sycl_runtime.plugin().ForwardPlan, queue)
        self.plan = plan_type(
            padded, seq_q, seq_kv, head_dim, head_dim_v, views["query"], views["key"], views["value"],
            views["output"], views.get("mask"), views.get("stats"),
            mask_kind=_cpu.MASK_KIND_CODES[m.mask_kind], select_keep_value=m.select_keep_value,
            has_scale=m.scale is not None, scale_is_divisor=m.scale_op is not None and m.scale_op.kind == OpKind.Divide,
            **plan_window(m.bounds), inf_as_zero=m.softmax.attrs["mode"] == "inf_as_zero",
            dropout_p=m.dropout_op.attrs["p"] if m.dropout_op is not None else 0.0)
        self.dropout_seed = _scalar_chain(m.dropout_seed, lts, "Dropout seed")
        self.dropout_offset = _scalar_chain(m.dropout_offset, lts, "Dropout offset")
        if self.on_sycl:
            self.name = "sdpa_forward_sycl"
            self.isa = self.plan.kernel_name()
        else:
            self.isa = self.plan.isa()
        self.shape_text = (f"batch={'x'.join(map(str, batch))},sq={seq_q},skv={seq_kv},d={head_dim},dv={head_dim_v},"
                           f"dtype={lts[m.query.tensor_id].dtype.value},mask={m.mask_kind},"
                           f"window={'+'.join(b.side for b in m.bounds) or 'none'}")

    def dispatch_text(self) -> str:
        """isa=<build> and, on the CPU, why=<the rule that chose it> and the work layout (for the verbose log)."""
        return f"isa={self.isa}" if self.on_sycl else self.plan.dispatch_text()

    def bound_runner(self, fixed_inputs: dict):
        """run(query, key, value, output, mask, stats, scale, dropout_seed, dropout_offset): execute's kernel
        call for calls whose other operands (fill values, key window offsets) are always those in
        fixed_inputs, with their lookups done once here.  None on SYCL (execute also orders the queue there)."""
        if self.on_sycl:
            return None
        left, right, window_fill = self.window.values(fixed_inputs)
        select_fill = _scalar(fixed_inputs[self.select_fill.tensor_id]) if self.select_fill is not None else _NEG_INF
        return self.plan.bound(left, right, select_fill, window_fill).run

    def execute(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> None:
        m = self.match
        left, right, window_fill = self.window.values(inputs)
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
            run = functools.partial(self.plan.run, extents=extents)
        else:
            run = self.plan.run_arrays
            data = [inputs[m.query.tensor_id], inputs[m.key.tensor_id], inputs[m.value.tensor_id], outputs[m.output_id]]
            mask = inputs[m.mask.tensor_id] if m.mask is not None else None
            stats = outputs[m.stats_id] if m.stats_id is not None else None
        # Positional: the per-call cost of keyword parsing is visible on decode-sized calls.
        run(*data, mask, stats,
            _scalar(inputs[self.scale.tensor_id]) if self.scale is not None else 1.0,
            left, right,
            _scalar(inputs[self.select_fill.tensor_id]) if self.select_fill is not None else _NEG_INF,
            window_fill,
            _u64(inputs[self.dropout_seed.tensor_id]) if self.dropout_seed is not None else 0,
            _u64(inputs[self.dropout_offset.tensor_id]) if self.dropout_offset is not None else 0)
