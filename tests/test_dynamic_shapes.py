"""Partitions compiled with unknown (-1) sequence dims, as oneDNN Graph's dynamic shapes: one compile serves
every length, forward and backward, fused; query_dynamic_outputs gives the outputs' shapes; known dims are
still checked."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.dtypes import numpy_dtype
from graphattn.builder import GraphBuilder
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
    compiles = [line for line in log.splitlines() if ",compile," in line]
    assert len(compiles) == 2 and "plan=replayed" in compiles[1], log  # the second runs the first's compile
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


# Calls whose unknown dims differ only in size, equal in the same places, replay the first compile of their
# class: the kernel's lowering re-made for their lengths and strides.
REPLAYED = {
    **VARIANTS,
    "bshd_layout": dict(layout="bshd"),
    "additive_mask": dict(mask="add"),
    "select_mask_gqa_4d": dict(mask="select", gqa="4d", heads_q=4, heads_kv=2),
    "softcap_bottom_right": dict(softcap=30.0, mask="causal_bottom_right"),
    "key_transposed_batch": dict(key_transposed=True, batch=2),
}
ONE_CLASS = [(9, 13), (24, 7), (3, 40), (17, 2)]  # S_q and S_kv differ: one class of lengths
EQUAL_CLASS = [(6, 6), (11, 11), (2, 2)]  # S_q == S_kv: another
DECODE_CLASS = [(1, 17), (1, 30), (1, 5)]  # one query row (1 stays itself in a class: it broadcasts)


def _logged(capsys, compiled, ports, inputs):
    ga.set_verbose(1)
    try:
        got = _run_dynamic(compiled, ports, inputs)
    finally:
        ga.set_verbose(0)
    return got, capsys.readouterr().err


def _check_against_reference(graph, inputs, got, dtype, where):
    want = ga.run_graph(graph, inputs, policy="debug")
    for tid, array in got.items():
        tolerance = (1e-4, 1e-4) if array.dtype == np.float32 and dtype != "f32" else None
        finite = np.isfinite(want[tid])
        assert (np.isfinite(array) == finite).all(), where
        assert_close(np.where(finite, array, 0), np.where(finite, want[tid], 0), dtype if tolerance is None
                     else "f32", f"tensor {tid} {where}", tolerance)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("variant", sorted(REPLAYED))
def test_new_lengths_of_a_class_replay_its_compile(variant, dtype, rng, capsys):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1, dtype=dtype, **REPLAYED[variant])
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    for lengths in (ONE_CLASS, EQUAL_CLASS, DECODE_CLASS):
        for i, (seq_q, seq_kv) in enumerate(lengths):
            concrete = SdpaGraphSpec(seq_q=seq_q, seq_kv=seq_kv, dtype=dtype, **REPLAYED[variant])
            graph = concrete.build()
            inputs = concrete.random_inputs(rng)
            got, log = _logged(capsys, compiled, ports, inputs)
            compiles = [line for line in log.splitlines() if ",compile," in line]
            assert len(compiles) == 1 and "sdpa_forward_cpu" in compiles[0], log
            # the first of a class compiles; the others replay it
            assert ("plan=replayed" in compiles[0]) == (i > 0), log
            assert f"sq={seq_q},skv={seq_kv}" in compiles[0], log
            _check_against_reference(graph, inputs, got, dtype, f"at lengths {(seq_q, seq_kv)}")


def _six_dim_sdpa(batch: tuple, seq_q: int, seq_kv: int, head_dim: int = 8):
    """softmax(Q K^T) V on (*batch, S, D) arrays of four batch dims, which the kernel's three take by
    folding two of them into one."""
    b = GraphBuilder()
    q = b.tensor("query", "f32", batch + (seq_q, head_dim))
    k = b.tensor("key", "f32", batch + (seq_kv, head_dim))
    v = b.tensor("value", "f32", batch + (seq_kv, head_dim))
    scores = b.op("MatMul", [q, k], [b.tensor(None, "f32", batch + (seq_q, seq_kv))], transpose_b=True)
    p = b.op("SoftMax", [scores], [b.tensor(None, "f32", batch + (seq_q, seq_kv))], axis=-1)
    b.op("MatMul", [p, v], [b.tensor("output", "f32", batch + (seq_q, head_dim))])
    return b.graph(), b.roles


def test_strides_that_break_a_fold_of_the_lowering_compile_anew(rng, capsys):
    """The first compile folds the dense query's two outer batch dims into one kernel dim; a query that is a
    view of a wider first dim keeps no such fold, so its call is compiled in full (and is still right)."""
    batch = (2, 3, 2, 2)
    (partition,) = _six_dim_sdpa(batch, -1, -1)[0].get_partitions()
    assert partition.kind == "sdpa_forward"
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    # (5, 9) compiles; (7, 12) replays it; the views break its fold and compile; (11, 6) replays it again
    for seq_q, seq_kv, view, replayed in ((5, 9, False, False), (7, 12, False, True), (8, 3, True, False),
                                           (10, 4, True, False), (11, 6, False, True)):
        graph, ids = _six_dim_sdpa(batch, seq_q, seq_kv)
        inputs = {ids[role]: rng.standard_normal(batch + (seq, 8)).astype(np.float32)
                  for role, seq in (("query", seq_q), ("key", seq_kv), ("value", seq_kv))}
        if view:  # the query's dim 1 steps over 4 of a (2, 4, 2, 2) layout: dim 0's stride is not dim 1's * 3
            wider = rng.standard_normal((2, 4, 2, 2, seq_q, 8)).astype(np.float32)
            inputs[ids["query"]] = wider[:, :3]
        got, log = _logged(capsys, compiled, ports, inputs)
        compiles = [line for line in log.splitlines() if ",compile," in line]
        assert len(compiles) == 1 and "sdpa_forward_cpu" in compiles[0], log
        assert ("plan=replayed" in compiles[0]) == replayed, log
        _check_against_reference(graph, inputs, got, "f32", f"at lengths {(seq_q, seq_kv)}, view {view}")


def test_an_output_of_the_wrong_length_is_refused_after_replays(rng):
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    engine = ga.Engine("cpu")
    for seq_q, seq_kv in ((4, 9), (6, 11)):
        _run_dynamic(compiled, ports, _inputs(SdpaGraphSpec(seq_q=seq_q, seq_kv=seq_kv), rng))
    inputs = _inputs(SdpaGraphSpec(seq_q=7, seq_kv=12), rng)
    (out,) = partition.get_output_ports()
    wrong = np.zeros((1, 2, 8, 32), np.float32)  # 8 rows for a query of 7
    with pytest.raises(ValueError, match=r"output declared \(1, 2, 8, 32\) but the partition produces \(1, 2, 7, 32\)"):
        compiled.execute(ga.Stream(engine), [ga.Tensor(lt, engine, inputs[lt.id]) for lt in ports],
                         [ga.Tensor(out, engine, wrong)])
    assert not wrong.any()


def test_a_replayed_class_still_checks_dtypes_and_known_dims(rng):
    """A call of a replayed class whose data has another dtype, or a known dim of another size, is refused as
    a compiled call would refuse it: the replay trusts only the lengths."""
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    for seq_q, seq_kv in ((4, 9), (6, 11)):
        _run_dynamic(compiled, ports, _inputs(SdpaGraphSpec(seq_q=seq_q, seq_kv=seq_kv), rng))
    inputs = _inputs(SdpaGraphSpec(seq_q=7, seq_kv=12), rng)
    query = spec.ids["query"]
    engine = ga.Engine("cpu")
    tensors = [ga.Tensor(ga.LogicalTensor(lt.id, "f16" if lt.id == query else lt.dtype, inputs[lt.id].shape), engine,
                         inputs[lt.id].astype(np.float16) if lt.id == query else inputs[lt.id]) for lt in ports]
    out = np.empty((1, 2, 7, 32), np.float32)
    (out_port,) = partition.get_output_ports()
    with pytest.raises(TypeError, match=rf"port {query} was compiled for f32, got a Tensor of f16"):
        compiled.execute(ga.Stream(engine), tensors, [ga.Tensor(out_port, engine, out)])
    wider = _inputs(SdpaGraphSpec(seq_q=7, seq_kv=12, head_dim=16), rng)
    tensors = [ga.Tensor(ga.LogicalTensor(lt.id, lt.dtype, wider[lt.id].shape), engine, wider[lt.id]) for lt in ports]
    with pytest.raises(ValueError, match=rf"tensor {query} has shape \(1, 2, 7, 16\), compiled for \(1, 2, -1, 32\)"):
        compiled.execute(ga.Stream(engine), tensors, [ga.Tensor(ga.LogicalTensor(out_port.id, "f32", (1, 2, 7, 16)),
                                                                engine, np.empty((1, 2, 7, 16), np.float32))])


BACKWARD_REPLAYED = {
    "plain": dict(stats=True, softmax_mode="inf_as_zero"),
    "causal": dict(stats=True, softmax_mode="inf_as_zero", mask="causal_top_left"),
    "gqa_5d_bottom_right": dict(stats=True, softmax_mode="inf_as_zero", gqa="5d", heads_q=4, heads_kv=2,
                                mask="causal_bottom_right"),
    "bshd_scale_divide": dict(stats=True, softmax_mode="inf_as_zero", layout="bshd", scale="divide"),
    "additive_mask": dict(stats=True, softmax_mode="inf_as_zero", mask="add"),
    "additive_mask_its_gradient": dict(stats=True, softmax_mode="inf_as_zero", mask="add", grad_mask=True),
    "select_mask_gqa_4d": dict(stats=True, softmax_mode="inf_as_zero", mask="select", gqa="4d", heads_q=4,
                               heads_kv=2),
}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("variant", sorted(BACKWARD_REPLAYED))
def test_backward_partitions_replay_new_lengths(variant, dtype, rng, capsys):
    """A backward partition compiled with unknown lengths replays its compile (the backward's plan and its O
    recompute's) for every later call of a class of lengths, a mask tensor and its gradient (dS) included;
    each call's gradients against the reference."""
    options = dict(BACKWARD_REPLAYED[variant])
    grad_mask = options.pop("grad_mask", False)
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1, dtype=dtype, **options)
    (partition,) = spec.build_backward(grad_mask=grad_mask).get_partitions()
    assert partition.kind == "sdpa_backward"
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    # no more query rows than keys: bottom-right rows that see no key have no reference gradient (NaN there)
    for i, (seq_q, seq_kv) in enumerate([(9, 13), (3, 19), (5, 6), (2, 30)]):
        concrete = SdpaGraphSpec(seq_q=seq_q, seq_kv=seq_kv, dtype=dtype, **options)
        graph, data = concrete.backward_case(rng, grad_mask=grad_mask)
        got, log = _logged(capsys, compiled, ports, data)
        compiles = [line for line in log.splitlines() if ",compile," in line]
        assert len(compiles) == 1 and "sdpa_backward_cpu" in compiles[0], log
        assert ("plan=replayed" in compiles[0]) == (i > 0), log
        assert f"sq={seq_q},skv={seq_kv}" in compiles[0], log
        want = ga.run_graph(graph, data, policy="debug")
        for name in ("grad_query", "grad_key", "grad_value") + (("grad_mask",) if grad_mask else ()):
            tid = concrete.ids[name]
            assert_grad_close(got[tid], want[tid], dtype, f"{name} at lengths {(seq_q, seq_kv)}")


@pytest.mark.parametrize("replayed", [False, True])
def test_an_output_that_maps_elements_to_one_place_is_refused(replayed, rng):
    """A writable output view whose strides send several indices to one location (stride 0 over the heads) is
    refused before anything is written, whether its call compiles in full or replays an earlier length."""
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    if replayed:  # the class of lengths (4, 9) compiles here; (6, 11) below replays it
        _run_dynamic(compiled, ports, _inputs(SdpaGraphSpec(seq_q=4, seq_kv=9), rng))
    inputs = _inputs(SdpaGraphSpec(seq_q=6, seq_kv=11), rng)
    (out,) = compiled.query_dynamic_outputs([ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in ports])
    memory = np.zeros(out.shape[-2:], np.float32)
    view = np.lib.stride_tricks.as_strided(memory, out.shape, (0, 0) + memory.strides)  # writable, heads on one place
    engine = ga.Engine("cpu")
    with pytest.raises(ValueError, match=rf"(output port {out.id} has strides .* several elements to one location|"
                                         rf"tensor {out.id}: output strides .* in one place)"):
        compiled.execute(ga.Stream(engine), [ga.Tensor(lt, engine, inputs[lt.id]) for lt in ports],
                         [ga.Tensor(ga.LogicalTensor(out.id, out.dtype, out.shape), engine, view)])
    assert not memory.any()


def test_a_replayed_layout_called_again_still_checks_what_its_key_leaves_out(rng):
    """A replayed length's second call hits the partition kept for its layout, whose key pins shapes and
    strides only: data of another dtype (of the same item size, put in the Tensor after it was made), a
    read-only output and an output over an input's memory are each refused there too, naming the port,
    before anything is written."""
    spec = SdpaGraphSpec(seq_q=-1, seq_kv=-1)
    (partition,) = spec.build().get_partitions()
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    _run_dynamic(compiled, ports, _inputs(SdpaGraphSpec(seq_q=4, seq_kv=9), rng))  # compiles the class
    inputs = _inputs(SdpaGraphSpec(seq_q=6, seq_kv=11), rng)
    first = _run_dynamic(compiled, ports, inputs)  # replays it for (6, 11), kept for this layout
    (out,) = partition.get_output_ports()
    query, value = spec.ids["query"], spec.ids["value"]
    engine = ga.Engine("cpu")
    stream = ga.Stream(engine)

    def execute(tensors, output):
        compiled.execute(stream, tensors, [ga.Tensor(ga.LogicalTensor(out.id, "f32", output.shape), engine, output)])

    plain = [ga.Tensor(lt, engine, inputs[lt.id]) for lt in ports]
    result = np.zeros_like(first[out.id])
    execute(plain, result)  # the kept partition: the same result
    np.testing.assert_array_equal(result, first[out.id])
    result[...] = 0
    swapped = ga.Tensor(next(lt for lt in ports if lt.id == query), engine, inputs[query])
    swapped.data = inputs[query].view(np.int32)  # f32's item size: the same key
    with pytest.raises(TypeError, match=rf"port {query} was compiled for f32 \(float32\), got data of int32"):
        execute([swapped if lt.id == query else t for lt, t in zip(ports, plain)], result)
    read_only = result.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=rf"output port {out.id} is read-only"):
        execute(plain, read_only)
    shared = inputs[value].copy()  # the value's memory, its first 6 rows also given as the output
    over_input = [ga.Tensor(lt, engine, shared) if lt.id == value else t for lt, t in zip(ports, plain)]
    before = shared.copy()
    with pytest.raises(ValueError, match=rf"output port {out.id} overlaps the memory of input port {value}"):
        execute(over_input, shared[:, :, :6, :])
    assert not result.any()
    np.testing.assert_array_equal(shared, before)
