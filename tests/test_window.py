"""The key window (flash-attn's window_size) on every route: functional forward and backward against the
float64 reference, each vector build in its own process, the SYCL kernels, and the graph API's bound Selects."""
import itertools

import numpy as np
import pytest

import graphattn as ga
from graphattn import key_window
from graphattn.testing import (SdpaGraphSpec, assert_close, assert_grad_close, random_array, sdpa_reference,
                               sdpa_reference_backward)
from subprocess_helpers import run_python
from test_backward_graph import check as check_backward_graph
from test_sdpa_fusion import check_fused

WINDOWS = [(0, 0), (3, -1), (16, 0), (-1, 5), (7, 7), (500, 500)]  # the last is wider than every sequence
# (query shape, key shape): S_q = S_kv, S_q < S_kv, S_q > S_kv, S_q = 1, GQA (4 query heads per K/V head)
SHAPES = {
    "square": ((2, 3, 37, 32), (2, 3, 37, 32)),
    "fewer_rows": ((1, 2, 20, 64), (1, 2, 90, 64)),
    "more_rows": ((1, 2, 70, 32), (1, 2, 25, 32)),
    "decode": ((2, 4, 1, 64), (2, 4, 150, 64)),
    "gqa": ((1, 8, 33, 32), (1, 2, 33, 32)),
    "long": ((1, 2, 300, 64), (1, 2, 300, 64)),
}


def _operands(shapes, dtype, rng, mask=None):
    (qs, ks) = shapes
    q, k = random_array(qs, dtype, rng), random_array(ks, dtype, rng)
    v = random_array(ks[:-1] + (24,), dtype, rng)
    attn_mask = None
    if mask == "bool":
        attn_mask = rng.random((qs[-2], ks[-2])) < 0.8
    elif mask == "float":
        attn_mask = random_array((qs[-2], ks[-2]), "f32", rng)
    return q, k, v, attn_mask


def _check_call(q, k, v, attn_mask, dtype, rng, **options):
    gqa = q.shape[-3] != k.shape[-3]
    out, stats = ga.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=gqa, return_stats=True, **options)
    want, want_stats = sdpa_reference(q, k, v, attn_mask, enable_gqa=gqa, return_stats=True, **options)
    assert_close(out, want, dtype, f"output {options}")
    hidden = np.isneginf(want_stats)
    assert (np.isneginf(stats) == hidden).all(), f"rows with no visible key {options}"
    assert_close(np.where(hidden, 0, stats), np.where(hidden, 0, want_stats), "f32", f"stats {options}", (1e-5, 1e-3))
    grad_out = random_array(out.shape, dtype, rng)
    grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, attn_mask, enable_gqa=gqa,
                                                     return_mask_grad=True, **options)
    want_grads = sdpa_reference_backward(grad_out, q, k, v, attn_mask, enable_gqa=gqa, **options)
    magnitude = max(float(np.abs(g).max()) for g in want_grads[:3] if g.size)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_grad_close(got, expected, dtype, f"{name} {options}", magnitude)
    if attn_mask is not None and attn_mask.dtype != np.bool_:
        assert_grad_close(grads[3], want_grads[3], dtype, f"dmask {options}", magnitude)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_window_forward_and_backward_match_reference(shape, dtype, rng):
    for window, alignment in itertools.product(WINDOWS, key_window.ALIGNMENTS):
        q, k, v, _ = _operands(SHAPES[shape], dtype, rng)
        _check_call(q, k, v, None, dtype, rng, window=window, causal_alignment=alignment)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("mask", ["bool", "float", "causal"])
def test_window_with_masks_and_is_causal(mask, dtype, rng):
    for shape, window, alignment in itertools.product(["square", "fewer_rows", "more_rows"], WINDOWS,
                                                      key_window.ALIGNMENTS):
        q, k, v, attn_mask = _operands(SHAPES[shape], dtype, rng, None if mask == "causal" else mask)
        _check_call(q, k, v, attn_mask, dtype, rng, window=window, causal_alignment=alignment,
                    is_causal=mask == "causal")


def test_is_causal_intersects_the_window():
    assert key_window.effective_window((4, 9), True) == (4, 0)
    assert key_window.effective_window((4, -1), True) == (4, 0)
    assert key_window.effective_window(None, True) == (-1, 0)
    assert key_window.effective_window((-1, -1), False) == (-1, -1)
    assert key_window.effective_window((2, -1), False) == (2, -1)


def test_window_of_unlimited_sides_equals_no_window(rng):
    q, k, v, _ = _operands(SHAPES["fewer_rows"], "f32", rng)
    plain = ga.scaled_dot_product_attention(q, k, v)
    assert np.array_equal(ga.scaled_dot_product_attention(q, k, v, window=(-1, -1)), plain)
    causal = ga.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert np.array_equal(ga.scaled_dot_product_attention(q, k, v, window=(-1, 0), causal_alignment="bottom_right"),
                          causal)


@pytest.mark.parametrize("window, error", [((-2, 0), ValueError), ((1, -3), ValueError), ((1.5, 0), TypeError),
                                           ((1,), TypeError), ("left", TypeError), (3, TypeError)])
def test_bad_window_is_refused_with_its_rule(window, error, rng):
    q, k, v, _ = _operands(SHAPES["square"], "f32", rng)
    with pytest.raises(error, match="window"):
        ga.scaled_dot_product_attention(q, k, v, window=window)
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    with pytest.raises(error, match="window"):
        ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats, window=window)


def test_window_rows_with_no_visible_key_give_zero(rng):
    # top-left with more rows than keys: rows past S_kv + left see no key
    q, k, v, _ = _operands(SHAPES["more_rows"], "f32", rng)
    out, stats = ga.scaled_dot_product_attention(q, k, v, window=(3, 0), return_stats=True)
    assert (out[..., 28:, :] == 0).all() and np.isneginf(stats[..., 28:, :]).all()
    assert np.isfinite(stats[..., :28, :]).all()


WINDOW_SCRIPT = """
import itertools, numpy as np, graphattn as ga
from graphattn.testing import sdpa_reference, sdpa_reference_backward, assert_close, assert_grad_close, random_array
rng = np.random.default_rng(5)
for dtype, (sq, skv), window, align in itertools.product(["f32", "bf16", "f16"], [(37, 37), (9, 140), (1, 70), (200, 260)],
                                                          [(0, 0), (3, -1), (16, 0), (-1, 5), (7, 7)],
                                                          ["top_left", "bottom_right"]):
    q, k, v = (random_array((1, 2, s, 64), dtype, rng) for s in (sq, skv, skv))
    out, st = ga.scaled_dot_product_attention(q, k, v, window=window, causal_alignment=align, return_stats=True)
    assert_close(out, sdpa_reference(q, k, v, window=window, causal_alignment=align), dtype, "output")
    do = random_array(out.shape, dtype, rng)
    got = ga.scaled_dot_product_attention_backward(do, q, k, v, out, st, window=window, causal_alignment=align)
    want = sdpa_reference_backward(do, q, k, v, window=window, causal_alignment=align)
    magnitude = max(float(np.abs(g).max()) for g in want[:3])
    for g, w in zip(got, want):
        assert_grad_close(g, w, dtype, "gradient", magnitude)
print(ga.forward_isa("f32"))
"""


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "native"])
def test_window_on_each_kernel_build(isa):
    """Each vector build forced, in a process of two threads (the thread count is fixed at start): splits and
    pieces of work."""
    needs = {"avx2": "avx2", "avx512": "avx512f"}.get(isa)
    if needs is not None and needs not in ga.cpu_features():
        pytest.skip(f"{isa} needs {needs}, which this CPU lacks")
    run_python(WINDOW_SCRIPT, None if isa == "native" else isa, OMP_NUM_THREADS="2")


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("variant", [
    dict(mask="causal_top_left", window_left=5),
    dict(mask="causal_bottom_right", window_left=4, seq_q=9, seq_kv=23),
    dict(mask="causal_bottom_right", window_left=0, seq_q=30, seq_kv=41),
    dict(window_left=3),
    dict(window_left=6, window_alignment="bottom_right", seq_q=7, seq_kv=40),
    dict(window_left=2, mask="add"),
    dict(window_left=8, mask="select", gqa="5d", heads_q=8, heads_kv=2),
], ids=lambda v: "-".join(f"{k}={v[k]}" for k in sorted(v)))
def test_graph_window_bounds_fuse_forward_and_backward(variant, dtype, rng):
    """The left bound Select(GreaterEqual(col, row' - left)), with and without the causal bound, both
    alignments: one fused partition, inference and training forward, and the backward."""
    check_fused(SdpaGraphSpec(dtype=dtype, **variant), rng)
    check_fused(SdpaGraphSpec(dtype=dtype, stats=True, softmax_mode="inf_as_zero", **variant), rng)
    if variant.get("mask") != "select":
        check_backward_graph(dtype, rng, **variant)


def test_graph_window_bounds_with_two_fills_are_refused(rng):
    spec = SdpaGraphSpec(mask="causal_top_left", window_left=3)
    graph = spec.build()
    inputs = spec.random_inputs(rng)
    inputs[spec.ids["window_fill"]] = np.array([-1e4], np.float32)
    with pytest.raises(ValueError, match="one fill value"):
        ga.run_graph(graph, inputs)
