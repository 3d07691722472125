"""Shared by the examples: compile the single partition, run it, time it, check it against NumPy."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.testing import assert_close


def run_fused(graph: ga.Graph, data: dict[int, np.ndarray], outs: list[ga.LogicalTensor], kind: str,
              title: str, repeats: int = 3) -> tuple[list[np.ndarray], float, str]:
    """Compiles the graph's single partition (which must be of `kind`), runs it `repeats` times after a
    warm-up, and returns its outputs, the best time in ms and the kernel's description."""
    partitions = graph.get_partitions()
    print(f"{title}: {len(graph.ops)} ops -> {len(partitions)} partition(s): "
          + ", ".join(f"{p.kind} {p.get_ops()}" for p in partitions))
    assert len(partitions) == 1 and partitions[0].kind == kind, f"the graph must fuse into one {kind} partition"
    engine = ga.Engine("cpu")
    stream = ga.Stream(engine)
    (partition,) = partitions
    compiled = partition.compile(partition.get_input_ports(), outs, engine)
    results = [np.empty(compiled.query_logical_tensor(o.id).shape, numpy_dtype(o.dtype)) for o in outs]
    inputs = [ga.Tensor(lt, engine, data[lt.id]) for lt in compiled.inputs]
    outputs = [ga.Tensor(compiled.query_logical_tensor(o.id), engine, r) for o, r in zip(outs, results)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        compiled.execute(stream, inputs, outputs)
        stream.wait()
        times.append(time.perf_counter() - start)
    kernel = f"{compiled.kernel_name} (isa {getattr(compiled.kernel, 'isa', 'reference')})"
    return results, min(times[1:]) * 1e3, kernel


def run_and_check(graph: ga.Graph, data: dict[int, np.ndarray], out: ga.LogicalTensor,
                  reference: Callable[[], np.ndarray], dtype: str, title: str, repeats: int = 3) -> np.ndarray:
    """`reference` is called after the timing: NumPy's BLAS threads keep spinning after a
    matmul and would steal the cores from the kernel's OpenMP threads."""
    (result,), best_ms, kernel = run_fused(graph, data, [out], "sdpa_forward", title, repeats)
    expected = reference()
    assert_close(result, expected, dtype, title)
    print(f"  kernel {kernel}: best {best_ms:.3f} ms; matches the NumPy reference (max abs error "
          f"{np.abs(result.astype(np.float64) - expected).max():.2e})")
    return result


def run_layers(title: str, layers: list[dict], dtype: str, batch: int, heads_q: int, heads_kv: int, seq: int,
               head_dim: int) -> None:
    """Causal attention layers with the functional API, forward and backward: each layer's keyword arguments
    (softcap, sinks, window, ...) in `layers`; each result checked against the float64 reference, each pass
    timed (the best of 3 after a warm-up)."""
    from graphattn.testing import assert_grad_close, random_array, sdpa_reference, sdpa_reference_backward

    rng = np.random.default_rng(0)
    print(f"{title}: N={batch} Hq={heads_q} Hkv={heads_kv} S={seq} D={head_dim} {dtype}, threads "
          f"{ga.thread_count()}")
    for index, options in enumerate(layers):
        q = random_array((batch, heads_q, seq, head_dim), dtype, rng)
        k, v = (random_array((batch, heads_kv, seq, head_dim), dtype, rng) for _ in range(2))
        call = dict(is_causal=True, enable_gqa=True, **options)

        def forward():
            return ga.scaled_dot_product_attention(q, k, v, return_stats=True, **call)

        (out, stats), forward_ms = _best_of(forward)
        grad_out = random_array(out.shape, dtype, rng)
        sinks = options.get("sinks") is not None

        def backward():
            return ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, return_sinks_grad=sinks,
                                                            **call)

        grads, backward_ms = _best_of(backward)
        assert_close(out, sdpa_reference(q, k, v, **call), dtype, f"layer {index} output")
        want = sdpa_reference_backward(grad_out, q, k, v, **call)
        want = want[:3] + want[4:]  # no mask gradient
        magnitude = max(float(np.abs(g).max()) for g in want[:3])
        for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want):
            assert_grad_close(got, expected, dtype, f"layer {index} {name}", magnitude)
        described = ", ".join(f"{key}={'(H,) f32' if key == 'sinks' else value}" for key, value in options.items())
        print(f"  layer {index} ({described}): forward {forward_ms:.2f} ms, backward {backward_ms:.2f} ms, "
              "matches the float64 reference")


def _best_of(fn, repeats: int = 3):
    """fn's result and its best time in ms over `repeats` calls after a warm-up."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, min(times) * 1e3


def model_example_main(doc: str, main) -> None:
    """The command line of the model-family examples: --dtype and --seq, passed to main(dtype, seq)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    main(args.dtype, args.seq)
