"""One description of an attention call, and the one lowering that turns it into a kernel call.

Three producers describe calls as an AttentionSpec:

    forward_call.py          scaled_dot_product_attention            -> forward spec
    functional_backward.py   scaled_dot_product_attention_backward   -> backward spec
    kernels/fused_sdpa*.py   a partition the pattern matcher fused   -> forward or backward spec

and `lower` turns each into a KernelCall: the kernel's three batch dims (any number of the call's batch dims
folded where every operand's strides walk them as one), each operand's dtype code and five strides, the
flags, and the key window about the row itself.  NotUsable says why where the kernel cannot take a spec;
the producer then copies operands (functional) or runs the reference executor (graph API).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from . import _cpu, key_window, sycl_runtime
from .dtypes import DTYPES, DataType, FLOAT_TYPES
from .kernels.batch_fold import KERNEL_BATCH_DIMS, fold_batch_dims
from .views import overlaps_itself

MASK_KINDS = ("none", "additive", "select")
# The roles a forward reads and writes; a backward reads all of them (output and stats as inputs) and writes
# the gradients.
# alibi_slopes and sinks (score_mods.py) hold one f32 value per batch index: matrices of (1, 1).
FORWARD_ROLES = ("query", "key", "value", "output", "mask", "stats", "alibi_slopes", "sinks")
BACKWARD_ROLES = FORWARD_ROLES + ("grad_output", "grad_query", "grad_key", "grad_value", "grad_mask", "grad_sinks")
PER_INDEX_ROLES = ("alibi_slopes", "sinks", "grad_sinks")
# Written roles that take one element per index of the batch: dK and dV may repeat over batch dims (stride 0),
# where the kernel sums the gradient of K and V shared by a GQA group.
WRITTEN_ONCE = {"forward": ("output", "stats"), "backward": ("grad_query", "grad_mask")}


class NotUsable(Exception):
    """The fused kernel cannot take this call; the message says why."""


@dataclass(frozen=True)
class Operand:
    """One tensor of a call as its producer sees it: dtype, shape (rank 2 or more; its batch dims broadcast to
    the call's) and element strides.  origin, where the producer views the caller's array in another shape
    (GQA's split heads): for each dim, (the array's axis, multiplier) such that the dim's stride is the
    multiplier times the array's stride on that axis, or None for a dim of size 1; None: the dims are the
    array's own.  It lets a call's layout be replayed for new lengths from the arrays' strides
    (_cpu.ForwardPlan.length_free)."""
    dtype: DataType
    shape: tuple
    strides: tuple
    origin: tuple | None = None


@dataclass(frozen=True)
class AttentionSpec:
    """What fixes a kernel call, data aside.

    batch: the call's batch dims, any number (the broadcast of every operand's); operands: role -> Operand,
    roles from FORWARD_ROLES (and BACKWARD_ROLES for a backward), a dim of size 1 broadcasting; mask_kind:
    "none", "additive" (added to the scores) or "select" (a bool mask keeping where it equals
    select_keep_value); scale: multiplied in (scale_is_divisor: divided), or none (has_scale False); window:
    the key window (left, right) about the aligned row, None for an open side (every int is a bound, -1 too: a
    row whose first key is one past its own); alignment: how rows align to keys for the window and ALiBi,
    "top_left", "bottom_right" (the kernel shifts the rows by S_kv - S_q of the call's own lengths, so a plan
    holds at any length) or "as_given" (the window is about the row itself: a graph's, given per call, its
    spec holding the plan's, causal where a right bound was matched); inf_as_zero: rows that see no key give
    0; dropout_p: the dropout probability (seed and offset come per call); softcap: c of the softcap (0.0:
    none); the alibi_slopes operand gives ALiBi's slopes.
    """
    pass_name: str
    batch: tuple
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    operands: dict
    mask_kind: str = "none"
    select_keep_value: bool = True
    has_scale: bool = True
    scale_is_divisor: bool = False
    window: tuple = (None, None)
    inf_as_zero: bool = True
    dropout_p: float = 0.0
    softcap: float = 0.0
    alignment: str = "as_given"


@dataclass
class KernelCall:
    """A lowered spec: what native/cpu's ForwardPlan and backward take."""
    batch: tuple                 # KERNEL_BATCH_DIMS dims
    call_batch: tuple            # the spec's batch dims, before folding
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    roles: dict                  # role -> (dtype code, 5 strides)
    options: dict                # the kernel's flags and window, as keyword arguments
    text_fields: tuple           # (query's dtype name, mask kind), for shape_text
    # For a replay at other lengths (_cpu.ForwardPlan.length_free): role -> 5 sources of its strides, each (array axis,
    # multiplier) or None (stride 0), and the folds to re-check, (role, outer source, inner source, inner
    # size): batch dims merged into one kernel dim hold only while the outer stride is the inner one times its
    # size.
    sources: dict
    folds: tuple

    @property
    def shape_text(self) -> str:
        """The call's shape for the verbose log."""
        return self.shape_text_for(self.seq_q, self.seq_kv, self.options["window_left"], self.options["window_right"])

    def shape_text_for(self, seq_q: int, seq_kv: int, left: int, right: int) -> str:
        """The shape text of this call with other lengths and kernel window (a length-free plan's)."""
        batch, (dtype, mask_kind) = self.call_batch, self.text_fields
        no_limit = _cpu.NO_KEY_LIMIT
        window = "x".join("open" if w == no_limit else str(w) for w in (left, right))
        return (f"batch={'x'.join(map(str, batch))},sq={seq_q},skv={seq_kv},d={self.head_dim},"
                f"dv={self.head_dim_v},dtype={dtype},mask={mask_kind},window={window}")

    def forward_plan(self, queue=None):
        """The forward kernel's plan for this call: native/cpu's, or the SYCL plugin's on a dpctl queue."""
        plan_type = _cpu.ForwardPlan if queue is None else functools.partial(sycl_runtime.plugin().ForwardPlan,
                                                                             queue)
        r = self.roles
        return plan_type(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v, r["query"], r["key"],
                         r["value"], r["output"], r.get("mask"), r.get("stats"), r.get("alibi_slopes"),
                         r.get("sinks"), **self.options)

    def backward_plan(self):
        """The host backward kernel's plan for this call (native/cpu's BackwardPlan)."""
        options = {k: v for k, v in self.options.items() if k != "scale_is_divisor"}
        return _cpu.BackwardPlan(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v, self.roles,
                                 **options)

    def backward_dispatch_text(self) -> str:
        """The backward's kernel choice and key pass for this call (the verbose log)."""
        options = {k: v for k, v in self.options.items() if k != "scale_is_divisor"}
        return _cpu.backward_dispatch_text(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v,
                                           self.roles, **options)

    def run_backward(self, run, specs: dict, **runtime) -> None:
        """One SYCL backward kernel call (run: the plugin's backward on a queue) on specs: role -> (code,
        strides, USM address); runtime gives scale, window values, fills and dropout's seed and offset.  The
        host's kernel takes a BackwardPlan (backward_plan)."""
        options = {k: v for k, v in self.options.items() if k not in ("scale_is_divisor", "window_left",
                                                                        "window_right")}
        runtime.setdefault("window_left", self.options["window_left"])
        runtime.setdefault("window_right", self.options["window_right"])
        run(self.batch, self.seq_q, self.seq_kv, self.head_dim, self.head_dim_v, specs, **options, **runtime)


def default_scale(head_dim: int) -> float:
    """The scale of a call that gives none: 1 / sqrt(E), E the query's head size (PyTorch's rule)."""
    return 1.0 / math.sqrt(head_dim)


def kernel_window(bounds: tuple) -> tuple:
    """A call's (left, right) window (key_window.effective_window's, about the aligned row) as a spec holds it:
    None for an open side.  The alignment goes to the kernel as it is (AttentionSpec.alignment), which shifts
    the rows for each call's lengths."""
    return tuple(None if side == key_window.NO_LIMIT else side for side in bounds)


def _allowed(role: str, mask_kind: str) -> frozenset:
    if role in ("stats", "grad_mask") or role in PER_INDEX_ROLES:
        return frozenset({DataType.f32})
    if role == "mask":
        return FLOAT_TYPES if mask_kind == "additive" else frozenset({DataType.boolean})
    return FLOAT_TYPES


def _matrix(spec: AttentionSpec, role: str) -> tuple[int, int]:
    """The (rows, cols) an operand of this role has in the kernel."""
    if role in PER_INDEX_ROLES:
        return 1, 1
    rows = spec.seq_kv if role in ("key", "value", "grad_key", "grad_value") else spec.seq_q
    if role in ("mask", "grad_mask"):
        return rows, spec.seq_kv
    if role == "stats":
        return rows, 1
    return rows, (spec.head_dim_v if role in ("value", "output", "grad_output", "grad_value") else spec.head_dim)


def _broadcast_axes(operand: Operand, batch: tuple, rows: int, cols: int, role: str) -> list:
    """For each dim of batch + (rows, cols), the operand's axis that walks it, or None where the operand
    broadcasts it (a size-1 dim or one it lacks)."""
    rank = len(operand.shape)
    if rank < 2 or rank - 2 > len(batch):
        raise NotUsable(f"{role} has rank {rank}; the kernel takes 2 to {len(batch) + 2}")
    axes = []
    for axis, size in enumerate(batch):
        own = axis - (len(batch) + 2 - rank)
        dim = operand.shape[own] if own >= 0 else 1
        if dim not in (1, size):
            raise NotUsable(f"{role} batch shape {operand.shape[:-2]} does not broadcast to {tuple(batch)}")
        axes.append(own if dim != 1 else None)
    for axis, want in ((rank - 2, rows), (rank - 1, cols)):
        if operand.shape[axis] not in (1, want):
            raise NotUsable(f"{role} matrix shape {operand.shape[-2:]} does not broadcast to ({rows}, {cols})")
        axes.append(axis if operand.shape[axis] != 1 else None)
    return axes


def broadcast_strides(operand: Operand, batch: tuple, rows: int, cols: int, role: str) -> tuple:
    """The operand's strides broadcast to batch + (rows, cols), one per dim; size-1 dims get stride 0."""
    return tuple(0 if a is None else operand.strides[a] for a in _broadcast_axes(operand, batch, rows, cols, role))


def lower(spec: AttentionSpec) -> KernelCall:
    """The kernel call of a spec; NotUsable with the reason where the kernel cannot take it."""
    if spec.mask_kind not in MASK_KINDS:
        raise ValueError(f"mask_kind must be one of {MASK_KINDS}, got {spec.mask_kind!r}")
    if (spec.mask_kind == "none") == ("mask" in spec.operands):
        raise ValueError(f"mask_kind {spec.mask_kind!r} with{'out' if 'mask' not in spec.operands else ''} a mask")
    known = FORWARD_ROLES if spec.pass_name == "forward" else BACKWARD_ROLES
    unknown = set(spec.operands) - set(known)
    if unknown:
        raise ValueError(f"a {spec.pass_name} spec has no roles {sorted(unknown)}")
    full = {}
    codes = {}
    sources = {}  # role -> for each dim of full[role], (array axis, multiplier) or None
    for role, operand in spec.operands.items():
        if operand.dtype not in _allowed(role, spec.mask_kind):
            raise NotUsable(f"{role} dtype {operand.dtype.value} is not supported by the kernel")
        codes[role] = DTYPES[operand.dtype].kernel_code
        axes = _broadcast_axes(operand, spec.batch, *_matrix(spec, role), role)
        full[role] = tuple(0 if a is None else operand.strides[a] for a in axes)
        origin = operand.origin
        sources[role] = [None if a is None else (a, 1) if origin is None else origin[a] for a in axes]
    for role in WRITTEN_ONCE[spec.pass_name]:
        if role in full and overlaps_itself(tuple(spec.batch) + _matrix(spec, role), full[role]):
            raise NotUsable(f"{role} {spec.operands[role].shape} would be written more than once per element over "
                            f"the batch {tuple(spec.batch)}")
    roles = list(full)
    folded = fold_batch_dims(tuple(spec.batch), [list(full[r][:-2]) for r in roles])
    if folded is None:
        raise NotUsable(f"batch dims {tuple(spec.batch)} do not fold into {KERNEL_BATCH_DIMS}: the operands' "
                        "strides walk them differently")
    kernel_batch, batch_strides, groups = folded
    kernel_sources = {r: tuple(sources[r][axes[-1]] if axes else None for axes in groups) + tuple(sources[r][-2:])
                      for r in roles}
    folds = tuple((r, sources[r][outer], sources[r][inner], spec.batch[inner])
                  for axes in groups for outer, inner in zip(axes, axes[1:]) for r in roles)
    no_limit = _cpu.NO_KEY_LIMIT
    left, right = spec.window
    options = dict(mask_kind=_cpu.MASK_KIND_CODES[spec.mask_kind], select_keep_value=spec.select_keep_value,
                   has_scale=spec.has_scale, scale_is_divisor=spec.scale_is_divisor,
                   window_left=no_limit if left is None else left,
                   window_right=no_limit if right is None else right,
                   inf_as_zero=spec.inf_as_zero, dropout_p=spec.dropout_p, softcap=spec.softcap,
                   alignment=_cpu.ROW_ALIGNMENTS[spec.alignment])
    text_fields = (spec.operands["query"].dtype.value, spec.mask_kind)
    return KernelCall(kernel_batch, tuple(spec.batch), spec.seq_q, spec.seq_kv, spec.head_dim, spec.head_dim_v,
                      {r: (codes[r], tuple(bst) + full[r][-2:]) for r, bst in zip(roles, batch_strides)},
                      options, text_fields, kernel_sources, folds)


def lower_as_given_or_copied(describe) -> tuple[KernelCall, object]:
    """The kernel call of describe(False), the operands as the caller gave them, or, where the kernel cannot
    walk those strides, of describe(True), the operands the producer then copies contiguous (which always
    folds).  describe(copied) returns (spec, what the producer needs to know of that choice)."""
    spec, extras = describe(False)
    try:
        return lower(spec), extras
    except NotUsable:
        spec, extras = describe(True)
        return lower(spec), extras
