"""Score modifiers (softcap, ALiBi slopes, attention sinks; score_mods.py) on every route: the functional forward,
stats and backward (dsinks included) against the float64 reference, alone and together with windows, causal, GQA
and masks, in each dtype; each kernel candidate forced in its own process; torch autograd; bad arguments; the
graph API's softcap pattern as one fused partition."""
import itertools

import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import (SdpaGraphSpec, assert_close, assert_grad_close, random_array, sdpa_reference,
                               sdpa_reference_backward)
from cpu_helpers import AMX_DTYPES
from subprocess_helpers import run_python
from test_sdpa_fusion import check_fused

# (query shape, key shape): square, fewer and more rows than keys, decode under GQA, a long GQA call, 3-D.
SHAPES = {
    "square": ((2, 3, 37, 32), (2, 3, 37, 32)),
    "fewer_rows": ((1, 2, 20, 64), (1, 2, 90, 64)),
    "more_rows": ((1, 2, 70, 32), (1, 2, 25, 32)),
    "decode_gqa": ((2, 8, 1, 64), (2, 2, 150, 64)),
    "gqa": ((1, 8, 33, 32), (1, 2, 33, 32)),
    "long": ((1, 2, 300, 64), (1, 2, 300, 64)),
}
MODS = {
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi_slopes="h"),
    "alibi_per_batch": dict(alibi_slopes="nh"),
    "sinks": dict(sinks=True),
    "all": dict(softcap=2.5, alibi_slopes="h", sinks=True),
}
CALLS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window_bottom_right": dict(window=(7, 0), causal_alignment="bottom_right"),
    "window_both": dict(window=(5, 3)),
    "float_mask": dict(mask="float"),
    "bool_mask": dict(mask="bool"),
}


def _modifiers(mods: dict, q_shape, rng) -> dict:
    heads = q_shape[-3]
    kw = {}
    if "softcap" in mods:
        kw["softcap"] = mods["softcap"]
    if mods.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = (rng.random(heads) * 0.5).astype(np.float32)
    elif mods.get("alibi_slopes") == "nh":
        kw["alibi_slopes"] = (rng.random((q_shape[0], heads)) * 0.5).astype(np.float32)
    if mods.get("sinks"):
        kw["sinks"] = rng.standard_normal(heads).astype(np.float32)
    return kw


def check_call(q_shape, k_shape, dtype, mods: dict, call: dict, rng) -> None:
    """Forward, stats and backward of one call against the float64 reference."""
    q, k = random_array(q_shape, dtype, rng, 3.0), random_array(k_shape, dtype, rng, 3.0)
    v = random_array(k_shape[:-1] + (24,), dtype, rng)
    options = dict(call)
    mask_kind = options.pop("mask", None)
    mask = None
    if mask_kind == "float":
        mask = random_array((q_shape[-2], k_shape[-2]), "f32", rng)
    elif mask_kind == "bool":
        mask = rng.random((q_shape[-2], k_shape[-2])) < 0.8
    kw = _modifiers(mods, q_shape, rng)
    gqa = q_shape[-3] != k_shape[-3]
    what = f"{mods} {call}"
    out, stats = ga.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa, return_stats=True, **options, **kw)
    want, want_stats = sdpa_reference(q, k, v, mask, enable_gqa=gqa, return_stats=True, **options, **kw)
    assert_close(out, want, dtype, f"output {what}")
    finite = np.isfinite(want_stats)
    assert (np.isfinite(stats) == finite).all(), f"rows with no weight {what}"
    assert_close(np.where(finite, stats, 0), np.where(finite, want_stats, 0), "f32", f"stats {what}", (1e-5, 2e-3))
    grad_out = random_array(out.shape, dtype, rng)
    sinks = "sinks" in kw
    grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, mask, enable_gqa=gqa,
                                                     return_mask_grad=True, return_sinks_grad=sinks, **options, **kw)
    want_grads = sdpa_reference_backward(grad_out, q, k, v, mask, enable_gqa=gqa, **options, **kw)
    assert len(grads) == len(want_grads)
    magnitude = max(float(np.abs(g).max()) for g in want_grads[:3])
    for name, got, expected in zip(("dq", "dk", "dv", "dmask", "dsinks"), grads, want_grads):
        if expected is None:
            assert got is None, f"{name} {what}"
            continue
        assert_grad_close(got, expected, dtype, f"{name} {what}", magnitude)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("mods", sorted(MODS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_modifier_matches_reference(shape, mods, dtype, rng):
    check_call(*SHAPES[shape], dtype, MODS[mods], {}, rng)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("shape", ["square", "fewer_rows", "decode_gqa", "gqa"])
def test_all_modifiers_with_windows_masks_and_gqa(shape, call, dtype, rng):
    check_call(*SHAPES[shape], dtype, MODS["all"], CALLS[call], rng)


def test_modifiers_change_the_result(rng):
    """Each modifier moves the output away from the plain call's (a check that cannot pass by ignoring it)."""
    q, k, v = (random_array((1, 2, 16, 32), "f32", rng, 3.0) for _ in range(3))
    plain = ga.scaled_dot_product_attention(q, k, v)
    for kw in (dict(softcap=1.0), dict(alibi_slopes=np.full(2, 0.5, np.float32)), dict(sinks=np.ones(2, np.float32))):
        assert np.abs(ga.scaled_dot_product_attention(q, k, v, **kw) - plain).max() > 1e-2, kw


def test_rows_with_no_key_weigh_the_sink(rng):
    """A row that sees no key gives output 0 and stats sigma (its whole weight on the sink)."""
    q, k, v = (random_array((1, 2, n, 16), "f32", rng) for n in (70, 25, 25))
    sinks = np.array([0.5, -1.25], np.float32)
    out, stats = ga.scaled_dot_product_attention(q, k, v, window=(3, 0), sinks=sinks, return_stats=True)
    assert (out[..., 28:, :] == 0).all()
    np.testing.assert_allclose(stats[0, :, 28:, 0], np.broadcast_to(sinks[:, None], (2, 42)), rtol=1e-6)


def test_sink_stats_give_back_the_probabilities(rng):
    """P = exp(S - stats) holds with the sink in the stats: the rows' probabilities sum to 1 - p_sink."""
    q, k, v = (random_array((1, 3, 12, 16), "f32", rng) for _ in range(3))
    sinks = rng.standard_normal(3).astype(np.float32)
    _, stats = ga.scaled_dot_product_attention(q, k, v, sinks=sinks, return_stats=True)
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 4.0
    total = np.exp(scores - stats).sum(-1) + np.exp(sinks[:, None] - stats[..., 0])
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(softcap=0.0), ValueError, "softcap must be within"),
    (dict(softcap=-2.0), ValueError, "softcap must be within"),
    (dict(softcap=float("inf")), ValueError, "softcap must be within"),
    (dict(softcap="2"), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes must have shape (2,) or (1, 2)"),
    (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes dtype float64 is not supported"),
    (dict(sinks=np.ones((1, 2), np.float32)), ValueError, "sinks must have shape (2,)"),
    (dict(sinks=np.ones(2, np.float16)), TypeError, "sinks dtype float16 is not supported"),
])
def test_bad_modifiers_are_refused_naming_the_argument(kwargs, error, words, rng):
    q = random_array((1, 2, 8, 16), "f32", rng)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ga.scaled_dot_product_attention(q, q, q, **kwargs)
    out, stats = ga.scaled_dot_product_attention(q, q, q, return_stats=True)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, **kwargs)


def test_sinks_grad_needs_sinks(rng):
    q = random_array((1, 2, 8, 16), "f32", rng)
    out, stats = ga.scaled_dot_product_attention(q, q, q, return_stats=True)
    with pytest.raises(ValueError, match="return_sinks_grad=True needs sinks"):
        ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, return_sinks_grad=True)


KERNEL_SCRIPT = """
import itertools, numpy as np
import test_score_mods as t
rng = np.random.default_rng(7)
for dtype, shape, mods, call in itertools.product(DTYPES, ["square", "decode_gqa", "long"],
                                                  ["softcap", "alibi_per_batch", "all"],
                                                  ["plain", "window_bottom_right", "float_mask"]):
    t.check_call(*t.SHAPES[shape], dtype, t.MODS[mods], t.CALLS[call], rng)
print("ok")
"""


@pytest.mark.parametrize("kernel", [name for name, _ in ga._cpu.kernel_candidates("forward")])
def test_modifiers_on_each_kernel_candidate(kernel):
    """Each candidate forced on both passes, in a process of two threads (splits and pieces of work)."""
    why = dict(ga._cpu.kernel_candidates("forward")).get(kernel) or \
        dict(ga._cpu.kernel_candidates("backward")).get(kernel, "")
    if why:
        pytest.skip(why)
    import os
    here = os.path.dirname(__file__)
    dtypes = list(AMX_DTYPES.get(kernel, ("f32", "bf16", "f16")))
    script = f"import sys; sys.path.insert(0, {here!r})\nDTYPES = {dtypes!r}\n" + KERNEL_SCRIPT
    assert run_python(script, kernel, OMP_NUM_THREADS="2").strip().endswith("ok")


def test_torch_autograd_gives_every_gradient(rng):
    """torch tensors that require grad: dq, dk, dv and dsinks against float64 torch autograd of the same rule."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(random_array((2, 4, 9, 16), "f32", rng), requires_grad=True) for _ in range(3))
    sinks = torch.tensor(rng.standard_normal(4).astype(np.float32), requires_grad=True)
    slopes = torch.tensor((rng.random(4) * 0.3).astype(np.float32))
    out = ga.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks)
    assert out.grad_fn is not None
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)

    q64, k64, v64, s64 = (x.detach().double().requires_grad_() for x in (q, k, v, sinks))
    scores = q64 @ k64.transpose(-1, -2) / 4.0
    scores = 3.0 * torch.tanh(scores / 3.0)
    i = torch.arange(9)
    scores = scores - slopes.double()[:, None, None] * (i[:, None] - i[None, :]).abs()
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    sink_col = s64[None, :, None, None].expand(2, 4, 9, 1)
    p = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
    want_out = p @ v64
    want = torch.autograd.grad(want_out, (q64, k64, v64, s64), grad.double())
    assert_close(out.detach().numpy(), want_out.detach().numpy(), "f32", "output")
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_grad_close(g.numpy(), w.numpy(), "f32", name)


# The graph API's softcap: Divide(c) -> Tanh -> Multiply(c) after the scale, in every pattern with a scale.
GRAPH_SOFTCAP = {
    "multiply_scale": SdpaGraphSpec(softcap=2.0, seq_q=17, seq_kv=33, head_dim=64, stats=True),
    "divide_scale_causal": SdpaGraphSpec(softcap=5.0, scale="divide", mask="causal_top_left", seq_q=33, seq_kv=33),
    "add_mask_bottom_right": SdpaGraphSpec(softcap=3.0, mask="causal_bottom_right", seq_q=9, seq_kv=40,
                                           window_left=6, stats=True),
    "float_mask": SdpaGraphSpec(softcap=1.5, mask="add", seq_q=17, seq_kv=17),
    "bool_mask_gqa_5d": SdpaGraphSpec(softcap=4.0, mask="select", gqa="5d", heads_q=8, heads_kv=2, seq_q=12,
                                      seq_kv=30, mask_shape=(1, 1, 1, 12, 30)),
    "gqa_4d_reorder": SdpaGraphSpec(softcap=50.0, gqa="4d", heads_q=4, heads_kv=1, seq_q=16, seq_kv=64,
                                    reorder="transpose"),
    "no_scale_decode": SdpaGraphSpec(softcap=2.5, scale=None, seq_q=1, seq_kv=70),
}


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("variant", sorted(GRAPH_SOFTCAP))
def test_graph_softcap_is_one_fused_partition(variant, dtype, rng):
    check_fused(GRAPH_SOFTCAP[variant].with_(dtype=dtype), rng)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("variant, value", [("multiply_scale", np.inf), ("multiply_scale", -np.inf),
                                            ("divide_scale_causal", 0.0)])
def test_graph_softcap_under_an_infinite_scale_gives_the_limit(variant, value, dtype, rng):
    """A Multiply by +-inf (or a Divide by 0) before the softcap caps every score at +-c, as the op-by-op
    reference does, where the kernel's scaled scores would otherwise be NaN."""
    def infinite_scale(spec, inputs):
        inputs[spec.ids["scale"]] = np.array([value], inputs[spec.ids["scale"]].dtype)
    spec = GRAPH_SOFTCAP[variant].with_(dtype=dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        fused, _ = check_fused(spec, rng, infinite_scale)
    assert not np.isnan(fused[spec.ids["output"]].astype(np.float32)).any()


def test_graph_softcap_values_must_agree_and_be_positive(rng):
    spec = GRAPH_SOFTCAP["multiply_scale"]
    graph = spec.build()
    (partition,) = graph.get_partitions()
    for divisor, multiplier, words in ((2.0, 3.0, "divides by 2.0 and multiplies by 3.0"),
                                       (-1.0, -1.0, "softcap must be within")):
        inputs = spec.random_inputs(rng)
        inputs[spec.ids["softcap_divisor"]] = np.array([divisor], np.float32)
        inputs[spec.ids["softcap"]] = np.array([multiplier], np.float32)
        with pytest.raises(ValueError, match=words):
            ga.run_graph(graph, inputs, partitions=[partition])


def test_tanh_reference_op(rng):
    x = random_array((3, 5), "f32", rng, 4.0)
    graph = ga.Graph("cpu")
    src, dst = ga.LogicalTensor(0, "f32", (3, 5)), ga.LogicalTensor(1, "f32", (3, 5))
    graph.add_op(ga.Op(0, "Tanh", [src], [dst]))
    graph.finalize()
    np.testing.assert_allclose(ga.run_graph(graph, {0: x}, policy="debug")[1], np.tanh(x), rtol=1e-6)


@pytest.mark.parametrize("softcap", [1e-7, 0.5, 5.0, 50.0, 500.0, 1e4])
def test_softcap_keeps_the_precision_of_the_plain_call(softcap, rng):
    """The kernels' tanh near 0 (a large cap) and near +-1 (a small one) adds about no error to f32 scores: the
    softcapped output's error stays within twice the plain call's.  1e-7 and 1e4 take Softcap's path for caps
    far from the scores' size (simd.hpp)."""
    q, k, v = (random_array(shape, "f32", rng, 3.0) for shape in ((1, 8, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64)))
    errors = {}
    for cap in (None, softcap):
        out = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True, softcap=cap)
        errors[cap] = np.abs(out - sdpa_reference(q, k, v, enable_gqa=True, is_causal=True, softcap=cap)).max()
    assert errors[softcap] <= 2 * errors[None] + 1e-6, errors


@pytest.mark.parametrize("cap, scale", [(1.0, 1.0), (50.0, 0.125), (3e3, 7.0)])
@pytest.mark.parametrize("band", [(0.0, 0.3), (0.4, 0.625), (0.5, 0.7), (0.6, 1.5), (1.0, 12.0)],
                         ids=["small", "below_edge", "across_edge", "above_edge", "far"])
def test_softcap_fits_agree_across_the_near_edge(cap, scale, band):
    """simd.hpp's Softcap takes a polynomial where every score of a vector lies within 0.625 c and a clamped
    rational fit elsewhere: one-hot keys give each row 40 scores of known size |s| / c in the band, and the
    stats (the log-sum-exp of the capped scores) match float64 to a few f32 roundings of the largest score (a
    fit off by 1e-5 fails)."""
    rng = np.random.default_rng(3)
    rows, keys = 200, 40
    u = rng.uniform(*band, (rows, keys)) * rng.choice([-1.0, 1.0], (rows, keys))
    q = (u * cap / scale).astype(np.float32)[None, None]
    k = np.eye(keys, dtype=np.float32)[None, None]
    v = np.zeros((1, 1, keys, 8), np.float32)
    _, stats = ga.scaled_dot_product_attention(q, k, v, scale=scale, softcap=cap, return_stats=True)
    capped = cap * np.tanh(scale * q[0, 0].astype(np.float64) / cap)
    top = capped.max(axis=1, keepdims=True)
    want = (top + np.log(np.exp(capped - top).sum(axis=1, keepdims=True)))[:, 0]
    err = np.abs(stats[0, 0, :, 0] - want).max()
    assert err <= 16 * np.finfo(np.float32).eps * np.abs(capped).max(), err
