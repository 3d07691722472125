"""The SDPA training-backward pattern of the oneDNN Graph spec, matched around each SoftMaxBackward:

    S  = MatMul(Q, K^T) -> [Multiply | Divide by scale] -> [mask: Add | Select] -> [key window bound Selects]
    P  = Exp(Subtract(S, stats))
    dV = MatMul(P^T, dO)  (P through [Dropout] [TypeCast]; then [ReduceSum] for 5D GQA)
    dP = MatMul(dO, V^T) -> [Dropout]
    dS = SoftMaxBackward(dP, P) -> [End: dM] -> [Multiply | Divide by the forward's scale] -> [TypeCast]
    dQ = MatMul(dS, K),  dK = MatMul(dS^T, Q) -> [ReduceSum for 5D GQA]

Q, K, V, dO, stats, the scale, the mask, the Dropout seed and offset are the
partition's inputs (each possibly through view ops); dQ, dK, dV and the
optional dM are its outputs (each possibly followed by view ops).  Dropout on
P and on dP, a graphattn extension of the spec, must use one p, seed and offset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import Op, OpKind
from .sdpa import (SCALE_KINDS, InputChain, NoMatch, input_chain, output_chain, check_closed, unique_ops,
                   match_masked_scores)


@dataclass
class GradientOutput:
    """A MatMul producing a gradient, its optional ReduceSum, and the view ops up to the output tensor."""
    matmul: Op
    reduce: Op | None
    view_ops: list[Op]
    tensor_id: int

    def ops(self) -> list[Op]:
        return [self.matmul] + ([self.reduce] if self.reduce else []) + self.view_ops


@dataclass
class SdpaBackwardMatch:
    qk: Op
    subtract: Op
    exp: Op
    softmax_backward: Op
    query: InputChain
    key: InputChain
    value: InputChain
    grad_output: InputChain
    stats: InputChain
    dv: GradientOutput
    dq: GradientOutput
    dk: GradientOutput
    dp_matmul: Op
    scale_op: Op | None = None
    scale: InputChain | None = None
    grad_scale_op: Op | None = None
    mask_op: Op | None = None
    mask_kind: str = "none"
    mask: InputChain | None = None
    select_keep_value: bool = True
    select_fill: InputChain | None = None
    bounds: list = field(default_factory=list)    # KeyBound, at most one per side
    casts: list[Op] = field(default_factory=list)  # TypeCasts of P and dS
    dropouts: list[Op] = field(default_factory=list)  # on P and on dP
    dropout_seed: InputChain | None = None
    dropout_offset: InputChain | None = None
    grad_mask_id: int | None = None                # dS, when End marks it as an output (dM)

    def all_ops(self) -> list[Op]:
        ops = [self.qk, self.subtract, self.exp, self.softmax_backward, self.dp_matmul]
        ops += [op for op in (self.scale_op, self.grad_scale_op, self.mask_op) if op is not None]
        ops += self.casts + self.dropouts + self.dv.ops() + self.dq.ops() + self.dk.ops()
        for chain in self.input_chains():
            ops += chain.ops
        ops += [op for bound in self.bounds for op in [bound.select] + bound.ops]
        return unique_ops(ops)

    def input_chains(self) -> list[InputChain]:
        chains = [self.query, self.key, self.value, self.grad_output, self.stats, self.scale, self.mask,
                  self.select_fill, self.dropout_seed, self.dropout_offset]
        for bound in self.bounds:
            chains += [bound.fill] + [c for c, _ in bound.terms]
        return [c for c in chains if c is not None]

    def output_ids(self) -> list[int]:
        ids = [self.dq.tensor_id, self.dk.tensor_id, self.dv.tensor_id]
        return ids + ([self.grad_mask_id] if self.grad_mask_id is not None else [])


def _producer(graph, tensor_id: int, kinds, what: str) -> Op:
    op = graph.producer(tensor_id)
    if op is None or op.kind not in kinds:
        found = "a partition input" if op is None else op.where
        raise NoMatch(f"{what} (tensor {tensor_id}) comes from {found}, not {'/'.join(k.value for k in kinds)}")
    return op


def _consumers_except(graph, tensor_id: int, skip: Op) -> list[Op]:
    return [c for c in graph.consumers(tensor_id) if c.id != skip.id]


def _gradient_output(graph, matmul: Op) -> GradientOutput:
    current, reduce = matmul.outputs[0].id, None
    consumers = graph.consumers(current)
    if not graph.is_marked_output(current) and len(consumers) == 1 and consumers[0].kind == OpKind.ReduceSum:
        reduce = consumers[0]
        current = reduce.outputs[0].id
    view_ops, tensor_id = output_chain(graph, current)
    return GradientOutput(matmul, reduce, view_ops, tensor_id)


def _through(graph, tensor_id: int, kind: OpKind, skip: Op | None = None) -> tuple[Op | None, int]:
    """If tensor_id's only consumer (other than `skip`) is a `kind` op, step through it."""
    consumers = [c for c in graph.consumers(tensor_id) if skip is None or c.id != skip.id]
    if len(consumers) == 1 and consumers[0].kind == kind:
        return consumers[0], consumers[0].outputs[0].id
    return None, tensor_id


def match_sdpa_backward(graph, sbw: Op) -> SdpaBackwardMatch:
    """Matches the SDPA backward pattern around SoftMaxBackward `sbw`; raises NoMatch with the reason."""
    rank = sbw.inputs[0].ndim
    if sbw.attrs["axis"] % rank != rank - 1:
        raise NoMatch(f"{sbw.where} works on axis {sbw.attrs['axis']}, not the last one")
    dp_id, p_id = sbw.inputs[0].id, sbw.inputs[1].id
    exp = _producer(graph, p_id, (OpKind.Exp,), "SoftMaxBackward's dst")
    subtract = _producer(graph, exp.inputs[0].id, (OpKind.Subtract,), "Exp's input")
    parts: dict = {}
    match_masked_scores(graph, subtract.inputs[0].id, parts)
    qk = parts.pop("qk")
    if qk.attrs["transpose_a"] or not qk.attrs["transpose_b"]:
        raise NoMatch(f"{qk.where} must be MatMul(Q, K, transpose_b=True) so that K is shared with dQ = dS K")

    # dV = MatMul(P^T, dO), P through optional Dropout and TypeCast.
    dropouts, casts = [], []
    tensor = p_id
    dropout, tensor = _through(graph, tensor, OpKind.Dropout, skip=sbw)
    if dropout:
        dropouts.append(dropout)
    cast, tensor = _through(graph, tensor, OpKind.TypeCast, skip=sbw if not dropout else None)
    if cast:
        casts.append(cast)
    users = _consumers_except(graph, tensor, sbw) if tensor == p_id else graph.consumers(tensor)
    if len(users) != 1 or users[0].kind != OpKind.MatMul or users[0].inputs[0].id != tensor \
            or not users[0].attrs["transpose_a"] or users[0].attrs["transpose_b"]:
        raise NoMatch(f"P (tensor {tensor}) does not feed MatMul(P, dO, transpose_a=True) alone")
    dv_matmul = users[0]
    grad_out_id = dv_matmul.inputs[1].id

    # dP = MatMul(dO, V^T) -> [Dropout].
    producer = graph.producer(dp_id)
    if producer is not None and producer.kind == OpKind.Dropout:
        dropouts.append(producer)
        producer = graph.producer(producer.inputs[0].id)
    if producer is None or producer.kind != OpKind.MatMul or producer.attrs["transpose_a"] \
            or not producer.attrs["transpose_b"] or producer.inputs[0].id != grad_out_id:
        raise NoMatch(f"dP (tensor {dp_id}) is not MatMul(dO, V, transpose_b=True) with the dO of dV")
    dp_matmul = producer
    if len(dropouts) == 1:
        raise NoMatch(f"{dropouts[0].where}: Dropout must act on both P and dP, with one seed and offset")
    if dropouts:
        first, second = dropouts
        same = first.attrs["p"] == second.attrs["p"] and all(
            input_chain(graph, first.inputs[i].id).tensor_id == input_chain(graph, second.inputs[i].id).tensor_id
            for i in (1, 2))
        if not same:
            raise NoMatch(f"{first.where} and {second.where} differ in p, seed or offset")

    # dS -> [End] -> scale -> [TypeCast] -> dQ = MatMul(dS, K), dK = MatMul(dS^T, Q).
    ds_id = sbw.outputs[0].id
    marked = graph.is_marked_output(ds_id)  # by End: dM is an output
    ds_users = [c for c in graph.consumers(ds_id) if c.kind != OpKind.End]
    grad_scale_op = None
    tensor = ds_id
    if parts.get("scale_op") is not None:
        if len(ds_users) != 1 or ds_users[0].kind not in SCALE_KINDS or ds_users[0].kind != parts["scale_op"].kind:
            raise NoMatch(f"dS (tensor {ds_id}) is not scaled like the scores ({parts['scale_op'].where})")
        grad_scale_op = ds_users[0]
        other = [t.id for t in grad_scale_op.inputs if t.id != ds_id]
        if len(other) != 1 or input_chain(graph, other[0]).tensor_id != parts["scale"].tensor_id:
            raise NoMatch(f"{grad_scale_op.where} does not use the forward's scale tensor")
        tensor = grad_scale_op.outputs[0].id
    cast, tensor = _through(graph, tensor, OpKind.TypeCast)
    if cast:
        casts.append(cast)
    grads = graph.consumers(tensor)
    dq_mm = [m for m in grads if m.kind == OpKind.MatMul and m.inputs[0].id == tensor and not m.attrs["transpose_a"]]
    dk_mm = [m for m in grads if m.kind == OpKind.MatMul and m.inputs[0].id == tensor and m.attrs["transpose_a"]]
    if len(grads) != 2 or len(dq_mm) != 1 or len(dk_mm) != 1:
        raise NoMatch(f"dS (tensor {tensor}) must feed exactly MatMul(dS, K) and MatMul(dS, Q, transpose_a=True)")
    dq_mm, dk_mm = dq_mm[0], dk_mm[0]
    if dq_mm.attrs["transpose_b"] or dk_mm.attrs["transpose_b"]:
        raise NoMatch(f"{dq_mm.where} / {dk_mm.where}: K and Q must not be transposed there")
    if dq_mm.inputs[1].id != qk.inputs[1].id or dk_mm.inputs[1].id != qk.inputs[0].id:
        raise NoMatch("dQ = dS K and dK = dS^T Q must read the K and Q of the score MatMul")

    match = SdpaBackwardMatch(
        qk=qk, subtract=subtract, exp=exp, softmax_backward=sbw,
        query=input_chain(graph, qk.inputs[0].id, uses=2), key=input_chain(graph, qk.inputs[1].id, uses=2),
        value=input_chain(graph, dp_matmul.inputs[1].id), grad_output=input_chain(graph, grad_out_id, uses=2),
        stats=input_chain(graph, subtract.inputs[1].id),
        dv=_gradient_output(graph, dv_matmul), dq=_gradient_output(graph, dq_mm), dk=_gradient_output(graph, dk_mm),
        dp_matmul=dp_matmul, grad_scale_op=grad_scale_op, casts=casts, dropouts=dropouts,
        dropout_seed=input_chain(graph, dropouts[0].inputs[1].id) if dropouts else None,
        dropout_offset=input_chain(graph, dropouts[0].inputs[2].id) if dropouts else None,
        grad_mask_id=ds_id if marked else None, **parts)
    check_closed(graph, match.all_ops(), {chain.tensor_id for chain in match.input_chains()},
                 set(match.output_ids()))
    return match
