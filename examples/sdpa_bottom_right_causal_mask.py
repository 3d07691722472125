"""SDPA with the implicit bottom-right causal mask, as in oneDNN's example of the same name.

The mask is the subgraph GenIndex(row) + s_kv - s_q >= GenIndex(col) -> Select(score, -inf);
graphattn fuses it and skips the key blocks it removes.  Here S_q = 64 queries attend to
S_kv = 192 keys (a decode-style chunk appended to a cache).

    python examples/sdpa_bottom_right_causal_mask.py [--dtype bf16]
"""
import argparse
import math

import numpy as np

import graphattn as ga
from graphattn.testing import random_array, sdpa_reference
from example_utils import run_and_check


def main(dtype="f32", n=1, h=8, sq=64, skv=192, d=64):
    scores = (n, h, sq, skv)
    q = ga.LogicalTensor(0, dtype, (n, h, sq, d))
    k = ga.LogicalTensor(1, dtype, (n, h, skv, d))
    v = ga.LogicalTensor(2, dtype, (n, h, skv, d))
    scale = ga.LogicalTensor(3, dtype, (1,))
    s_kv = ga.LogicalTensor(4, "s32", (1,))
    s_q = ga.LogicalTensor(5, "s32", (1,))
    neg_inf = ga.LogicalTensor(6, "f32", (1,))
    score = ga.LogicalTensor(10, "f32", scores)
    scaled = ga.LogicalTensor(11, "f32", scores)
    row = ga.LogicalTensor(12, "s32", scores)
    col = ga.LogicalTensor(13, "s32", scores)
    row_plus_kv = ga.LogicalTensor(14, "s32", scores)
    row_shifted = ga.LogicalTensor(15, "s32", scores)
    keep = ga.LogicalTensor(16, "boolean", scores)
    masked = ga.LogicalTensor(17, "f32", scores)
    probs = ga.LogicalTensor(18, dtype, scores)
    out = ga.LogicalTensor(19, dtype, (n, h, sq, d))

    graph = ga.Graph("cpu")
    graph.add_op(ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}, "matmul_qk"))
    graph.add_op(ga.Op(1, "Multiply", [score, scale], [scaled], name="scale_mul"))
    graph.add_op(ga.Op(2, "GenIndex", [scaled], [row], {"axis": -2}, "gen_index_row"))
    graph.add_op(ga.Op(3, "Add", [row, s_kv], [row_plus_kv], name="add_s_kv"))
    graph.add_op(ga.Op(4, "Subtract", [row_plus_kv, s_q], [row_shifted], name="sub_s_q"))
    graph.add_op(ga.Op(5, "GenIndex", [scaled], [col], {"axis": -1}, "gen_index_col"))
    graph.add_op(ga.Op(6, "GreaterEqual", [row_shifted, col], [keep], name="mask_ge"))
    graph.add_op(ga.Op(7, "Select", [keep, scaled, neg_inf], [masked], name="mask_select"))
    graph.add_op(ga.Op(8, "SoftMax", [masked], [probs], {"axis": -1}, "softmax"))
    graph.add_op(ga.Op(9, "MatMul", [probs, v], [out], name="matmul_v"))
    graph.finalize()

    rng = np.random.default_rng(0)
    data = {lt.id: random_array(lt.shape, dtype, rng) for lt in (q, k, v)}
    data[scale.id] = np.array([1 / math.sqrt(d)], data[q.id].dtype)
    data[s_kv.id] = np.array([skv], np.int32)
    data[s_q.id] = np.array([sq], np.int32)
    data[neg_inf.id] = np.array([-np.inf], np.float32)
    def expected():
        return sdpa_reference(data[q.id], data[k.id], data[v.id], is_causal=True, causal_alignment="bottom_right")

    run_and_check(graph, data, out, expected, dtype, f"bottom-right causal sdpa Sq={sq} Skv={skv} {dtype}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    main(parser.parse_args().dtype)
