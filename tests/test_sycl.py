"""The SYCL plugin on a real SYCL device (the OpenCL CPU device in CI), against the CPU path.

Kernel variants are compiled at run time, once per (dtype, head-size chunks)
per process, so the cases share a few head sizes.
"""
import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import (GRAD_TOLERANCES, STATS_TOLERANCE, SdpaGraphSpec, assert_close, assert_grad_close,
                               random_array)

from sycl_helpers import get_queue_or_skip

pytestmark = pytest.mark.sycl


@pytest.fixture(scope="module")
def queue():
    return get_queue_or_skip()


def to_device(array, queue):
    import dpnp

    return dpnp.asarray(array, sycl_queue=queue)


def host(array):
    import dpnp

    return dpnp.asnumpy(array)


GRAPH_CASES = {
    "plain": SdpaGraphSpec(scale=None, seq_q=17, seq_kv=33, head_dim=80),
    "scale_divide": SdpaGraphSpec(scale="divide", seq_q=1, seq_kv=33, head_dim=80),
    "add_mask_broadcast": SdpaGraphSpec(mask="add", mask_shape=(1, 1, 17, 33), seq_q=17, seq_kv=33, head_dim=80),
    "select_mask": SdpaGraphSpec(mask="select", seq_q=17, seq_kv=33, head_dim=80, stats=True),
    "causal_top_left": SdpaGraphSpec(mask="causal_top_left", seq_q=33, seq_kv=17, head_dim=80, stats=True,
                                     softmax_mode="inf_as_zero"),
    "causal_bottom_right": SdpaGraphSpec(mask="causal_bottom_right", seq_q=17, seq_kv=33, head_dim=80),
    "gqa_5d": SdpaGraphSpec(gqa="5d", heads_q=4, heads_kv=2, seq_q=17, seq_kv=33, head_dim=80, stats=True),
    "mqa_4d": SdpaGraphSpec(gqa="4d", heads_q=4, heads_kv=1, seq_q=17, seq_kv=33, head_dim=80),
    "bshd_reorder": SdpaGraphSpec(layout="bshd", reorder="transpose_reshape", seq_q=17, seq_kv=33, head_dim=80),
    "dropout": SdpaGraphSpec(dropout=0.25, seq_q=17, seq_kv=33, head_dim=80, stats=True),
    "head_dim_256": SdpaGraphSpec(seq_q=17, seq_kv=20, head_dim=256),
    "softcap_causal": SdpaGraphSpec(softcap=2.0, mask="causal_bottom_right", seq_q=17, seq_kv=33, head_dim=80,
                                    stats=True),
}


@pytest.fixture
def subgroup_only(queue):
    """The queue with matrix kernels off, so that the sub-group kernel is the one tested (mode restored after)."""
    from graphattn import sycl_runtime

    previous = sycl_runtime.set_matrix_kernels("off")
    yield queue
    sycl_runtime.set_matrix_kernels(previous)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_graph_forward_matches_cpu(subgroup_only, case, dtype, rng):
    """The sub-group kernel (every device); the XMX one has its own test below."""
    queue = subgroup_only
    spec = GRAPH_CASES[case].with_(dtype=dtype)
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    engine = ga.Engine(queue)
    partitions = graph.get_partitions()
    assert len(partitions) == 1
    on_device = ga.run_graph(graph, inputs, engine=engine, partitions=partitions)
    on_cpu = ga.run_graph(graph, inputs)
    assert_close(on_device[spec.ids["output"]], on_cpu[spec.ids["output"]], dtype, "output")
    if spec.stats:
        assert_close(on_device[spec.ids["stats"]], on_cpu[spec.ids["stats"]], "f32", "stats", STATS_TOLERANCE)


def test_graph_forward_uses_the_sycl_kernel(queue, rng):
    spec = GRAPH_CASES["gqa_5d"]
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    (partition,) = graph.get_partitions()
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in partition.get_input_ports()]
    compiled = partition.compile(in_lts, partition.get_output_ports(), ga.Engine(queue))
    assert compiled.kernel_name == "sdpa_forward_sycl"
    assert compiled.kernel.isa.startswith("subgroup")


BACKWARD_CASES = {
    "plain": dict(seq_q=17, seq_kv=33, head_dim=80),
    "causal": dict(mask="causal_bottom_right", seq_q=17, seq_kv=33, head_dim=80),
    "select_mask": dict(mask="select", seq_q=17, seq_kv=33, head_dim=80),
    "gqa_mask_dm": dict(gqa="5d", heads_q=4, heads_kv=2, mask="add", seq_q=17, seq_kv=33, head_dim=80,
                        grad_mask=True),
    "dropout": dict(dropout=0.2, seq_q=17, seq_kv=33, head_dim=80),
}


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_graph_backward_matches_cpu(queue, case, dtype, rng):
    variant = dict(BACKWARD_CASES[case])
    grad_mask = variant.pop("grad_mask", False)
    spec = SdpaGraphSpec(stats=True, softmax_mode="inf_as_zero", dtype=dtype, **variant)
    graph, data = spec.backward_case(rng, grad_mask=grad_mask)
    partitions = graph.get_partitions()
    assert [p.kind for p in partitions] == ["sdpa_backward"]
    on_device = ga.run_graph(graph, data, engine=ga.Engine(queue), partitions=partitions)
    on_cpu = ga.run_graph(graph, data)
    for name in ["grad_query", "grad_key", "grad_value"] + (["grad_mask"] if grad_mask else []):
        assert_grad_close(on_device[spec.ids[name]], on_cpu[spec.ids[name]], dtype, name)


FUNCTIONAL_CASES = {
    "plain": dict(shape_q=(2, 4, 17, 64), shape_kv=(2, 4, 33, 64)),
    "decode_s1": dict(shape_q=(1, 4, 1, 64), shape_kv=(1, 4, 40, 64)),
    "causal": dict(shape_q=(1, 2, 33, 64), shape_kv=(1, 2, 33, 64), is_causal=True),
    "causal_bottom_right": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), is_causal=True,
                                causal_alignment="bottom_right"),
    "gqa": dict(shape_q=(2, 8, 17, 64), shape_kv=(2, 2, 33, 64), enable_gqa=True),
    "float_mask": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), mask="float"),
    "bool_mask_fully_masked": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), mask="bool"),
    "dropout": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), dropout_p=0.3, dropout_seed=11),
    "window_sliding": dict(shape_q=(1, 2, 33, 64), shape_kv=(1, 2, 33, 64), window=(5, 0)),
    "window_two_sided_bottom_right": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 40, 64), window=(4, 3),
                                          causal_alignment="bottom_right"),
    "window_more_rows": dict(shape_q=(1, 2, 40, 64), shape_kv=(1, 2, 17, 64), window=(2, 1)),
    "window_float_mask": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), mask="float", window=(6, -1)),
    # the score modifiers (score_mods.py)
    "softcap": dict(shape_q=(1, 2, 17, 64), shape_kv=(1, 2, 33, 64), softcap=2.0, is_causal=True),
    "alibi_per_batch": dict(shape_q=(2, 2, 17, 64), shape_kv=(2, 2, 33, 64), alibi_slopes=(2, 2),
                            causal_alignment="bottom_right", is_causal=True),
    "sinks_window": dict(shape_q=(1, 2, 40, 64), shape_kv=(1, 2, 17, 64), sinks=2, window=(2, 1)),
    "modifiers_gqa_float_mask": dict(shape_q=(2, 8, 17, 64), shape_kv=(2, 2, 33, 64), enable_gqa=True, softcap=3.0,
                                     alibi_slopes=(8,), sinks=8, mask="float"),
}


def _functional_inputs(case, dtype, rng):
    c = dict(FUNCTIONAL_CASES[case])
    q = random_array(c.pop("shape_q"), dtype, rng)
    shape_kv = c.pop("shape_kv")
    k, v = random_array(shape_kv, dtype, rng), random_array(shape_kv, dtype, rng)
    if "alibi_slopes" in c:
        c["alibi_slopes"] = (rng.random(c["alibi_slopes"]) * 0.5).astype(np.float32)
    if "sinks" in c:
        c["sinks"] = rng.standard_normal(c["sinks"]).astype(np.float32)
    mask = c.pop("mask", None)
    if mask == "float":
        c["attn_mask"] = random_array((q.shape[-2], k.shape[-2]), dtype, rng)
    elif mask == "bool":
        keep = rng.random((1, 1, q.shape[-2], k.shape[-2])) < 0.7
        keep[..., 5, :] = False  # a fully masked row gives 0
        c["attn_mask"] = keep
    return q, k, v, c


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", sorted(FUNCTIONAL_CASES))
def test_functional_dpnp_in_dpnp_out(queue, case, dtype, rng):
    import dpnp

    q, k, v, kw = _functional_inputs(case, dtype, rng)
    kw_device = {name: to_device(a, queue) if isinstance(a, np.ndarray) else a for name, a in kw.items()}
    out, stats = ga.scaled_dot_product_attention(to_device(q, queue), to_device(k, queue), to_device(v, queue),
                                                 return_stats=True, **kw_device)
    assert isinstance(out, dpnp.ndarray) and isinstance(stats, dpnp.ndarray)
    assert out.sycl_queue == queue and out.dtype == q.dtype
    expected, expected_stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)
    assert_close(host(out), expected, dtype, "output")
    assert_close(host(stats), expected_stats, "f32", "stats", STATS_TOLERANCE)

    grad_out = random_array(expected.shape, dtype, rng)
    sinks = "sinks" in kw
    grads = ga.scaled_dot_product_attention_backward(
        to_device(grad_out, queue), to_device(q, queue), to_device(k, queue), to_device(v, queue), out, stats,
        return_mask_grad=True, return_sinks_grad=sinks, **kw_device)
    expected_grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, expected, expected_stats,
                                                              return_mask_grad=True, return_sinks_grad=sinks, **kw)
    assert len(grads) == len(expected_grads)
    for name, got, want in zip(("dq", "dk", "dv", "dmask", "dsinks"), grads, expected_grads):
        if want is None:
            assert got is None
            continue
        assert isinstance(got, dpnp.ndarray)
        assert_grad_close(host(got), want, dtype, name)


def test_usm_ndarray_views_with_offsets_and_strides(queue, rng):
    """A (N, S, H, D) buffer viewed as (N, H, S, D) with an offset: strides and offset are honoured."""
    import dpnp.tensor as dpt

    backing = random_array((2, 17, 3, 64), "f32", rng)
    device = dpt.asarray(backing, sycl_queue=queue)
    q = dpt.permute_dims(device[:, :, 1:3, :], (0, 2, 1, 3))  # offset by one head, strided
    k = dpt.permute_dims(device[:, :, 0:2, :], (0, 2, 1, 3))
    out = ga.scaled_dot_product_attention(q, k, k)
    assert isinstance(out, dpt.usm_ndarray)
    qh = backing[:, :, 1:3, :].transpose(0, 2, 1, 3)
    kh = backing[:, :, 0:2, :].transpose(0, 2, 1, 3)
    assert_close(dpt.asnumpy(out), ga.scaled_dot_product_attention(qh, kh, kh), "f32")


def test_graph_execute_is_asynchronous_until_stream_wait(queue, rng):
    spec = GRAPH_CASES["plain"]
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    engine = ga.Engine("sycl", queue=queue)
    stream = ga.Stream(engine)
    (partition,) = graph.get_partitions()
    import dpnp

    device = {i: to_device(a, queue) for i, a in inputs.items()}
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in partition.get_input_ports()]
    compiled = partition.compile(in_lts, partition.get_output_ports(), engine)
    (out_lt,) = compiled.outputs
    out = dpnp.empty(out_lt.shape, dtype=np.float32, sycl_queue=queue)
    compiled.execute(stream, [ga.Tensor(lt, engine, device[lt.id]) for lt in compiled.inputs],
                     [ga.Tensor(out_lt, engine, out)])
    stream.wait()
    assert_close(host(out), ga.run_graph(graph, inputs)[out_lt.id], "f32")


def test_xmx_sources_compile(queue):
    """The joint_matrix kernel compiles for this device (build_xmx raises with the compiler's log otherwise).
    The OpenCL CPU device keeps the bf16 kernel exactly where it compiles for AMX tiles."""
    from graphattn import _sycl, sycl_runtime

    kept = _sycl.build_xmx(queue)
    if queue.sycl_device.is_cpu:
        assert kept == sycl_runtime.opencl_cpu_targets_amx()
    builds, seconds = _sycl.build_stats()
    assert builds >= 1 and seconds > 0


@pytest.fixture
def xmx_forced(queue):
    """The queue with matrix kernels forced on (mode restored after); skips where the device drops them."""
    from graphattn import _sycl, sycl_runtime

    if not _sycl.build_xmx(queue):
        pytest.skip("the device drops joint_matrix kernels (no XMX or AMX-BF16)")
    previous = sycl_runtime.set_matrix_kernels("force")
    yield queue
    sycl_runtime.set_matrix_kernels(previous)


XMX_CASES = dict(GRAPH_CASES, head_dims_72_40=SdpaGraphSpec(seq_q=17, seq_kv=33, head_dim=72, head_dim_v=40))


@pytest.mark.parametrize("case", sorted(XMX_CASES))
def test_xmx_forward_matches_cpu(xmx_forced, case, rng):
    """bf16 through the joint_matrix kernel (AMX tiles on the OpenCL CPU device) against the CPU path;
    fewer than 8 query rows stay on the sub-group kernel."""
    spec = XMX_CASES[case].with_(dtype="bf16")
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    (partition,) = graph.get_partitions()
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in partition.get_input_ports()]
    kernel = partition.compile(in_lts, partition.get_output_ports(), ga.Engine(xmx_forced)).kernel.isa
    if spec.seq_q >= 8:
        assert kernel == "xmx"
    else:
        assert kernel.startswith("subgroup (fewer than 8 query rows")
    on_device = ga.run_graph(graph, inputs, engine=ga.Engine(xmx_forced), partitions=[partition])
    on_cpu = ga.run_graph(graph, inputs)
    assert_close(on_device[spec.ids["output"]], on_cpu[spec.ids["output"]], "bf16", "output")
    if spec.stats:
        assert_close(on_device[spec.ids["stats"]], on_cpu[spec.ids["stats"]], "f32", "stats", STATS_TOLERANCE)


def test_xmx_forward_takes_the_score_modifiers(xmx_forced, rng):
    """f16 through the joint_matrix kernel with softcap, ALiBi, sinks, GQA and a window, against the CPU path."""
    q, k, v = (random_array(shape, "f16", rng) for shape in ((1, 8, 24, 64), (1, 2, 40, 64), (1, 2, 40, 64)))
    kw = dict(enable_gqa=True, softcap=2.5, alibi_slopes=(rng.random(8) * 0.5).astype(np.float32),
              sinks=rng.standard_normal(8).astype(np.float32), window=(9, 0), causal_alignment="bottom_right")
    out, stats = ga.scaled_dot_product_attention(to_device(q, xmx_forced), to_device(k, xmx_forced),
                                                 to_device(v, xmx_forced), return_stats=True, **kw)
    expected, expected_stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)
    assert_close(host(out), expected, "f16", "output")
    assert_close(host(stats), expected_stats, "f32", "stats", STATS_TOLERANCE)


def test_matrix_kernel_modes(queue, rng):
    """"off" keeps every forward on the sub-group kernel; "auto" needs the device's ext_intel_matrix aspect."""
    from graphattn import sycl_runtime

    spec = GRAPH_CASES["plain"].with_(dtype="bf16")
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    (partition,) = graph.get_partitions()
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in partition.get_input_ports()]
    kernels = {}
    for mode in ("off", "auto"):
        previous = sycl_runtime.set_matrix_kernels(mode)
        try:
            kernels[mode] = partition.compile(in_lts, partition.get_output_ports(), ga.Engine(queue)).kernel.isa
        finally:
            sycl_runtime.set_matrix_kernels(previous)
    assert kernels["off"] == "subgroup (matrix kernels are off)"
    if queue.sycl_device.is_cpu:  # the OpenCL CPU device keeps the kernel where it compiles for AMX tiles
        assert (kernels["auto"] == "xmx") == sycl_runtime.opencl_cpu_targets_amx()
    with pytest.raises(ValueError, match="matrix kernel mode must be one of"):
        sycl_runtime.set_matrix_kernels("always")


def test_head_size_past_the_kernels_runs_on_the_host_reference(queue, rng, capsys):
    """D=600 is past the SYCL kernels' 512: the partition runs on the reference, with the reason logged."""
    x = random_array((1, 1, 4, 600), "f32", rng)
    ga.set_verbose(1)
    try:
        out = ga.scaled_dot_product_attention(to_device(x, queue), to_device(x, queue), to_device(x, queue))
    finally:
        ga.set_verbose(0)
    assert "at most 512" in capsys.readouterr().err
    assert_close(host(out), ga.scaled_dot_product_attention(x, x, x), "f32")


def test_errors_name_the_problem(queue, rng):
    q = to_device(random_array((1, 1, 4, 64), "f32", rng), queue)
    with pytest.raises(TypeError, match="all be USM arrays"):
        ga.scaled_dot_product_attention(q, np.zeros((1, 1, 4, 64), np.float32), q)
    with pytest.raises(TypeError, match="dpctl.SyclQueue"):
        ga.Engine("sycl", queue=object())
    with pytest.raises(ValueError, match="engine kind"):
        ga.Engine("tpu")
    import dpctl

    if not dpctl.get_devices(device_type="gpu"):
        with pytest.raises(RuntimeError, match="no GPU device"):
            ga.Engine("gpu")


def test_sycl_grad_tolerances_are_the_cpu_ones():
    """One tolerance table serves both devices (stated in graphattn.testing)."""
    assert set(GRAD_TOLERANCES) == {ga.DataType.f32, ga.DataType.bf16, ga.DataType.f16}


VARLEN_OPTIONS = {
    "causal": dict(is_causal=True),
    "window_top_left": dict(window=(4, 1), causal_alignment="top_left"),
    "modifiers": dict(softcap=2.5, alibi_slopes=np.linspace(0.1, 0.4, 4).astype(np.float32),
                      sinks=np.array([0.5, -1.0, 0.0, 1.5], np.float32), is_causal=True),
    "dropout": dict(dropout_p=0.25, dropout_seed=11, dropout_offset=3, is_causal=True),
}


@pytest.mark.parametrize("name", list(VARLEN_OPTIONS))
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_varlen_forward_on_sycl(subgroup_only, name, dtype):
    """Packed sequences (empty ones and S_q > S_k among them) on the sub-group forward, against the float64
    reference; the same length record as the CPU's."""
    from graphattn.testing import varlen_reference

    rng = np.random.default_rng(5)
    lengths_q, lengths_k = (5, 0, 17, 1, 9), (7, 3, 17, 0, 4)
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k))
    q = random_array((int(cq[-1]), 4, 80), dtype, rng)
    k = random_array((int(ck[-1]), 2, 80), dtype, rng)
    v = random_array((int(ck[-1]), 2, 80), dtype, rng)
    options = VARLEN_OPTIONS[name]
    out, stats = ga.varlen_attention(*(to_device(x, subgroup_only) for x in (q, k, v)), cq, ck, return_stats=True,
                                     **options)
    ref_out, ref_stats = varlen_reference(q, k, v, cq, ck, **options)
    assert_close(host(out), ref_out, dtype, "out")
    assert_close(host(stats), ref_stats, np.float32, "stats", STATS_TOLERANCE)
    with pytest.raises(NotImplementedError, match="SYCL backward"):
        ga.varlen_attention_backward(out, *(to_device(x, subgroup_only) for x in (q, k, v)), out, stats, cq, ck)
