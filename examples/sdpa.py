"""SDPA inference as in oneDNN's sdpa example: MatMul -> scale -> Add(mask) -> SoftMax -> MatMul.

    python examples/sdpa.py [--dtype bf16]
"""
import argparse
import math

import numpy as np

import graphattn as ga
from graphattn.testing import random_array, sdpa_reference
from example_utils import run_and_check


def main(dtype="f32", n=2, h=8, s=128, d=64):
    q = ga.LogicalTensor(0, dtype, (n, h, s, d))
    k = ga.LogicalTensor(1, dtype, (n, h, s, d))
    v = ga.LogicalTensor(2, dtype, (n, h, s, d))
    scale = ga.LogicalTensor(3, dtype, (1,))
    mask = ga.LogicalTensor(4, dtype, (n, 1, 1, s))          # padding mask, broadcast over heads and rows
    score = ga.LogicalTensor(10, "f32", (n, h, s, s))
    scaled = ga.LogicalTensor(11, "f32", (n, h, s, s))
    masked = ga.LogicalTensor(12, "f32", (n, h, s, s))
    probs = ga.LogicalTensor(13, dtype, (n, h, s, s))
    out = ga.LogicalTensor(14, dtype, (n, h, s, d))

    graph = ga.Graph("cpu")
    graph.add_op(ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}, "matmul_qk"))
    graph.add_op(ga.Op(1, "Divide", [score, scale], [scaled], name="scale_div"))
    graph.add_op(ga.Op(2, "Add", [scaled, mask], [masked], name="mask_add"))
    graph.add_op(ga.Op(3, "SoftMax", [masked], [probs], {"axis": -1}, "softmax"))
    graph.add_op(ga.Op(4, "MatMul", [probs, v], [out], name="matmul_v"))
    graph.finalize()

    rng = np.random.default_rng(0)
    data = {lt.id: random_array(lt.shape, dtype, rng) for lt in (q, k, v)}
    data[scale.id] = np.array([math.sqrt(d)], data[q.id].dtype)
    padding = np.zeros((n, 1, 1, s), np.float32)
    padding[:, :, :, s - 16:] = -np.inf                       # the last 16 keys are padding
    data[mask.id] = padding.astype(data[q.id].dtype)
    def expected():
        return sdpa_reference(data[q.id], data[k.id], data[v.id], attn_mask=padding, scale=1 / math.sqrt(d))

    run_and_check(graph, data, out, expected, dtype, f"sdpa ({n},{h},{s},{d}) {dtype}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    main(parser.parse_args().dtype)
