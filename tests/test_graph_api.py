"""The graph API: construction, validation errors, partitions, compile and execute contracts."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import SdpaGraphSpec, assert_close

from subprocess_helpers import run_python

pytestmark = pytest.mark.cpu


def lt(i, shape=(2, 3), dtype="f32"):
    return ga.LogicalTensor(i, dtype, shape)


def test_public_names_and_enums():
    assert str(ga.DataType.f32).endswith("f32")
    t = ga.LogicalTensor(3, ga.DataType.bf16, (1, -1, 4))
    assert (t.id, t.dtype, t.shape, t.strides) == (3, ga.DataType.bf16, (1, -1, 4), None)
    assert ga.LogicalTensor(0, "f32", (2, 3, 4)).strides == (12, 4, 1)
    op = ga.Op(0, ga.OpKind.MatMul, name="mm").add_input(lt(0)).add_input(lt(1, (3, 2))).add_output(lt(2, (2, 2)))
    op.set_attr("transpose_b", False)
    assert op.attrs == {"transpose_a": False, "transpose_b": False}
    ga.Stream(ga.Engine("cpu")).wait()


@pytest.mark.parametrize("make,error,exc", [
    (lambda: ga.LogicalTensor(0, "f64", (1,)), "unknown dtype", ValueError),
    (lambda: ga.LogicalTensor(0, "f32", (2, -3)), "dims must be", ValueError),
    (lambda: ga.Op(0, "Conv", []), "unknown op kind", ValueError),
    (lambda: ga.Op(0, "MatMul", attrs={"transpose_c": True}), "unknown attribute 'transpose_c'", ValueError),
    (lambda: ga.Op(0, "MatMul", attrs={"transpose_b": 1}), "must be a bool", TypeError),
    (lambda: ga.Op(0, "SoftMax", attrs={"mode": "fast"}), "must be one of", ValueError),
    (lambda: ga.Engine("tpu"), "not available", ValueError),
])
def test_bad_construction(make, error, exc):
    with pytest.raises(exc, match=error):
        make()


def test_add_op_checks_arity_attrs_and_dtypes():
    graph = ga.Graph()
    with pytest.raises(ValueError, match=r"MatMul op 0 .*takes 2 inputs, got 1"):
        graph.add_op(ga.Op(0, "MatMul", [lt(0)], [lt(1)]))
    with pytest.raises(ValueError, match=r"StaticReshape op 1 .*missing required attribute\(s\) \['shape'\]"):
        graph.add_op(ga.Op(1, "StaticReshape", [lt(0)], [lt(1)]))
    with pytest.raises(TypeError, match=r"MatMul op 2 .*share one float dtype"):
        graph.add_op(ga.Op(2, "MatMul", [lt(0), lt(1, (3, 2), "bf16")], [lt(2, (2, 2))]))
    with pytest.raises(TypeError, match=r"SoftMax op 3 .*stats\) must be f32"):
        graph.add_op(ga.Op(3, "SoftMax", [lt(0)], [lt(1), lt(2, (2, 1), "bf16")], {"axis": -1}))


def test_duplicate_ids_and_inconsistent_tensors():
    graph = ga.Graph()
    graph.add_op(ga.Op(0, "Exp", [lt(0)], [lt(1)]))
    with pytest.raises(ValueError, match="op id 0 is already used"):
        graph.add_op(ga.Op(0, "Exp", [lt(1)], [lt(2)]))
    with pytest.raises(ValueError, match="tensor 1 is already produced by Exp op 0"):
        graph.add_op(ga.Op(1, "Exp", [lt(0)], [lt(1)]))
    with pytest.raises(ValueError, match="tensor 1 is bf16 rank 2 here but f32"):
        graph.add_op(ga.Op(2, "TypeCast", [lt(1, dtype="bf16")], [lt(3)]))


def test_cycle_is_rejected():
    graph = ga.Graph()
    graph.add_op(ga.Op(0, "Add", [lt(0), lt(2)], [lt(1)]))
    graph.add_op(ga.Op(1, "Exp", [lt(1)], [lt(2)]))
    with pytest.raises(ValueError, match=r"cycle through ops \[0, 1\]"):
        graph.finalize()


def test_declared_output_shape_must_match_inference():
    graph = ga.Graph()
    graph.add_op(ga.Op(0, "MatMul", [lt(0, (2, 3)), lt(1, (3, 4))], [lt(2, (2, 5))]))
    with pytest.raises(ValueError, match=r"MatMul op 0 .*declared \(2, 5\) but the op produces \(2, 4\)"):
        graph.finalize()


def test_unfusable_graph_runs_op_by_op(rng):
    # MatMul -> SoftMax on axis -2 is no SDPA pattern: every op is its own partition.
    graph = ga.Graph()
    graph.add_op(ga.Op(0, "MatMul", [lt(0, (4, 8)), lt(1, (8, 4))], [lt(2, (4, 4))]))
    graph.add_op(ga.Op(1, "SoftMax", [lt(2, (4, 4))], [lt(3, (4, 4))], {"axis": 0}))
    graph.add_op(ga.Op(2, "MatMul", [lt(3, (4, 4)), lt(4, (4, 5))], [lt(5, (4, 5))]))
    parts = graph.get_partitions()
    assert [p.kind for p in parts] == ["op", "op", "op"] and all(p.is_supported() for p in parts)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8, 4), (4, 5)))
    out = ga.run_graph(graph, {0: a, 1: b, 4: c})[5]
    s = a.astype(np.float64) @ b
    p = np.exp(s - s.max(0)) / np.exp(s - s.max(0)).sum(0)
    assert_close(out, p @ c, "f32")


def test_intermediate_used_outside_blocks_fusion(rng):
    spec = SdpaGraphSpec()
    graph = spec.build()
    ops = graph.ops
    softmax = next(op for op in ops if op.kind == ga.OpKind.SoftMax)
    extra = ga.Graph()
    for op in ops:
        extra.add_op(op)
    extra.add_op(ga.Op(99, "End", [softmax.outputs[0]], []))
    kinds = [p.kind for p in extra.get_partitions()]
    assert "sdpa_forward" not in kinds and len(kinds) == len(ops)
    fused_free = ga.run_graph(extra, spec.random_inputs(rng))
    assert softmax.outputs[0].id in fused_free


def test_debug_policy_and_ports():
    spec = SdpaGraphSpec(mask="add", stats=True)
    graph = spec.build()
    (fused,) = graph.get_partitions("fusion")
    assert {t.id for t in fused.get_input_ports()} == {spec.ids[r] for r in ("query", "key", "value", "scale", "mask")}
    assert [t.id for t in fused.get_output_ports()] == [spec.ids["output"], spec.ids["stats"]] or \
        {t.id for t in fused.get_output_ports()} == {spec.ids["output"], spec.ids["stats"]}
    debug = graph.get_partitions("debug")
    assert len(debug) == len(graph.ops) and all(p.kind == "op" for p in debug)
    with pytest.raises(ValueError, match="policy"):
        graph.get_partitions("max")


def test_compile_and_execute_contracts(rng):
    spec = SdpaGraphSpec(mask="add", seq_q=8)
    graph = spec.build()
    (part,) = graph.get_partitions()
    engine, stream = ga.Engine("cpu"), ga.Stream(ga.Engine("cpu"))
    ins = part.get_input_ports()
    with pytest.raises(ValueError, match=r"compile is missing this input logical tensor"):
        part.compile(ins[:-1], part.get_output_ports(), engine)
    bad = [ga.LogicalTensor(t.id, "bf16", t.shape) if t.id == spec.ids["query"] else t for t in ins]
    with pytest.raises(TypeError, match=f"tensor {spec.ids['query']}: dtype bf16 differs"):
        part.compile(bad, part.get_output_ports(), engine)
    compiled = part.compile(ins, part.get_output_ports(), engine)
    out_lt = compiled.query_logical_tensor(spec.ids["output"])
    assert out_lt.shape == (1, 2, 8, 32) and out_lt.strides == (512, 256, 32, 1)
    data = spec.random_inputs(rng)
    in_tensors = [ga.Tensor(t, engine, data[t.id]) for t in compiled.inputs]
    out = ga.Tensor(out_lt, engine, np.empty(out_lt.shape, np.float32))
    with pytest.raises(ValueError, match=r"execute got 4 inputs, expected 5"):
        compiled.execute(stream, in_tensors[:-1], [out])
    with pytest.raises(ValueError, match=r"execute got 0 outputs, expected 1"):
        compiled.execute(stream, in_tensors, [])
    with pytest.raises(TypeError, match="data dtype float64 does not match"):
        ga.Tensor(out_lt, engine, np.empty(out_lt.shape))
    with pytest.raises(ValueError, match=r"data shape \(1, 2, 8, 31\) does not match"):
        ga.Tensor(out_lt, engine, np.empty((1, 2, 8, 31), np.float32))
    strided = np.empty((1, 2, 8, 64), np.float32)[..., ::2]
    with pytest.raises(ValueError, match=r"has strides .* compiled for"):
        compiled.execute(stream, in_tensors, [ga.Tensor(out_lt, engine, strided)])
    compiled.execute(stream, list(reversed(in_tensors)), [out])  # matched by id, any order


def test_non_scalar_scale_falls_back_to_reference(rng):
    # A per-head scale broadcast over the scores is valid SDPA, but the kernel takes one value.
    q, k, v = lt(0, (1, 2, 6, 32)), lt(1, (1, 2, 6, 32)), lt(2, (1, 2, 6, 32))
    scale = lt(3, (1, 2, 1, 1))
    graph = ga.Graph()
    graph.add_op(ga.Op(0, "MatMul", [q, k], [lt(4, (1, 2, 6, 6))], {"transpose_b": True}))
    graph.add_op(ga.Op(1, "Multiply", [lt(4, (1, 2, 6, 6)), scale], [lt(5, (1, 2, 6, 6))]))
    graph.add_op(ga.Op(2, "SoftMax", [lt(5, (1, 2, 6, 6))], [lt(6, (1, 2, 6, 6))], {"axis": -1}))
    graph.add_op(ga.Op(3, "MatMul", [lt(6, (1, 2, 6, 6)), v], [lt(7, (1, 2, 6, 32))]))
    (part,) = graph.get_partitions()
    assert part.kind == "sdpa_forward"
    engine = ga.Engine("cpu")
    compiled = part.compile(part.get_input_ports(), part.get_output_ports(), engine)
    assert compiled.kernel_name == "reference" and "single value" in compiled.kernel.reason
    data = {i: rng.standard_normal((1, 2, 6, 32)).astype(np.float32) for i in range(3)}
    data[3] = np.array([0.5, 0.25], np.float32).reshape(1, 2, 1, 1)
    out = ga.run_graph(graph, data)[7]
    x, y, z = (data[i].astype(np.float64) for i in range(3))
    s = x @ y.swapaxes(-1, -2) * data[3]
    p = np.exp(s - s.max(-1, keepdims=True))
    assert_close(out, (p / p.sum(-1, keepdims=True)) @ z, "f32")


def test_verbose_names_decisions(capsys):
    ga.set_verbose(1)
    try:
        spec = SdpaGraphSpec(mask="causal_top_left")
        graph = spec.build()
        ga.run_graph(graph, spec.random_inputs(np.random.default_rng(0)))
    finally:
        ga.set_verbose(0)
    err = capsys.readouterr().err
    assert "graphattn_verbose,partition,id=0,sdpa_forward" in err
    assert f"sdpa_forward_cpu,isa={ga.forward_isa('f32', spec.seq_q)}" in err
    assert "graphattn_verbose,exec,partition=0,sdpa_forward_cpu" in err


@pytest.mark.parametrize("dtype,dropout,seq,heads", [("bf16", 0.0, 32, 2), ("f16", 0.0, 32, 2), ("bf16", 0.3, 32, 2),
                                                     ("f32", 0.0, 32, 2), ("f32", 0.0, 300, 64)])
def test_verbose_names_the_kernel_of_each_call(dtype, dropout, seq, heads, capsys):
    """The logged kernel build is the one the call runs: AMX takes bf16, and f16 and f32 as split products
    (f32 on long enough calls with enough heads), without dropout; dropout stays on the vector build (the
    one short query rows get)."""
    ga.set_verbose(1)
    try:
        spec = SdpaGraphSpec(dtype=dtype, seq_q=seq, heads_q=heads, dropout=dropout)
        ga.run_graph(spec.build(), spec.random_inputs(np.random.default_rng(0)))
    finally:
        ga.set_verbose(0)
    err = capsys.readouterr().err
    amx = {"bf16": "amx_bf16", "f16": "amx_bf16x3", "f32": "amx_bf16x6"}[dtype]
    vector_build = ga.forward_isa(dtype, seq_q=1)
    chosen = ga.forward_isa(dtype, seq, seq, batch=heads)
    assert chosen in (amx, vector_build)
    expected = chosen if dropout == 0.0 else vector_build
    assert f"sdpa_forward_cpu,isa={expected},why=" in err
    if dropout and chosen == amx:
        assert f"why={amx} declines: dropout: the tile kernel does not fuse it;" in err
    assert f"layout={'tiles' if expected == amx else ''}" in err


VERBOSE_PLAN_SCRIPT = """
import sys
import numpy as np, graphattn as ga
sys.stderr = sys.stdout  # the verbose lines, for run_python
ga.set_verbose(1)
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 1, 64), dtype=np.float32)
k = rng.standard_normal((1, 2, 2048, 64), dtype=np.float32)
ga.scaled_dot_product_attention(q, k, k)  # decode: two heads of one row on four threads
q = rng.standard_normal((1, 1, 64, 64), dtype=np.float32)
ga.scaled_dot_product_attention(q, q, q, is_causal=True)  # items of unequal work
q = rng.standard_normal((1, 4, 70, 64), dtype=np.float32)
k = rng.standard_normal((1, 2, 90, 64), dtype=np.float32)
out, stats = ga.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True, return_stats=True)
ga.scaled_dot_product_attention_backward(out, q, k, k, out, stats, is_causal=True, enable_gqa=True)
"""


def test_verbose_names_the_rule_and_the_work_layout():
    """The compile line says why the kernel build was chosen and how the call's work goes to threads: two
    decode heads on four threads split their 2048 keys in four splits of 512 (eight pieces of work, each
    thread home first on its own); causal items go out longest first from one counter.  The backward of
    two K/V heads under a causal mask splits each head's key blocks in two (one item per thread wanted)."""
    err = run_python(VERBOSE_PLAN_SCRIPT, OMP_NUM_THREADS="4")
    decode, causal, _, backward = (line for line in err.splitlines() if ",compile," in line)
    assert ",why=" in decode
    assert ("layout=rows,item_rows=1,items=2,key_splits=4,keys_per_split=512,threads=4,order=home_first,"
            in decode)
    assert "order=longest_first," in causal
    assert "sdpa_backward_cpu,isa=" in backward and ",why=" in backward
    assert ",kv_items=2,key_splits=2," in backward and ",threads=4,order=batch_major+pieces," in backward
