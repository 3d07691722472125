"""The spec's training-backward graph: fused into one sdpa_backward partition and checked against the
op-by-op reference executor on the same graph."""
import pytest

import graphattn as ga
from graphattn.testing import SdpaGraphSpec, assert_grad_close, run_into_padded_outputs

pytestmark = pytest.mark.cpu

VARIANTS = {
    "plain": dict(),
    "divide_scale": dict(scale="divide"),
    "no_scale": dict(scale=None),
    "add_mask_dm": dict(mask="add", grad_mask=True),
    "add_mask_broadcast": dict(mask="add", mask_shape=(1, 1, 16, 16)),
    "select_mask": dict(mask="select"),
    "causal_top_left": dict(mask="causal_top_left", seq_q=40, seq_kv=70),
    "causal_bottom_right": dict(mask="causal_bottom_right", seq_q=20, seq_kv=70),
    "gqa_5d": dict(gqa="5d", heads_q=4, heads_kv=2, seq_q=37, seq_kv=50),
    "gqa_4d": dict(gqa="4d", heads_q=4, heads_kv=2, seq_q=37, seq_kv=50),
    "mqa_d80": dict(gqa="5d", heads_q=4, heads_kv=1, seq_q=70, seq_kv=70, head_dim=80),
    "sq_ne_skv_dv": dict(seq_q=17, seq_kv=90, head_dim_v=48),
    "dropout": dict(dropout=0.2, seq_q=33, seq_kv=65),
}


def check(dtype, rng, grad_mask=False, **variant):
    spec = SdpaGraphSpec(stats=True, softmax_mode="inf_as_zero", dtype=dtype, **variant)
    backward, data = spec.backward_case(rng, grad_mask=grad_mask)
    assert [p.kind for p in backward.get_partitions()] == ["sdpa_backward"]
    fused = ga.run_graph(backward, data)
    reference = ga.run_graph(backward, data, policy="debug")
    for name in ["grad_query", "grad_key", "grad_value"] + (["grad_mask"] if grad_mask else []):
        assert fused[spec.ids[name]].shape == reference[spec.ids[name]].shape
        # dM is f32, but computed from inputs of `dtype`: its error is that dtype's
        assert_grad_close(fused[spec.ids[name]], reference[spec.ids[name]], dtype, name)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_backward_graph_fuses_and_matches_reference(variant, dtype, rng):
    check(dtype, rng, **VARIANTS[variant])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("variant", ["gqa_5d", "causal_bottom_right", "add_mask_dm"])
def test_gradients_inside_larger_buffers_get_only_their_views_written(variant, dtype, rng):
    """dQ, dK, dV (and dM) are views with gaps of sentinel around their rows and columns: the kernel fills
    the views (checked against the reference) and leaves every gap as it was."""
    spec = SdpaGraphSpec(stats=True, softmax_mode="inf_as_zero", dtype=dtype,
                         **{k: v for k, v in VARIANTS[variant].items() if k != "grad_mask"})
    backward, data = spec.backward_case(rng, grad_mask=VARIANTS[variant].get("grad_mask", False))
    (partition,) = backward.get_partitions()
    views, untouched = run_into_padded_outputs(partition, data)
    reference = ga.run_graph(backward, data, policy="debug")
    assert all(untouched.values()), f"written outside: {[t for t, ok in untouched.items() if not ok]}"
    for tid, view in views.items():
        assert_grad_close(view, reference[tid], dtype, f"output {tid}")


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_verbose_names_the_backward_kernel(dtype, capsys, rng):
    """The log names the backward kernel, the build the call runs (AMX split products for f16 where
    the CPU has AMX) and the rule that chose it."""
    ga.set_verbose(1)
    try:
        check(dtype, rng, mask="causal_top_left", seq_q=70, seq_kv=90)
    finally:
        ga.set_verbose(0)
    err = capsys.readouterr().err
    assert "sdpa_backward" in err and "sdpa_backward_cpu" in err
    isa = ga.backward_isa(dtype, 70, 90)
    assert f"isa={isa},why=" in err and ",kv_items=" in err
    if isa.startswith("amx"):
        assert f"why={dtype} with both sequences from" in err
    else:  # no AMX candidate takes f32; one that could run the call but declines says why
        assert f"isa={isa},why=a vector build runs every call," in err or " declines: " in err


def test_dk_per_query_head_falls_back_to_the_reference(rng):
    """Without the ReduceSum, 5D GQA asks for dK per query head: the fused kernel only writes the group sum,
    so the partition runs on the reference executor, still correctly."""
    spec = SdpaGraphSpec(stats=True, softmax_mode="inf_as_zero", gqa="5d", heads_q=4, heads_kv=2)
    graph = spec.build_backward()
    reduce_ops = [op for op in graph.ops if op.kind == ga.OpKind.ReduceSum]
    assert len(reduce_ops) == 2  # the well-formed graph has them; a graph without them is checked below
    g = ga.Graph("cpu")
    for op in graph.ops:
        if op.kind != ga.OpKind.ReduceSum:
            g.add_op(op)
    g.finalize()
    (partition,) = [p for p in g.get_partitions() if p.kind == "sdpa_backward"]
    ports = partition.get_input_ports()
    compiled = partition.compile(ports, partition.get_output_ports(), ga.Engine("cpu"))
    assert compiled.kernel_name == "reference"
