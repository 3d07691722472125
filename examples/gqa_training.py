"""GQA training in the native 5D form, as in oneDNN's gqa_training example: a forward graph that also
returns the SoftMax stats, and the backward graph that recomputes P from them (Subtract, Exp) and
produces dQ, dK and dV, with ReduceSum summing dK/dV over each group of query heads.

Each graph fuses into one partition; the gradients are checked against NumPy.

    python examples/gqa_training.py [--dtype bf16]
"""
import argparse
import math

import numpy as np

import graphattn as ga
from graphattn.testing import assert_grad_close, random_array, sdpa_reference_backward
from example_utils import run_fused


def forward_graph(dtype, n, hkv, rep, s, d):
    q = ga.LogicalTensor(0, dtype, (n, hkv, rep, s, d))
    k = ga.LogicalTensor(1, dtype, (n, hkv, 1, s, d))
    v = ga.LogicalTensor(2, dtype, (n, hkv, 1, s, d))
    scale = ga.LogicalTensor(3, dtype, (1,))
    mask = ga.LogicalTensor(4, "f32", (n, 1, 1, s, s))
    score = ga.LogicalTensor(10, "f32", (n, hkv, rep, s, s))
    scaled = ga.LogicalTensor(11, "f32", (n, hkv, rep, s, s))
    masked = ga.LogicalTensor(12, "f32", (n, hkv, rep, s, s))
    probs = ga.LogicalTensor(13, dtype, (n, hkv, rep, s, s))
    stats = ga.LogicalTensor(14, "f32", (n, hkv, rep, s, 1))
    out = ga.LogicalTensor(15, dtype, (n, hkv, rep, s, d))
    graph = ga.Graph("cpu")
    graph.add_op(ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}, "matmul_qk"))
    graph.add_op(ga.Op(1, "Multiply", [score, scale], [scaled], name="scale_mul"))
    graph.add_op(ga.Op(2, "Add", [scaled, mask], [masked], name="mask_add"))
    graph.add_op(ga.Op(3, "SoftMax", [masked], [probs, stats], {"axis": -1, "mode": "inf_as_zero"}, "softmax"))
    graph.add_op(ga.Op(4, "MatMul", [probs, v], [out], name="matmul_v"))
    graph.finalize()
    return graph, (q, k, v, scale, mask), (out, stats)


def backward_graph(dtype, n, hkv, rep, s, d):
    q = ga.LogicalTensor(0, dtype, (n, hkv, rep, s, d))
    k = ga.LogicalTensor(1, dtype, (n, hkv, 1, s, d))
    v = ga.LogicalTensor(2, dtype, (n, hkv, 1, s, d))
    scale = ga.LogicalTensor(3, dtype, (1,))
    mask = ga.LogicalTensor(4, "f32", (n, 1, 1, s, s))
    stats = ga.LogicalTensor(5, "f32", (n, hkv, rep, s, 1))
    grad_out = ga.LogicalTensor(6, dtype, (n, hkv, rep, s, d))
    f32_scores = lambda tid: ga.LogicalTensor(tid, "f32", (n, hkv, rep, s, s))  # noqa: E731
    score, scaled, masked, centered, probs = (f32_scores(t) for t in range(10, 15))
    probs_cast = ga.LogicalTensor(15, dtype, (n, hkv, rep, s, s))
    grad_v_full = ga.LogicalTensor(16, dtype, (n, hkv, rep, s, d))
    grad_v = ga.LogicalTensor(17, dtype, (n, hkv, 1, s, d))
    grad_probs, grad_masked, grad_scores = (f32_scores(t) for t in range(18, 21))
    grad_scores_cast = ga.LogicalTensor(21, dtype, (n, hkv, rep, s, s))
    grad_q = ga.LogicalTensor(22, dtype, (n, hkv, rep, s, d))
    grad_k_full = ga.LogicalTensor(23, dtype, (n, hkv, rep, s, d))
    grad_k = ga.LogicalTensor(24, dtype, (n, hkv, 1, s, d))
    ops = [
        ("MatMul", [q, k], [score], {"transpose_b": True}),
        ("Multiply", [score, scale], [scaled], {}),
        ("Add", [scaled, mask], [masked], {}),
        ("Subtract", [masked, stats], [centered], {}),          # P = exp(S - stats) recomputes the forward's P
        ("Exp", [centered], [probs], {}),
        ("TypeCast", [probs], [probs_cast], {}) if dtype != "f32" else None,
        ("MatMul", [probs_cast if dtype != "f32" else probs, grad_out], [grad_v_full], {"transpose_a": True}),
        ("ReduceSum", [grad_v_full], [grad_v], {"axes": [2], "keep_dims": True}),
        ("MatMul", [grad_out, v], [grad_probs], {"transpose_b": True}),
        ("SoftMaxBackward", [grad_probs, probs], [grad_masked], {"axis": -1}),
        ("Multiply", [grad_masked, scale], [grad_scores], {}),
        ("TypeCast", [grad_scores], [grad_scores_cast], {}) if dtype != "f32" else None,
        ("MatMul", [grad_scores_cast if dtype != "f32" else grad_scores, k], [grad_q], {}),
        ("MatMul", [grad_scores_cast if dtype != "f32" else grad_scores, q], [grad_k_full], {"transpose_a": True}),
        ("ReduceSum", [grad_k_full], [grad_k], {"axes": [2], "keep_dims": True}),
    ]
    graph = ga.Graph("cpu")
    for i, (kind, ins, outs, attrs) in enumerate(op for op in ops if op is not None):
        graph.add_op(ga.Op(i, kind, ins, outs, attrs))
    graph.finalize()
    return graph, (q, k, v, scale, mask, stats, grad_out), (grad_q, grad_k, grad_v)


def main(dtype="f32", n=2, hq=16, hkv=2, s=128, d=64):
    rep = hq // hkv
    title = f"gqa_training N={n} Hq={hq} Hkv={hkv} S={s} D={d} {dtype}"
    rng = np.random.default_rng(0)
    fwd, (q, k, v, scale, mask), (out, stats) = forward_graph(dtype, n, hkv, rep, s, d)
    data = {lt.id: random_array(lt.shape, dtype, rng) for lt in (q, k, v)}
    data[scale.id] = np.array([1 / math.sqrt(d)], data[q.id].dtype)
    causal = np.triu(np.full((s, s), -np.inf, np.float32), 1)  # a causal mask given as data
    data[mask.id] = np.broadcast_to(causal, mask.shape).copy()
    (o, lse), fwd_ms, fwd_kernel = run_fused(fwd, data, [out, stats], "sdpa_forward", f"{title} forward")
    print(f"  kernel {fwd_kernel}: best {fwd_ms:.3f} ms")

    bwd, (bq, bk, bv, bscale, bmask, bstats, bgrad), grads = backward_graph(dtype, n, hkv, rep, s, d)
    grad_out = random_array(o.shape, dtype, rng)
    bdata = {bq.id: data[q.id], bk.id: data[k.id], bv.id: data[v.id], bscale.id: data[scale.id],
             bmask.id: data[mask.id], bstats.id: lse, bgrad.id: grad_out}
    (dq, dk, dv), bwd_ms, bwd_kernel = run_fused(bwd, bdata, list(grads), "sdpa_backward", f"{title} backward")
    print(f"  kernel {bwd_kernel}: best {bwd_ms:.3f} ms")

    # NumPy check in the 4D (N, H, S, D) view, after the timing (NumPy's threads would compete).
    q4, k4, v4 = data[q.id].reshape(n, hq, s, d), data[k.id].reshape(n, hkv, s, d), data[v.id].reshape(n, hkv, s, d)
    want = sdpa_reference_backward(grad_out.reshape(n, hq, s, d), q4, k4, v4, attn_mask=causal, enable_gqa=True)
    for name, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_grad_close(got.reshape(expected.shape), expected, dtype, f"{title} {name}")
    worst = max(np.abs(g.reshape(w.shape).astype(np.float64) - w).max() for g, w in zip((dq, dk, dv), want))
    print(f"  dQ, dK, dV match the NumPy reference (max abs error {worst:.2e})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    main(parser.parse_args().dtype)
