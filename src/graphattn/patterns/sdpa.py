"""The SDPA forward pattern of the oneDNN Graph spec, matched around each SoftMax:

    MatMul(Q, K) -> [Multiply | Divide by scale]
                 -> [softcap: Divide by c -> Tanh -> Multiply by c]
                 -> [Add float mask | Select bool mask]
                 -> [key window bound Select]...
                 -> SoftMax[+stats] -> [Dropout] -> MatMul(P, V) -> [StaticTranspose] [StaticReshape]

K and V may each come straight from a DynamicDequantize (oneDNN's compressed-KV SDPA: per group along the
head size, K as (N, H, S, D) with group_shape [.., 1, G] and transpose_b, or as the (N, H, D, S) view with
[.., G, 1]); the partition then takes its src, scales and zps, and the kernel decodes the bytes itself.

Each external input may arrive through StaticReshape / StaticTranspose ops
(the 4D GQA form reshapes Q to (N, Hkv, rep, S, D) and K/V to (N, Hkv, 1, S, D)).
A key window bound is GenIndex(row), GenIndex(col), optional Add/Subtract of
scalar tensors on either index, GreaterEqual or GreaterThan, and Select with a
fill value.  It keeps scores with j - i <= offset (a right bound: causal is
offset 0 top-left, s_kv - s_q bottom-right) or j - i >= offset (a left bound:
a sliding window of W keys is offset -(W - 1) on top of the causal bound).
Bounds chain, one Select after another, after any mask; the kernel takes at
most one of each side, with one fill value.

    score --[Select(GreaterEqual(row', col), score, fill)]--> (right bound)
          --[Select(GreaterEqual(col, row' - left), score, fill)]--> (left bound) --> SoftMax
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import Op, OpKind

VIEW_KINDS = (OpKind.StaticReshape, OpKind.StaticTranspose)
SCALE_KINDS = (OpKind.Multiply, OpKind.Divide)


@dataclass
class InputChain:
    """A partition input and the view ops that lead from it to its use."""
    tensor_id: int
    ops: list[Op] = field(default_factory=list)


@dataclass
class KeyBound:
    """One bound of the key window: keep(i, j) iff j - i <= offset (side "right") or j - i >= offset (side
    "left"), offset = sum(sign * value(tensor)) + adjust; other scores become the fill."""
    side: str
    terms: list[tuple[InputChain, int]]
    adjust: int
    fill: InputChain
    ops: list[Op]
    select: Op


@dataclass
class DequantMatch:
    """A DynamicDequantize that feeds K or V straight into the pattern (oneDNN's compressed-KV SDPA): the
    kernel reads src's bytes and decodes them by scales and zps as it goes."""
    op: Op
    src: InputChain
    scales: InputChain
    zps: InputChain | None


@dataclass
class SdpaMatch:
    qk: Op
    softmax: Op
    pv: Op
    query: InputChain
    key: InputChain
    value: InputChain
    scale_op: Op | None = None
    scale: InputChain | None = None
    softcap_ops: list[Op] = field(default_factory=list)  # Divide, Tanh, Multiply (graphattn/score_mods.hpp)
    softcap_divisor: InputChain | None = None
    softcap_multiplier: InputChain | None = None
    mask_op: Op | None = None
    mask_kind: str = "none"          # none | additive | select
    mask: InputChain | None = None
    select_keep_value: bool = True   # Select keeps the score where the mask equals this
    select_fill: InputChain | None = None
    bounds: list[KeyBound] = field(default_factory=list)  # at most one per side
    output_ops: list[Op] = field(default_factory=list)
    output_id: int = -1
    stats_id: int | None = None
    dropout_op: Op | None = None       # Dropout between SoftMax and MatMul(P, V)
    dropout_seed: InputChain | None = None
    dropout_offset: InputChain | None = None
    key_dequant: DequantMatch | None = None    # key and value then are the DynamicDequantize's src
    value_dequant: DequantMatch | None = None
    notes: list[str] = field(default_factory=list)  # why ops before the pattern stay out of it (verbose log)

    def all_ops(self) -> list[Op]:
        ops = [self.qk, self.softmax, self.pv]
        ops += [d.op for d in (self.key_dequant, self.value_dequant) if d is not None]
        ops += [op for op in (self.scale_op, self.mask_op, self.dropout_op) if op is not None] + self.softcap_ops
        for chain in self.input_chains():
            ops += chain.ops
        ops += [op for bound in self.bounds for op in [bound.select] + bound.ops]
        return unique_ops(ops + self.output_ops)

    def input_chains(self) -> list[InputChain]:
        chains = [self.query, self.key, self.value, self.scale, self.softcap_divisor, self.softcap_multiplier,
                  self.mask, self.select_fill, self.dropout_seed, self.dropout_offset]
        for d in (self.key_dequant, self.value_dequant):
            if d is not None:
                chains += [d.scales, d.zps]
        for bound in self.bounds:
            chains += [bound.fill] + [c for c, _ in bound.terms]
        return [c for c in chains if c is not None]


class NoMatch(Exception):
    """The subgraph around a SoftMax is not the SDPA pattern; the message says why."""


def _sole_consumer(graph, tensor_id: int, what: str) -> Op:
    consumers = graph.consumers(tensor_id)
    if len(consumers) != 1:
        raise NoMatch(f"{what} (tensor {tensor_id}) has {len(consumers)} consumers, the pattern needs 1")
    return consumers[0]


def input_chain(graph, tensor_id: int, uses: int = 1) -> InputChain:
    """Walks up through view ops whose output is used only by the next op of the chain; the first
    tensor may have `uses` consumers (all of them inside the pattern, as the caller ensures)."""
    ops: list[Op] = []
    current = tensor_id
    while True:
        producer = graph.producer(current)
        allowed = uses if current == tensor_id else 1
        if producer is None or producer.kind not in VIEW_KINDS or len(graph.consumers(current)) != allowed \
                or graph.is_marked_output(current):
            return InputChain(current, list(reversed(ops)))
        ops.append(producer)
        current = producer.inputs[0].id


def output_chain(graph, tensor_id: int) -> tuple[list[Op], int]:
    ops: list[Op] = []
    current = tensor_id
    while not graph.is_marked_output(current):
        consumers = graph.consumers(current)
        if len(consumers) != 1 or consumers[0].kind not in VIEW_KINDS:
            break
        ops.append(consumers[0])
        current = consumers[0].outputs[0].id
    return ops, current


def _trace_softcap(graph, tensor_id: int, match_parts: dict) -> int:
    """A softcap Multiply(Tanh(Divide(s, c)), c) that produces tensor_id: recorded in match_parts; returns the id
    of s (tensor_id itself without a softcap)."""
    multiply = graph.producer(tensor_id)
    if multiply is None or multiply.kind != OpKind.Multiply:
        return tensor_id
    for side in (0, 1):
        tanh = graph.producer(multiply.inputs[side].id)
        if tanh is None or tanh.kind != OpKind.Tanh:
            continue
        divide = graph.producer(tanh.inputs[0].id)
        if divide is None or divide.kind != OpKind.Divide:
            raise NoMatch(f"{tanh.where} does not take the scores divided by a softcap")
        match_parts.update(softcap_ops=[divide, tanh, multiply],
                           softcap_divisor=input_chain(graph, divide.inputs[1].id),
                           softcap_multiplier=input_chain(graph, multiply.inputs[1 - side].id))
        return divide.inputs[0].id
    return tensor_id


def _trace_scores(graph, tensor_id: int, match_parts: dict) -> None:
    """From the masked-score tensor up to MatMul(Q, K): optional softcap, optional scale, then the MatMul."""
    tensor_id = _trace_softcap(graph, tensor_id, match_parts)
    producer = graph.producer(tensor_id)
    if producer is not None and producer.kind in SCALE_KINDS:
        scale_op = producer
        candidates = [0, 1] if producer.kind == OpKind.Multiply else [0]
        for score_index in candidates:
            inner = graph.producer(producer.inputs[score_index].id)
            if inner is not None and inner.kind == OpKind.MatMul:
                match_parts["scale_op"] = scale_op
                match_parts["scale"] = input_chain(graph, producer.inputs[1 - score_index].id)
                match_parts["qk"] = inner
                return
        raise NoMatch(f"{producer.where} does not scale the output of a MatMul")
    if producer is not None and producer.kind == OpKind.MatMul:
        match_parts["qk"] = producer
        return
    raise NoMatch(f"tensor {tensor_id} before the mask is not produced by MatMul or a scale op")


def _score_side(graph, op: Op, indices) -> int | None:
    for i in indices:
        producer = graph.producer(op.inputs[i].id)
        if producer is not None and producer.kind in SCALE_KINDS + (OpKind.MatMul,):
            return i
    return None


def _index_expr(graph, tensor_id: int, score_ids: set[int] | None):
    """(axis 'row'|'col', [(chain, sign)], ops) for GenIndex [+/- scalar inputs]; GenIndex must index one of
    score_ids (None: checked by the caller)."""
    producer = graph.producer(tensor_id)
    if producer is None:
        raise NoMatch(f"key window index tensor {tensor_id} has no producer")
    if producer.kind == OpKind.GenIndex:
        if score_ids is not None and producer.inputs[0].id not in score_ids:
            raise NoMatch(f"{producer.where} does not index the attention scores")
        rank = producer.inputs[0].ndim
        axis = producer.attrs["axis"] % rank
        if axis not in (rank - 2, rank - 1):
            raise NoMatch(f"{producer.where} indexes axis {axis}, not a sequence axis")
        return ("row" if axis == rank - 2 else "col"), [], [producer]
    if producer.kind in (OpKind.Add, OpKind.Subtract):
        sides = [0, 1] if producer.kind == OpKind.Add else [0]
        for expr_side in sides:
            try:
                axis, terms, ops = _index_expr(graph, producer.inputs[expr_side].id, score_ids)
            except NoMatch:
                continue
            sign = -1 if producer.kind == OpKind.Subtract else 1
            term = input_chain(graph, producer.inputs[1 - expr_side].id)
            return axis, terms + [(term, sign)], ops + term.ops + [producer]
    raise NoMatch(f"{producer.where} is not part of a key window bound")


def _key_bound(graph, select: Op, compare: Op, score_side: int) -> KeyBound:
    lhs_axis, lhs_terms, lhs_ops = _index_expr(graph, compare.inputs[0].id, None)
    rhs_axis, rhs_terms, rhs_ops = _index_expr(graph, compare.inputs[1].id, None)
    if {lhs_axis, rhs_axis} != {"row", "col"}:
        raise NoMatch(f"{compare.where} must compare a row index with a column index")
    row_terms, col_terms = (lhs_terms, rhs_terms) if lhs_axis == "row" else (rhs_terms, lhs_terms)
    terms = row_terms + [(chain, -sign) for chain, sign in col_terms]
    strict = compare.kind == OpKind.GreaterThan
    # cond is (row + A) >= (col + B), i.e. j - i <= A - B (a right bound), or the mirrored form
    # (col + B) >= (row + A), i.e. j - i >= A - B (a left bound); GreaterThan moves the offset by one.
    if lhs_axis == "row":
        side, adjust = "right", (-1 if strict else 0)
    else:
        side, adjust = "left", (1 if strict else 0)
    if score_side == 2:  # Select(cond, fill, score): the score survives where cond is false
        side, adjust = ("left", adjust + 1) if side == "right" else ("right", adjust - 1)
    fill = input_chain(graph, select.inputs[3 - score_side].id)
    ops = [compare] + lhs_ops + rhs_ops + fill.ops
    return KeyBound(side, terms, adjust, fill, ops, select)


def unique_ops(ops: list[Op]) -> list[Op]:
    """Each op once, in order: the window's two bounds may share their GenIndex, row shift and fill."""
    return list({op.id: op for op in ops}.values())


def _is_index_compare(graph, op: Op | None) -> bool:
    return op is not None and op.kind in (OpKind.GreaterEqual, OpKind.GreaterThan) \
        and any(graph.producer(t.id) is not None for t in op.inputs)


def match_masked_scores(graph, masked: int, parts: dict) -> None:
    """From the masked-score tensor up to MatMul(Q, K): the key window's bound Selects (any chain of them,
    at most one per side), then the optional mask (float Add or bool Select) and scale; fills `parts` with
    the SdpaMatch fields it found, and "qk"."""
    bounds: list[KeyBound] = []
    mask_op = graph.producer(masked)
    while mask_op is not None and mask_op.kind == OpKind.Select and _is_index_compare(
            graph, graph.producer(mask_op.inputs[0].id)):
        score_side = _score_side_of_bound(graph, mask_op)
        bounds.append(_key_bound(graph, mask_op, graph.producer(mask_op.inputs[0].id), score_side))
        masked = mask_op.inputs[score_side].id
        mask_op = graph.producer(masked)
    if bounds:
        sides = [b.side for b in bounds]
        if len(set(sides)) != len(sides):
            raise NoMatch(f"{len(bounds)} key window bounds with sides {sides}; the kernel takes one per side")
        parts["bounds"] = bounds
    if mask_op is not None and mask_op.kind == OpKind.Select:
        score_side = _score_side(graph, mask_op, (1, 2))
        if score_side is None:
            raise NoMatch(f"{mask_op.where} selects between no attention scores")
        _trace_scores(graph, mask_op.inputs[score_side].id, parts)
        parts["mask_kind"] = "select"
        parts["mask"] = input_chain(graph, mask_op.inputs[0].id)
        parts["select_keep_value"] = score_side == 1
        parts["select_fill"] = input_chain(graph, mask_op.inputs[3 - score_side].id)
        parts["mask_op"] = mask_op
    elif mask_op is not None and mask_op.kind == OpKind.Add:
        score_side = _score_side(graph, mask_op, (0, 1))
        if score_side is None:
            raise NoMatch(f"{mask_op.where} adds no attention scores")
        _trace_scores(graph, mask_op.inputs[score_side].id, parts)
        parts.update(mask_op=mask_op, mask_kind="additive",
                     mask=input_chain(graph, mask_op.inputs[1 - score_side].id))
    else:
        _trace_scores(graph, masked, parts)
    # GenIndex must index scores of the pattern: the MatMul's, or those of a later op before SoftMax.
    score_ids = {op.outputs[0].id for op in (parts["qk"], parts.get("scale_op"), parts.get("mask_op"))
                 if op is not None} | {b.select.outputs[0].id for b in bounds} | \
        {op.outputs[0].id for op in parts.get("softcap_ops", [])[-1:]}
    for bound in bounds:
        for op in bound.ops:
            if op.kind == OpKind.GenIndex and op.inputs[0].id not in score_ids:
                raise NoMatch(f"{op.where} does not index the attention scores")


def _score_side_of_bound(graph, select: Op) -> int:
    """The input of a bound's Select that carries the scores (1 or 2): the one that is not the fill, a
    scalar, or else the one produced by an op."""
    for side in (1, 2):
        lt = select.inputs[side]
        other = select.inputs[3 - side]
        if lt.ndim >= 2 and (other.ndim < 2 or all(d == 1 for d in other.shape)):
            return side
    for side in (1, 2):
        if graph.producer(select.inputs[side].id) is not None:
            return side
    raise NoMatch(f"{select.where} selects between no attention scores")


def match_sdpa(graph, softmax: Op) -> SdpaMatch:
    """Matches the SDPA forward pattern around `softmax`; raises NoMatch with the reason."""
    rank = softmax.inputs[0].ndim
    if softmax.attrs["axis"] % rank != rank - 1:
        raise NoMatch(f"{softmax.where} normalises axis {softmax.attrs['axis']}, not the last one")
    pv = _sole_consumer(graph, softmax.outputs[0].id, "SoftMax output")
    parts: dict = {}
    probabilities = softmax.outputs[0].id
    if pv.kind == OpKind.Dropout:
        dropout = pv
        if len(dropout.outputs) > 1 and (graph.consumers(dropout.outputs[1].id)
                                         or graph.is_marked_output(dropout.outputs[1].id)):
            raise NoMatch(f"{dropout.where}: its mask output is used, and the fused kernel does not write it")
        parts.update(dropout_op=dropout, dropout_seed=input_chain(graph, dropout.inputs[1].id),
                     dropout_offset=input_chain(graph, dropout.inputs[2].id))
        probabilities = dropout.outputs[0].id
        pv = _sole_consumer(graph, probabilities, "Dropout output")
    if pv.kind != OpKind.MatMul or pv.inputs[0].id != probabilities or pv.attrs["transpose_a"]:
        raise NoMatch(f"the probabilities feed {pv.where}, not the first input of MatMul(P, V)")
    match_masked_scores(graph, softmax.inputs[0].id, parts)
    qk = parts.pop("qk")
    output_ops, output_id = output_chain(graph, pv.outputs[0].id)
    key, value = input_chain(graph, qk.inputs[1].id), input_chain(graph, pv.inputs[1].id)
    (key_dequant, key_note), (value_dequant, value_note) = dequant_feeding(graph, key), dequant_feeding(graph, value)
    match = SdpaMatch(qk=qk, softmax=softmax, pv=pv,
                      query=input_chain(graph, qk.inputs[0].id),
                      key=key if key_dequant is None else key_dequant.src,
                      value=value if value_dequant is None else value_dequant.src,
                      output_ops=output_ops, output_id=output_id,
                      stats_id=softmax.outputs[1].id if len(softmax.outputs) > 1 else None,
                      key_dequant=key_dequant, value_dequant=value_dequant,
                      notes=[n for n in (key_note, value_note) if n is not None], **parts)
    _check_intermediates(graph, match)
    return match


def dequant_feeding(graph, chain: InputChain) -> tuple[DequantMatch | None, str | None]:
    """The DynamicDequantize whose output is K's or V's chain tensor, where the kernel can take it in the
    pattern: per group along one of the last two dims, src, scales and zps partition inputs (no views), the
    output used by the pattern alone; else None and why it stays its own partition (None: there is none)."""
    op = graph.producer(chain.tensor_id)
    if op is None or op.kind != OpKind.DynamicDequantize:
        return None, None
    chains = [input_chain(graph, lt.id) for lt in op.inputs]
    if chain.ops:
        return None, f"{op.where}: view ops between it and the MatMul"
    if op.attrs["qtype"] != "per_group":
        return None, f"{op.where}: qtype {op.attrs['qtype']} (the kernel takes per_group along the head size)"
    if len(graph.consumers(chain.tensor_id)) != 1 or graph.is_marked_output(chain.tensor_id):
        return None, f"{op.where}: its output is used outside the pattern"
    if any(c.ops or graph.producer(c.tensor_id) is not None for c in chains):
        return None, f"{op.where}: its src, scales or zps are not partition inputs"
    return DequantMatch(op, chains[0], chains[1], chains[2] if len(chains) > 2 else None), None


def check_closed(graph, ops: list[Op], inputs: set[int], outputs: set[int]) -> None:
    """The matched ops read only each other's outputs and the pattern's inputs, and every tensor they make
    (the pattern's outputs and a Dropout's unused mask aside) is used only inside the pattern."""
    op_ids = {op.id for op in ops}
    if len(op_ids) != len(ops):
        raise NoMatch("an op appears twice in the matched subgraph")
    for op in ops:
        for lt in op.inputs:
            producer = graph.producer(lt.id)
            if lt.id not in inputs and (producer is None or producer.id not in op_ids):
                raise NoMatch(f"{op.where} reads tensor {lt.id} from outside the pattern")
        for index, lt in enumerate(op.outputs):
            if lt.id in outputs or (op.kind == OpKind.Dropout and index > 0):
                continue
            if graph.is_marked_output(lt.id):
                raise NoMatch(f"intermediate tensor {lt.id} of {op.where} is marked as an output by End")
            outside = [c for c in graph.consumers(lt.id) if c.id not in op_ids]
            if outside or not graph.consumers(lt.id):
                raise NoMatch(f"intermediate tensor {lt.id} of {op.where} is also used outside the pattern")


def _check_intermediates(graph, match: SdpaMatch) -> None:
    outputs = {match.output_id} | ({match.stats_id} if match.stats_id is not None else set())
    check_closed(graph, match.all_ops(), {chain.tensor_id for chain in match.input_chains()}, outputs)
