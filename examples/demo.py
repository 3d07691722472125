"""End-to-end demo: build the SDPA graph with the graph API, fuse, compile, execute, check, time.

    python examples/demo.py [--batch 1 --heads 16 --seq 1024 --head-dim 64 --dtype f32 --causal]

The graph is oneDNN's SDPA pattern: MatMul(Q, K^T) -> Multiply(scale) ->
[implicit causal mask | Add(mask)] -> SoftMax -> MatMul(P, V).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.testing import TOLERANCES, assert_close, random_array


def build_graph(n, h, s, d, dtype, causal):
    f32 = "f32"
    ids = iter(range(100))
    q = ga.LogicalTensor(next(ids), dtype, (n, h, s, d))
    k = ga.LogicalTensor(next(ids), dtype, (n, h, s, d))
    v = ga.LogicalTensor(next(ids), dtype, (n, h, s, d))
    scale = ga.LogicalTensor(next(ids), dtype, (1,))
    score = ga.LogicalTensor(next(ids), f32, (n, h, s, s))
    scaled = ga.LogicalTensor(next(ids), f32, (n, h, s, s))
    ops = [ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}, "qk_matmul"),
           ga.Op(1, "Multiply", [score, scale], [scaled], name="scale_mul")]
    inputs = {"query": q, "key": k, "value": v, "scale": scale}
    masked = scaled
    if causal:
        row = ga.LogicalTensor(next(ids), "s32", (n, h, s, s))
        col = ga.LogicalTensor(next(ids), "s32", (n, h, s, s))
        keep = ga.LogicalTensor(next(ids), "boolean", (n, h, s, s))
        fill = ga.LogicalTensor(next(ids), f32, (1,))
        masked = ga.LogicalTensor(next(ids), f32, (n, h, s, s))
        ops += [ga.Op(2, "GenIndex", [scaled], [row], {"axis": -2}, "row_index"),
                ga.Op(3, "GenIndex", [scaled], [col], {"axis": -1}, "col_index"),
                ga.Op(4, "GreaterEqual", [row, col], [keep], name="causal_compare"),
                ga.Op(5, "Select", [keep, scaled, fill], [masked], name="causal_select")]
        inputs["fill"] = fill
    probs = ga.LogicalTensor(next(ids), dtype, (n, h, s, s))
    out = ga.LogicalTensor(next(ids), dtype, (n, h, s, d))
    ops += [ga.Op(10, "SoftMax", [masked], [probs], {"axis": -1, "mode": "inf_as_zero"}, "softmax"),
            ga.Op(11, "MatMul", [probs, v], [out], name="pv_matmul")]
    graph = ga.Graph("cpu")
    for op in ops:
        graph.add_op(op)
    graph.finalize()
    return graph, inputs, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    parser.add_argument("--causal", action="store_true", help="use the implicit causal mask subgraph")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, h, s, d, dt = args.batch, args.heads, args.seq, args.head_dim, args.dtype

    print(f"graphattn {ga.__version__}: ISA {ga.forward_isa()}, {ga.thread_count()} threads, "
          f"features: {' '.join(ga.cpu_features())}")
    graph, inputs, out = build_graph(n, h, s, d, dt, args.causal)
    partitions = graph.get_partitions()
    print(f"graph: {len(graph.ops)} ops -> {len(partitions)} partition(s)")
    for p in partitions:
        print(f"  partition {p.id}: {p.kind}, ops {p.get_ops()}, inputs {[t.id for t in p.get_input_ports()]}, "
              f"outputs {[t.id for t in p.get_output_ports()]}")

    rng = np.random.default_rng(0)
    engine, stream = ga.Engine("cpu"), ga.Stream(ga.Engine("cpu"))
    data = {name: random_array(lt.shape, dt, rng) for name, lt in inputs.items() if name in ("query", "key", "value")}
    data["scale"] = np.array([1 / math.sqrt(d)], numpy_dtype(ga.DataType(dt)))
    if "fill" in inputs:
        data["fill"] = np.array([-np.inf], np.float32)
    partition = partitions[0]
    ports = {lt.id: lt for lt in partition.get_input_ports()}
    by_id = {inputs[name].id: array for name, array in data.items()}
    t0 = time.perf_counter()
    compiled = partition.compile(list(ports.values()), [out], engine)
    compile_ms = (time.perf_counter() - t0) * 1e3
    result = np.empty(out.shape, numpy_dtype(ga.DataType(dt)))
    in_tensors = [ga.Tensor(lt, engine, by_id[lt.id]) for lt in compiled.inputs]
    out_tensors = [ga.Tensor(compiled.query_logical_tensor(out.id), engine, result)]
    print(f"compiled partition {partition.id} with kernel {compiled.kernel_name} in {compile_ms:.1f} ms")

    compiled.execute(stream, in_tensors, out_tensors)  # warm-up
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        compiled.execute(stream, in_tensors, out_tensors)
        stream.wait()
        times.append(time.perf_counter() - t0)
        print(f"  run {i + 1}/{args.repeats}: {times[-1] * 1e3:.2f} ms", flush=True)
    best = min(times)
    flops = 4 * n * h * s * s * d * (0.5 if args.causal else 1.0)
    print(f"fused SDPA ({n},{h},{s},{d}) {dt}{' causal' if args.causal else ''}: best {best * 1e3:.2f} ms, "
          f"{flops / best / 1e9:.1f} GFLOP/s")

    check_heads = min(h, 2)  # the op-by-op reference is O(S^2) memory: check a slice of heads
    t0 = time.perf_counter()
    ref_graph, ref_inputs, ref_out = build_graph(n, check_heads, s, d, dt, args.causal)
    reference = ga.run.run_graph(ref_graph, {ref_inputs[name].id: (array[:, :check_heads] if array.ndim == 4 else array)
                                             for name, array in data.items()}, policy="debug")[ref_out.id]
    assert_close(result[:, :check_heads], reference, dt, "demo output")
    err = np.abs(result[:, :check_heads].astype(np.float64) - reference.astype(np.float64)).max()
    print(f"matches the op-by-op NumPy reference on {check_heads} head(s): max abs error {err:.2e} "
          f"(tolerance rtol={TOLERANCES[ga.DataType(dt)][0]}, atol={TOLERANCES[ga.DataType(dt)][1]}), "
          f"checked in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
