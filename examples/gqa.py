"""GQA inference in the native 5D form, as in oneDNN's gqa example: K/V shared by groups of query heads.

Q is (N, H_kv, N_rep, S, D), K and V are (N, H_kv, 1, S, D); the kernel never repeats K/V.

    python examples/gqa.py [--dtype bf16]
"""
import argparse
import math

import numpy as np

import graphattn as ga
from graphattn.testing import random_array, sdpa_reference
from example_utils import run_and_check


def build(dtype, n, hq, hkv, s, d):
    rep = hq // hkv
    q = ga.LogicalTensor(0, dtype, (n, hkv, rep, s, d))
    k = ga.LogicalTensor(1, dtype, (n, hkv, 1, s, d))
    v = ga.LogicalTensor(2, dtype, (n, hkv, 1, s, d))
    scale = ga.LogicalTensor(3, dtype, (1,))
    mask = ga.LogicalTensor(4, dtype, (n, 1, 1, 1, s))
    score = ga.LogicalTensor(10, "f32", (n, hkv, rep, s, s))
    scaled = ga.LogicalTensor(11, "f32", (n, hkv, rep, s, s))
    masked = ga.LogicalTensor(12, "f32", (n, hkv, rep, s, s))
    probs = ga.LogicalTensor(13, dtype, (n, hkv, rep, s, s))
    out = ga.LogicalTensor(14, dtype, (n, hkv, rep, s, d))
    graph = ga.Graph("cpu")
    graph.add_op(ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}, "matmul_qk"))
    graph.add_op(ga.Op(1, "Multiply", [score, scale], [scaled], name="scale_mul"))
    graph.add_op(ga.Op(2, "Add", [scaled, mask], [masked], name="mask_add"))
    graph.add_op(ga.Op(3, "SoftMax", [masked], [probs], {"axis": -1}, "softmax"))
    graph.add_op(ga.Op(4, "MatMul", [probs, v], [out], name="matmul_v"))
    graph.finalize()
    return graph, (q, k, v, scale, mask), out


def main(dtype="f32", n=2, hq=16, hkv=2, s=128, d=64, title="gqa"):
    graph, (q, k, v, scale, mask), out = build(dtype, n, hq, hkv, s, d)
    rng = np.random.default_rng(0)
    data = {lt.id: random_array(lt.shape, dtype, rng) for lt in (q, k, v, mask)}
    data[scale.id] = np.array([1 / math.sqrt(d)], data[q.id].dtype)
    # the same computation in the 4D (N, H, S, D) view, for the NumPy check
    q4 = data[q.id].reshape(n, hq, s, d)
    k4, v4 = data[k.id].reshape(n, hkv, s, d), data[v.id].reshape(n, hkv, s, d)
    def expected():
        return sdpa_reference(q4, k4, v4, attn_mask=data[mask.id].reshape(n, 1, 1, s), enable_gqa=True).reshape(out.shape)

    run_and_check(graph, data, out, expected, dtype,
                  f"{title} N={n} Hq={hq} Hkv={hkv} S={s} D={d} {dtype}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    main(parser.parse_args().dtype)
