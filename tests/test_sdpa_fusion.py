"""Every spec SDPA variant fuses into ONE partition, and the fused kernel matches the reference.

The reference is the same graph run op by op (policy="debug") in float64,
rounded to each op's declared dtype.  Tolerances: graphattn.testing.TOLERANCES.
"""

import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import STATS_TOLERANCE, SdpaGraphSpec, assert_close, run_into_padded_outputs

from subprocess_helpers import run_python, run_python_logged

pytestmark = pytest.mark.cpu

DTYPES = ["f32", "bf16", "f16"]

VARIANTS = {
    "plain": SdpaGraphSpec(scale=None),
    "scale_multiply": SdpaGraphSpec(scale="multiply"),
    "scale_divide": SdpaGraphSpec(scale="divide"),
    "add_mask": SdpaGraphSpec(mask="add"),
    "add_mask_broadcast": SdpaGraphSpec(mask="add", batch=2, mask_shape=(2, 1, 1, 16)),
    "select_mask": SdpaGraphSpec(mask="select", mask_shape=(1, 2, 16, 16)),
    "causal_top_left": SdpaGraphSpec(mask="causal_top_left"),
    "causal_top_left_gt_form": SdpaGraphSpec(mask="causal_top_left", causal_form="gt"),
    "causal_bottom_right": SdpaGraphSpec(mask="causal_bottom_right", seq_q=9, seq_kv=23),
    "causal_bottom_right_gt_form": SdpaGraphSpec(mask="causal_bottom_right", seq_q=9, seq_kv=23, causal_form="gt"),
    "gqa_4d": SdpaGraphSpec(gqa="4d", heads_q=8, heads_kv=2, mask="add"),
    "gqa_5d": SdpaGraphSpec(gqa="5d", heads_q=8, heads_kv=2, mask="causal_top_left"),
    "mqa_4d": SdpaGraphSpec(gqa="4d", heads_q=4, heads_kv=1),
    "reorder_transpose": SdpaGraphSpec(reorder="transpose"),
    "reorder_transpose_reshape": SdpaGraphSpec(reorder="transpose_reshape", mask="select"),
    "gqa_4d_reorder": SdpaGraphSpec(gqa="4d", heads_q=4, heads_kv=2, reorder="transpose_reshape"),
    "training_forward_stats": SdpaGraphSpec(stats=True, mask="causal_top_left", softmax_mode="inf_as_zero"),
    "gqa_5d_training_forward": SdpaGraphSpec(gqa="5d", heads_q=4, heads_kv=2, stats=True),
}

ODD_SHAPES = {
    "s1": dict(seq_q=1, seq_kv=1),
    "decode": dict(seq_q=1, seq_kv=77),
    "s17": dict(seq_q=17),
    "sq_ne_skv": dict(seq_q=70, seq_kv=131),
    "d80": dict(head_dim=80),
    "d256": dict(head_dim=256, seq_q=20),
    "dv_ne_d": dict(head_dim=48, head_dim_v=24),
    "long": dict(seq_q=200, seq_kv=300, batch=2),
}


def check_fused(spec: SdpaGraphSpec, rng, mutate_inputs=None):
    graph = spec.build()
    partitions = graph.get_partitions()
    assert len(partitions) == 1, f"expected one fused partition, got {partitions}"
    assert partitions[0].kind == "sdpa_forward"
    inputs = spec.random_inputs(rng)
    if mutate_inputs:
        mutate_inputs(spec, inputs)
    engine = ga.Engine("cpu")
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape, ga.tensor.element_strides(inputs[lt.id]))
              for lt in partitions[0].get_input_ports()]
    compiled = partitions[0].compile(in_lts, partitions[0].get_output_ports(), engine)
    assert compiled.kernel_name == "sdpa_forward_cpu", getattr(compiled.kernel, "reason", "")
    fused = ga.run_graph(graph, inputs, partitions=partitions)
    reference = ga.run_graph(graph, inputs, policy="debug")
    out = spec.ids["output"]
    assert_close(fused[out], reference[out], spec.dtype, "output")
    if spec.stats:
        stats = spec.ids["stats"]
        assert_close(fused[stats], reference[stats], "f32", "stats", STATS_TOLERANCE)
    return fused, reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_fuses_and_matches(variant, dtype, rng):
    check_fused(VARIANTS[variant].with_(dtype=dtype), rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", sorted(ODD_SHAPES))
def test_odd_shapes(shape, dtype, rng):
    check_fused(SdpaGraphSpec(mask="add", stats=True, dtype=dtype, **ODD_SHAPES[shape]), rng)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", sorted(ODD_SHAPES))
def test_variant_on_odd_shape(variant, shape, dtype, rng):
    spec = VARIANTS[variant]
    extra = dict(ODD_SHAPES[shape])
    if spec.mask_shape is not None:
        extra["mask_shape"] = None
    check_fused(spec.with_(dtype=dtype, **extra), rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_bshd_inputs_and_transposed_key(dtype, rng):
    check_fused(SdpaGraphSpec(layout="bshd", seq_q=33, dtype=dtype, mask="causal_bottom_right", seq_kv=40), rng)
    check_fused(SdpaGraphSpec(key_transposed=True, seq_q=19, dtype=dtype), rng)
    check_fused(SdpaGraphSpec(layout="bshd", gqa="4d", heads_q=4, heads_kv=2, dtype=dtype), rng)


@pytest.mark.parametrize("mode", ["inf_as_zero", "none"])
def test_fully_masked_rows(mode, rng):
    def mask_rows(spec, inputs):
        mask = inputs[spec.ids["mask"]]
        mask[:, :, 3, :] = -np.inf
        mask[0, 1, 10, :] = -np.inf

    spec = SdpaGraphSpec(mask="add", stats=True, softmax_mode=mode)
    fused, _ = check_fused(spec, rng, mask_rows)
    row = fused[spec.ids["output"]][0, 0, 3]
    assert np.all(row == 0) if mode == "inf_as_zero" else np.all(np.isnan(row))


@pytest.mark.parametrize("mode", ["inf_as_zero", "none"])
def test_fully_masked_rows_values(mode, rng):
    spec = SdpaGraphSpec(mask="causal_bottom_right", seq_q=12, seq_kv=5, stats=True, softmax_mode=mode)
    fused, _ = check_fused(spec, rng)
    out, stats = fused[spec.ids["output"]], fused[spec.ids["stats"]]
    masked_rows = out[:, :, :12 - 5]  # bottom-right: the first Sq - Skv rows see no key
    if mode == "inf_as_zero":
        assert np.all(masked_rows == 0) and np.all(stats[:, :, :7] == -np.inf)
    else:
        assert np.all(np.isnan(masked_rows))
    assert np.all(np.isfinite(out[:, :, 7:]))


@pytest.mark.parametrize("case", [
    dict(reorder="transpose_reshape", seq_q=21, heads_q=3),  # the lane build's two-vector blocks
    dict(dtype="f32", seq_q=1, seq_kv=40, heads_q=4, heads_kv=2, gqa="5d", stats=True),  # the decode rows
    dict(dtype="bf16", seq_q=37, seq_kv=50, mask="causal_top_left", stats=True),  # AMX, partial tiles
    dict(dtype="f16", seq_q=70, seq_kv=33, head_dim=80, stats=True),  # AMX on split parts
    dict(dtype="f32", seq_q=300, seq_kv=200, heads_q=2, stats=True),  # f32 on tiles where items are long
    dict(dtype="bf16", seq_q=40, dropout=0.3),  # the vector build's dropout
], ids=["lanes_reordered", "decode_gqa", "amx_bf16_causal", "amx_f16_d80", "f32_long", "dropout"])
def test_outputs_inside_larger_buffers_get_only_their_views_written(case, rng):
    """Each output is a view with gaps of sentinel around its rows and columns; the kernel fills the view
    (checked against the reference) and leaves every gap as it was."""
    spec = SdpaGraphSpec(**case)
    graph = spec.build()
    (partition,) = graph.get_partitions()
    inputs = spec.random_inputs(rng)
    views, untouched = run_into_padded_outputs(partition, inputs)
    reference = ga.run_graph(graph, inputs, policy="debug")
    assert all(untouched.values()), f"written outside: {[t for t, ok in untouched.items() if not ok]}"
    assert_close(views[spec.ids["output"]], reference[spec.ids["output"]], spec.dtype)
    if spec.stats:
        assert_close(views[spec.ids["stats"]], reference[spec.ids["stats"]], "f32", "stats", STATS_TOLERANCE)


def test_every_isa_build_matches(rng):
    """Each kernel build (portable, avx2, avx512, amx) runs where the CPU has it, in a fresh process,
    with short and long query blocks and every mask kind, forward and backward."""
    script = (
        "import numpy as np, graphattn as ga\n"
        "from graphattn.testing import STATS_TOLERANCE, SdpaGraphSpec, assert_close\n"
        "rng = np.random.default_rng(0)\n"
        "cases = [(dt, m, sq) for dt in ('f32', 'bf16', 'f16') for m in (None, 'add', 'select', 'causal_top_left',\n"
        "         'causal_bottom_right') for sq in (1, 3, 37, 130)]\n"
        "for dt, m, sq in cases:\n"
        "    s = SdpaGraphSpec(dtype=dt, mask=m, seq_q=sq, seq_kv=70, head_dim=80, stats=True)\n"
        "    g = s.build(); x = s.random_inputs(rng)\n"
        "    fused, ref = ga.run_graph(g, x), ga.run_graph(g, x, policy='debug')\n"
        "    for name in ('output', 'stats'):\n"
        "        tol = None if name == 'output' else STATS_TOLERANCE\n"
        "        assert_close(fused[s.ids[name]], ref[s.ids[name]], dt, name, tol)\n"
        "from graphattn.testing import assert_grad_close, random_array, sdpa_reference_backward\n"
        "for dt in ('f32', 'bf16'):\n"
        "    for kw in (dict(is_causal=True), dict(enable_gqa=True, attn_mask=rng.random((37, 70)) < 0.8)):\n"
        "        q, k, v = (random_array(s, dt, rng) for s in ((1, 4, 37, 80), (1, 2, 70, 80), (1, 2, 70, 80)))\n"
        "        kw.setdefault('enable_gqa', True)\n"
        "        out, st = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)\n"
        "        do = random_array(out.shape, dt, rng)\n"
        "        got = ga.scaled_dot_product_attention_backward(do, q, k, v, out, st, **kw)\n"
        "        for g, w in zip(got, sdpa_reference_backward(do, q, k, v, **kw)):\n"
        "            assert_grad_close(g, w, dt)\n"
        "print(ga.forward_isa('bf16'), ga.forward_isa('f16'), ga.forward_isa('f32'))\n")
    features = set(ga.cpu_features())
    builds = (("portable", set()), ("avx2", {"avx2", "fma", "f16c"}), ("avx512", {"avx512f", "avx512bw"}),
              ("amx", {"amx_tile", "amx_bf16", "avx512_bf16"}))
    for isa, needs in builds:
        if not needs <= features:
            continue
        out = run_python(script, None if isa == "amx" else isa)
        assert out.strip() == ("amx_bf16 amx_bf16x3 amx_bf16x6" if isa == "amx" else f"{isa} {isa} {isa}")


def test_split_keys_merge_matches():
    """With more threads than work items (run with 16 threads) the forward splits the keys and merges them by
    log-sum-exp (decode rows and blocks of query rows alike), the f32 backward computes dQ in its own pass
    instead of inside the dK/dV pass, and the bf16 (AMX) backward splits each K/V batch index's keys among
    items with dQ sums of their own (key blocks dealt out in turn, so that causal splits get equal work)."""
    script = (
        "import numpy as np, graphattn as ga\n"
        "from graphattn.testing import STATS_TOLERANCE, assert_close, random_array, sdpa_reference\n"
        "rng = np.random.default_rng(0)\n"
        "for dt in ('f32', 'bf16'):\n"
        "    q, k, v = (random_array(s, dt, rng) for s in ((1, 8, 3, 64), (1, 2, 3000, 64), (1, 2, 3000, 64)))\n"
        "    mask = rng.random((1, 8, 3, 3000)) < 0.9\n"
        "    mask[0, 1, 2] = False  # one fully masked row\n"
        "    for kw in (dict(), dict(attn_mask=mask), dict(is_causal=True, causal_alignment='bottom_right')):\n"
        "        got = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True, **kw)\n"
        "        want = sdpa_reference(q, k, v, enable_gqa=True, return_stats=True, **kw)\n"
        "        assert_close(got[0], want[0], dt)\n"
        "        assert_close(got[1], want[1], dt, 'stats', STATS_TOLERANCE)\n"
        "    q[0, 3, 1, 5] = np.nan\n"
        "    out = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
        "    assert np.isnan(out[0, 3, 1]).all() and not np.isnan(np.delete(out[0, 3], 1, axis=0)).any()\n"
        "for dt in ('bf16', 'f16'):  # blocks of query rows (AMX where present): 4 items, so the keys split\n"
        "    q, k, v = (random_array(s, dt, rng) for s in ((1, 2, 70, 80), (1, 1, 3000, 80), (1, 1, 3000, 80)))\n"
        "    mask = rng.random((1, 2, 70, 3000)) < 0.9\n"
        "    mask[0, 1, 5] = False  # one fully masked row\n"
        "    for kw in (dict(), dict(attn_mask=mask), dict(is_causal=True),\n"
        "               dict(is_causal=True, causal_alignment='bottom_right')):\n"
        "        got = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True, **kw)\n"
        "        want = sdpa_reference(q, k, v, enable_gqa=True, return_stats=True, **kw)\n"
        "        assert_close(got[0], want[0], dt)\n"
        "        assert_close(got[1], want[1], dt, 'stats', STATS_TOLERANCE)\n"
        "from graphattn.testing import assert_grad_close, sdpa_reference_backward\n"
        "for dt, kw in [(dt, kw) for dt in ('f32', 'bf16') for kw in (dict(is_causal=True), dict(enable_gqa=True),\n"
        "                                                         dict(dropout_p=0.2, dropout_seed=3))]:\n"
        "    hkv = 2 if kw.get('enable_gqa') else 4\n"
        "    sq = 300 if 'is_causal' in kw else 70  # causal: more key blocks than splits, dealt out in turn\n"
        "    q, k, v = (random_array(s, dt, rng) for s in ((1, 4, sq, 48), (1, hkv, 300, 48), (1, hkv, 300, 48)))\n"
        "    out, st = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)\n"
        "    do = random_array(out.shape, dt, rng)\n"
        "    for g, w in zip(ga.scaled_dot_product_attention_backward(do, q, k, v, out, st, **kw),\n"
        "                    sdpa_reference_backward(do, q, k, v, **kw)):\n"
        "        assert_grad_close(g, w, dt)\n"
        "print(ga.thread_count())\n")
    assert run_python(script, OMP_NUM_THREADS="16").strip() == "16"


def test_kept_kv_blocks_match():
    """On AMX, items of up to 128 rows with whole keys keep every packed K/V block of their batch index, so
    that a thread's later items skip packing, and causal items go to groups of threads by batch index (run
    with 2 threads, so that these shapes take 128-row items): the results match the reference for causal
    top-left and bottom-right (a partial last block past some items' rows) and plain calls, GQA among
    them (two query heads on one K/V head).  Elsewhere the same calls check the vector build."""
    script = (
        "import numpy as np, graphattn as ga\n"
        "from graphattn.testing import STATS_TOLERANCE, assert_close, random_array, sdpa_reference\n"
        "rng = np.random.default_rng(0)\n"
        "ga.set_verbose(1)\n"
        "cases = [('f16', (1, 1, 1024, 64), (1, 1, 1024, 64), dict(is_causal=True)),\n"
        "         ('f16', (1, 1, 1024, 64), (1, 1, 1100, 64), dict(is_causal=True, causal_alignment='bottom_right')),\n"
        "         ('bf16', (1, 1, 1024, 64), (1, 1, 1024, 64), dict()),\n"
        "         ('bf16', (1, 2, 512, 64), (1, 1, 1100, 64), dict(enable_gqa=True)),\n"
        "         ('f32', (1, 1, 1024, 64), (1, 1, 1024, 64), dict(is_causal=True))]\n"
        "for dt, q_shape, kv_shape, kw in cases:\n"
        "    q, k, v = (random_array(s, dt, rng) for s in (q_shape, kv_shape, kv_shape))\n"
        "    got = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)\n"
        "    want = sdpa_reference(q, k, v, return_stats=True, **kw)\n"
        "    assert_close(got[0], want[0], dt)\n"
        "    assert_close(got[1], want[1], dt, 'stats', STATS_TOLERANCE)\n"
        "print(ga.forward_isa('f16'))\n")
    out, err = run_python_logged(script, OMP_NUM_THREADS="2")
    plans = [line for line in err.splitlines() if ",compile," in line and "sdpa_forward" in line]
    assert len(plans) == 5, err
    if out.strip().startswith("amx"):
        for plan, order in zip(plans[:4], ("batch_groups", "batch_groups", "home_first", "home_first")):
            assert ",item_rows=128," in plan and f",order={order}+kept_kv," in plan, plan
