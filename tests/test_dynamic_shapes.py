"""Partitions compiled with unknown (-1) sequence dims, as oneDNN Graph's dynamic shapes: one compile serves
every length, forward and backward, fused; query_dynamic_outputs gives the outputs' shapes; known dims are
still checked."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.testing import SdpaGraphSpec, assert_close, assert_grad_close

LENGTHS = [(5, 5), (9, 13), (1, 17), (24, 7)]  # (S_q, S_kv): square, fewer rows, decode, more rows

VARIANTS = {
    "plain": dict(),
    "causal_bottom_right": dict(mask="causal_bottom_right"),
    "gqa_5d_stats": dict(gqa="5d", heads_q=4, heads_kv=2, stats=True, softmax_mode="inf_as_zero"),
    "window": dict(mask="causal_top_left", window_left=3, softmax_mode="inf_as_zero"),
    "reorder": dict(reorder="transpose_reshape", scale="divide"),
}


def _inputs(spec, rng):
    spec.build()  # names the tensor ids
    return spec.random_inputs(rng)


def _run_dynamic(compiled, ports, inputs):
    """Executes the dynamic partition on these arrays; returns {output id: array}."""
    engine = ga.Engine("cpu")
    outs = compiled.query_dynamic_outputs([ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in ports])
    arrays = {lt.id: np.empty(lt.shape, numpy_dtype(lt.dtype)) for lt in outs}
    compiled.execute(ga.Stream(engine), [ga.Tensor(lt, engine, inputs[lt.id]) for lt in ports],
                     [ga.Tensor(compiled.query_logical_tensor(lt.id), engine, arrays[lt.id]) for lt in outs])
    return arrays


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_compile_serves_every_length(variant, dtype, rng, capsys):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1, dtype=dtype, **VARIANTS[variant])
    (partition,) = spec.build().get_partitions()
    assert partition.kind == "sdpa_forward"
    ports = partition.get_input_ports()
    assert any(-1 in lt.shape for lt in ports)
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    assert compiled.kernel_name == "dynamic"
    for seq_q, seq_kv in LENGTHS:
        concrete = SdpaGraphSpec(seq_q=seq_q, seq_kv=seq_kv, dtype=dtype, **VARIANTS[variant])
        graph = concrete.build()
        inputs = concrete.random_inputs(rng)
        ga.set_verbose(1)
        try:
            got = _run_dynamic(compiled, ports, inputs)
        finally:
            ga.set_verbose(0)
        log = capsys.readouterr().err
        assert "sdpa_forward_cpu" in log and "reference" not in log, log
        assert compiled.kernel_name == "sdpa_forward_cpu"
        want = ga.run_graph(graph, inputs, policy="debug")
        for tid, array in got.items():
            tolerance = (1e-4, 1e-4) if array.dtype == np.float32 and dtype != "f32" else None
            finite = np.isfinite(want[tid])
            assert (np.isfinite(array) == finite).all()
            assert_close(np.where(finite, array, 0), np.where(finite, want[tid], 0), dtype if tolerance is None
                         else "f32", f"tensor {tid} at lengths {(seq_q, seq_kv)}", tolerance)


def test_a_seen_shape_is_not_compiled_again(rng, capsys):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    inputs = _inputs(SdpaGraphSpec(seq_q=6, seq_kv=6), rng)
    ga.set_verbose(1)
    try:
        first = _run_dynamic(compiled, ports, inputs)
        again = _run_dynamic(compiled, ports, inputs)
    finally:
        ga.set_verbose(0)
    log = capsys.readouterr().err
    assert log.count("graphattn_verbose,compile") == 1, log
    for tid in first:
        np.testing.assert_array_equal(first[tid], again[tid])


def test_backward_partition_with_unknown_lengths(rng):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1, stats=True, softmax_mode="inf_as_zero", mask="causal_top_left")
    backward = spec.build_backward()
    (partition,) = backward.get_partitions()
    assert partition.kind == "sdpa_backward"
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    for seq in (7, 12):
        concrete = SdpaGraphSpec(seq_q=seq, seq_kv=seq, stats=True, softmax_mode="inf_as_zero",
                                 mask="causal_top_left")
        graph, data = concrete.backward_case(rng)
        got = _run_dynamic(compiled, ports, data)
        want = ga.run_graph(graph, data, policy="debug")
        for name in ("grad_query", "grad_key", "grad_value"):
            tid = concrete.ids[name]
            assert_grad_close(got[tid], want[tid], "f32", f"{name} at length {seq}")


def test_known_dims_are_checked_and_outputs_follow_the_inputs(rng):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1, head_dim=16)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    inputs = _inputs(SdpaGraphSpec(seq_q=3, seq_kv=10, head_dim=16), rng)
    (out,) = compiled.query_dynamic_outputs([ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in ports])
    assert out.shape == (1, 2, 3, 16)
    wrong = _inputs(SdpaGraphSpec(seq_q=3, seq_kv=10, head_dim=8), rng)
    query = spec.ids["query"]
    with pytest.raises(ValueError, match=rf"tensor {query}\b.*shape \(1, 2, 3, 8\).*\(1, 2, -1, 16\)"):
        _run_dynamic(compiled, ports, wrong)
    engine = ga.Engine("cpu")  # execute checks too, with outputs of the right shape
    outputs = [ga.Tensor(out, engine, np.empty(out.shape, np.float32))]
    with pytest.raises(ValueError, match=rf"tensor {query} has shape \(1, 2, 3, 8\), compiled for \(1, 2, -1, 16\)"):
        compiled.execute(ga.Stream(engine), [ga.Tensor(ga.LogicalTensor(lt.id, lt.dtype, wrong[lt.id].shape), engine,
                                                       wrong[lt.id]) for lt in ports], outputs)
