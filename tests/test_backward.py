"""ga.scaled_dot_product_attention_backward against float64 gradients, which are in turn checked
against finite differences."""
import math

import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import assert_grad_close, random_array, sdpa_reference, sdpa_reference_backward

from cpu_helpers import bf16_pairs_expected
from subprocess_helpers import run_python, run_python_logged

pytestmark = pytest.mark.cpu

DTYPES = ["f32", "bf16", "f16"]

CASES = {
    "plain": dict(q=(2, 3, 37, 32), k=(2, 3, 50, 32), v=(2, 3, 50, 24)),
    "s1": dict(q=(1, 2, 1, 32), k=(1, 2, 1, 32), v=(1, 2, 1, 32)),
    "s17_d80": dict(q=(1, 2, 17, 80), k=(1, 2, 17, 80), v=(1, 2, 17, 80)),
    "d256": dict(q=(1, 1, 20, 256), k=(1, 1, 33, 256), v=(1, 1, 33, 256)),
    "long": dict(q=(1, 2, 130, 64), k=(1, 2, 200, 64), v=(1, 2, 200, 64)),
    "3d": dict(q=(4, 9, 16), k=(4, 9, 16), v=(4, 9, 16)),
    "5d_broadcast": dict(q=(2, 3, 4, 5, 16), k=(1, 3, 1, 7, 16), v=(1, 3, 1, 7, 8)),
    "5d_kv_unalike": dict(q=(2, 2, 3, 5, 16), k=(1, 2, 3, 7, 16), v=(2, 1, 3, 7, 16)),
    # K/V broadcast along every other batch dim: four batch dims that do not fold into the kernel's three.
    "6d_kv_broadcast_unfolded": dict(q=(2, 3, 4, 5, 6, 16), k=(2, 1, 4, 1, 7, 16), v=(2, 1, 4, 1, 7, 8)),
    "causal": dict(q=(1, 2, 70, 64), k=(1, 2, 70, 64), v=(1, 2, 70, 64), is_causal=True),
    "causal_bottom_right": dict(q=(1, 2, 20, 64), k=(1, 2, 90, 64), v=(1, 2, 90, 64), is_causal=True,
                                causal_alignment="bottom_right"),
    "causal_sq_gt_skv": dict(q=(1, 2, 30, 16), k=(1, 2, 12, 16), v=(1, 2, 12, 16), is_causal=True,
                             causal_alignment="bottom_right"),
    "gqa": dict(q=(1, 8, 33, 32), k=(1, 2, 40, 32), v=(1, 2, 40, 32), enable_gqa=True),
    "mqa": dict(q=(2, 4, 6, 64), k=(2, 1, 70, 64), v=(2, 1, 70, 64), enable_gqa=True),
    "gqa_causal": dict(q=(1, 4, 65, 32), k=(1, 2, 65, 32), v=(1, 2, 65, 32), enable_gqa=True, is_causal=True),
    # The odd head sizes and GQA again at lengths that run on AMX tiles where the CPU has them.
    "tiles_d80_dv48": dict(q=(1, 2, 66, 80), k=(1, 2, 75, 80), v=(1, 2, 75, 48)),
    "tiles_d256": dict(q=(1, 1, 64, 256), k=(1, 1, 70, 256), v=(1, 1, 70, 256)),
    "tiles_gqa": dict(q=(1, 8, 70, 32), k=(1, 2, 80, 32), v=(1, 2, 80, 32), enable_gqa=True),
    # Ten or more blocks of keys, some of them wholly hidden by the causal mask.
    "many_key_blocks": dict(q=(1, 4, 90, 48), k=(1, 4, 650, 48), v=(1, 4, 650, 40)),
    "many_key_blocks_causal": dict(q=(1, 4, 300, 32), k=(1, 4, 600, 32), v=(1, 4, 600, 32), is_causal=True,
                                   causal_alignment="bottom_right"),
    # One head of 12 query rows against 11 key blocks: no pass 3; pass 2 sums dQ in a buffer per key split.
    "short_queries_split_keys": dict(q=(1, 1, 12, 40), k=(1, 1, 700, 40), v=(1, 1, 700, 24)),
    "short_queries_split_keys_causal": dict(q=(1, 1, 12, 40), k=(1, 1, 700, 40), v=(1, 1, 700, 40), is_causal=True,
                                            causal_alignment="bottom_right"),
    "many_key_blocks_gqa_causal": dict(q=(1, 8, 130, 32), k=(1, 2, 700, 32), v=(1, 2, 700, 32), enable_gqa=True,
                                       is_causal=True),
}

# Mask shapes for seq_q x seq_kv.
MASKS = {"float_2d": ("float", lambda sq, skv: (sq, skv)), "float_rows": ("float", lambda sq, skv: (1, skv)),
         "float_full": ("float", lambda sq, skv: (2, 2, sq, skv)), "float_heads": ("float", lambda sq, skv: (2, 1, sq, skv)),
         "bool": ("bool", lambda sq, skv: (2, 1, sq, skv)), "bool_2d": ("bool", lambda sq, skv: (sq, skv))}
# Short sequences run on the vector build; AMX-sized ones (where the CPU has AMX) on the tiles.
MASK_LENGTHS = {"short": (17, 29), "tiles": (70, 90)}


def check(case, dtype, rng, mask=None, scale=None):
    args = dict(case)
    q, k, v = (random_array(args.pop(name), dtype, rng) for name in ("q", "k", "v"))
    out, stats = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True, scale=scale, **args)
    grad_out = random_array(out.shape, dtype, rng)
    got = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, attn_mask=mask, scale=scale,
                                                   return_mask_grad=True, **args)
    want = sdpa_reference_backward(grad_out, q, k, v, attn_mask=mask, scale=scale, **args)
    for name, g, w, src in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == src.shape and g.dtype == src.dtype, name
        assert_grad_close(g, w, dtype, name)
    if want[3] is None:
        assert got[3] is None
    else:
        assert got[3].shape == mask.shape
        assert_grad_close(got[3], want[3], dtype, "dmask")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, dtype, rng):
    check(CASES[case], dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", sorted(MASK_LENGTHS))
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_masks_and_mask_gradient(mask, lengths, dtype, rng):
    kind, shape_for = MASKS[mask]
    sq, skv = MASK_LENGTHS[lengths]
    shape = shape_for(sq, skv)
    m = rng.standard_normal(shape).astype(np.float32) if kind == "float" else rng.random(shape) < 0.7
    check(dict(q=(2, 2, sq, 32), k=(2, 2, skv, 32), v=(2, 2, skv, 32)), dtype, rng, mask=m, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_with_a_mask_broadcast_over_heads_of_one_batch_dim(dtype, rng):
    """GQA's split heads (2 K/V heads x 2) under a mask broadcast along dim 1 only: no two of the four batch
    dims fold together for every operand, so every operand goes to the kernel in full (and the mask gradient
    is summed back to the mask's shape)."""
    check(dict(q=(2, 3, 4, 5, 16), k=(2, 3, 2, 6, 16), v=(2, 3, 2, 6, 16), enable_gqa=True), dtype, rng,
          mask=random_array((2, 1, 4, 5, 6), "f32", rng))


def test_fully_masked_rows_get_zero_gradient(rng):
    q, k, v = (random_array((1, 2, 40, 32), "f32", rng) for _ in range(3))
    mask = rng.random((40, 40)) < 0.8
    mask[3] = False
    out, stats = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True)
    grad_out = random_array(out.shape, "f32", rng)
    dq, dk, dv = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, attn_mask=mask)
    assert np.all(dq[:, :, 3] == 0) and np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    want = sdpa_reference_backward(grad_out, q, k, v, attn_mask=mask)
    for g, w in zip((dq, dk, dv), want):
        assert_grad_close(g, w, "f32")


@pytest.mark.parametrize("where", ["query", "key", "value", "grad_out"])
def test_infinite_f16_inputs_take_the_vector_build(where, rng):
    """The f16 split products on AMX cannot keep an infinity (part * inf is NaN), so a call with one runs on
    the vector build: its infinities and NaNs fall where the f32 (vector) call on the same values puts them."""
    q, k, v = (random_array((1, 2, 70, 32), "f16", rng) for _ in range(3))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    grad_out = random_array(out.shape, "f16", rng)
    arrays = {"query": q, "key": k, "value": v, "grad_out": grad_out}
    arrays[where][0, 1, 7, 3] = np.inf
    wide = [x.astype(np.float32) for x in (grad_out, q, k, v, out)]
    got = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats)
    want = ga.scaled_dot_product_attention_backward(*wide, stats)
    assert any(np.isnan(w).any() for w in want)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        # Rounded to f16 first: an f32 gradient past f16's range (about 6.5e4) is inf in the f16 call.
        with np.errstate(over="ignore"):
            assert_grad_close(g, w.astype(np.float16), "f16", name)


def test_reference_gradients_match_finite_differences(rng):
    """The float64 reference gradients are right: central differences of sdpa_reference agree."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 6)))
    mask = rng.standard_normal((5, 7))
    grad_out = rng.standard_normal((1, 2, 5, 6))
    for kwargs in (dict(attn_mask=mask), dict(is_causal=True, causal_alignment="bottom_right")):
        grads = sdpa_reference_backward(grad_out, q, k, v, **kwargs)
        inputs = {"q": q, "k": k, "v": v, "mask": mask}
        for name, grad in zip(("q", "k", "v", "mask"), grads):
            if grad is None:
                continue
            x = inputs[name]
            numeric = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                step = np.zeros_like(x)
                step[idx] = 1e-6
                def loss(delta):
                    args = {n: inputs[n] + (delta if n == name else 0) for n in ("q", "k", "v")}
                    m = (mask + delta) if name == "mask" else mask
                    extra = dict(kwargs, attn_mask=m) if "attn_mask" in kwargs else kwargs
                    return float((sdpa_reference(args["q"], args["k"], args["v"], **extra) * grad_out).sum())
                numeric[idx] = (loss(step) - loss(-step)) / 2e-6
            np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=f"d{name} {kwargs}")


def test_kernel_gradient_matches_finite_differences(rng):
    """Directly: a few coordinates of the f32 kernel's dq/dk/dv against central differences of the kernel."""
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(np.float32) for _ in range(3))
    grad_out = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, is_causal=True)
    grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, is_causal=True)
    for which, grad in enumerate(grads):
        for idx in [(0, 0, 0, 0), (0, 1, 4, 7), (0, 1, 8, 15)]:
            def loss(delta):
                args = [q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)]
                args[which] = args[which].copy()
                args[which][idx] += delta
                res = ga.scaled_dot_product_attention(*[a.astype(np.float32) for a in args], is_causal=True)
                return float((res.astype(np.float64) * grad_out).sum())
            numeric = (loss(1e-2) - loss(-1e-2)) / 2e-2
            assert abs(grad[idx] - numeric) <= 2e-3 + 2e-2 * abs(numeric), (which, idx, grad[idx], numeric)


@pytest.mark.parametrize("bad,match", [
    (dict(out_shape=(1, 2, 9, 15)), "out must have the forward output's shape"),
    (dict(stats_dtype=np.float64), "stats must be float32"),
])
def test_bad_arguments(bad, match, rng):
    q, k, v = (random_array((1, 2, 9, 16), "f32", rng) for _ in range(3))
    out = np.zeros(bad.get("out_shape", (1, 2, 9, 16)), np.float32)
    stats = np.zeros((1, 2, 9, 1), bad.get("stats_dtype", np.float32))
    with pytest.raises(ValueError, match=match):
        ga.scaled_dot_product_attention_backward(np.zeros_like(out), q, k, v, out, stats)


DROPOUT_CASES = {
    "plain": dict(q=(1, 2, 37, 32), k=(1, 2, 70, 32), v=(1, 2, 70, 24)),
    "gqa_causal": dict(q=(1, 4, 65, 32), k=(1, 2, 65, 32), v=(1, 2, 65, 32), enable_gqa=True, is_causal=True),
    "decode": dict(q=(1, 8, 1, 64), k=(1, 2, 300, 64), v=(1, 2, 300, 64), enable_gqa=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(DROPOUT_CASES))
def test_dropout_forward_and_backward_match_reference(case, dtype, rng):
    args = dict(DROPOUT_CASES[case])
    q, k, v = (random_array(args.pop(name), dtype, rng) for name in ("q", "k", "v"))
    drop = dict(dropout_p=0.25, dropout_seed=int(rng.integers(2**62)), dropout_offset=int(rng.integers(2**40)))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **drop, **args)
    want_out, want_stats = sdpa_reference(q, k, v, return_stats=True, **drop, **args)
    assert_grad_close(out, want_out, dtype, "out")
    assert_grad_close(stats, want_stats, "f32", "stats (dropout does not change them)")
    grad_out = random_array(out.shape, dtype, rng)
    got = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, **drop, **args)
    want = sdpa_reference_backward(grad_out, q, k, v, **drop, **args)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_grad_close(g, w, dtype, name)


def test_dropout_mask_is_deterministic_per_seed_and_varies_across_seeds(rng):
    q, k, v = (random_array((1, 2, 50, 16), "f32", rng) for _ in range(3))
    run = lambda seed, offset=0: ga.scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_seed=seed,  # noqa: E731
                                                                 dropout_offset=offset)
    assert np.array_equal(run(7), run(7))
    assert not np.array_equal(run(7), run(8))
    assert not np.array_equal(run(7), run(7, offset=1))
    a, b = ga.scaled_dot_product_attention(q, k, v, dropout_p=0.5), ga.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not np.array_equal(a, b)  # dropout_seed=None draws a fresh seed per call


def test_dropout_keep_rate_and_unbiased_mean(rng):
    """V = identity rows expose P Z itself: the kept fraction is within binomial error of 1 - p, and
    averaging over seeds recovers the output without dropout."""
    p, seq = 0.3, 64
    q = random_array((1, 1, seq, 16), "f32", rng)
    k = random_array((1, 1, seq, 16), "f32", rng)
    v = np.eye(seq, dtype=np.float32)[None, None]
    dropped = ga.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_seed=123)
    kept = np.count_nonzero(dropped) / dropped.size
    sigma = math.sqrt(p * (1 - p) / dropped.size)
    assert abs(kept - (1 - p)) < 5 * sigma, (kept, sigma)
    plain = ga.scaled_dot_product_attention(q, k, v)
    seeds = 400
    mean = sum(ga.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_seed=s) for s in range(seeds)) / seeds
    # each element averages `seeds` draws of P * Z, of variance P^2 p / (1 - p)
    bound = 5 * plain * math.sqrt(p / (1 - p) / seeds) + 1e-6
    assert np.all(np.abs(mean - plain) <= bound)


def test_backward_needs_the_forward_seed(rng):
    q, k, v = (random_array((1, 2, 9, 16), "f32", rng) for _ in range(3))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, dropout_p=0.2, dropout_seed=5)
    with pytest.raises(ValueError, match="dropout_seed"):
        ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats, dropout_p=0.2)
    with pytest.raises(ValueError, match="dropout_seed must fit in a signed 64-bit integer"):
        ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats, dropout_p=0.2, dropout_seed=1 << 63)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_verbose_logs_the_functional_backward(dtype, capsys, rng):
    """GRAPHATTN_VERBOSE's lines for the one-call backward: its build and the rule that chose it when a
    signature is first planned and when a later call replays that plan, then each call's kernel time."""
    q, k, v = (random_array((1, 2, 70, 64), dtype, rng) for _ in range(3))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    ga.set_verbose(1)
    try:
        for _ in range(2):
            ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats)
    finally:
        ga.set_verbose(0)
    err = capsys.readouterr().err
    isa = ga.backward_isa(dtype, 70, 70)
    compiles = [line for line in err.splitlines() if
                line.startswith(f"graphattn_verbose,compile,functional_backward,sdpa_backward_cpu,isa={isa},why=")]
    assert len(compiles) == 2 and "plan=new signature" in compiles[0] and "plan=replayed" in compiles[1], err
    pairs = isa == "avx512" and dtype == "bf16" and bf16_pairs_expected()
    layout = "tiles" if isa.startswith("amx") else ("lanes_bf16_pairs" if pairs else "lanes")
    assert f",layout={layout},key_block=" in err
    assert err.count("graphattn_verbose,exec,functional_backward,sdpa_backward_cpu,batch=1x2,sq=70,skv=70") == 2


LANE_PLAN_SCRIPT = """
import sys
import numpy as np, graphattn as ga
from graphattn.testing import assert_grad_close, random_array, sdpa_reference_backward
ga.set_verbose(1)
rng = np.random.default_rng(5)
for name, (q_shape, k_shape, args) in CASES.items():
    q = random_array(q_shape, "f32", rng)
    k, v = (random_array(k_shape, "f32", rng) for _ in range(2))
    out, st = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **args)
    do = random_array(out.shape, "f32", rng)
    got = ga.scaled_dot_product_attention_backward(do, q, k, v, out, st, **args)
    for what, g, w in zip(("dq", "dk", "dv"), got, sdpa_reference_backward(do, q, k, v, **args)):
        assert_grad_close(g, w, "f32", name + " " + what)
    print(name, file=sys.stderr)
"""


def lane_backward_plans(cases: dict) -> dict:
    """Runs each f32 case's backward on the vector build with two threads, checking its gradients against the
    reference, and returns each case's key pass layout from the verbose log as a dict of its fields."""
    _, log = run_python_logged(f"CASES = {cases!r}\n" + LANE_PLAN_SCRIPT, "avx512",
                               OMP_NUM_THREADS="2")
    plans = {}
    name_of = iter(cases)
    for line in log.splitlines():  # each case's backward compile line comes before its name
        if ",compile,functional_backward," in line:
            plans[next(name_of)] = dict(f.split("=", 1) for f in line.split(",") if "=" in f)
    assert list(plans) == list(cases)
    return plans


def test_f32_dq_sums_in_the_gradient_itself():
    """The vector build's f32 backward sums dQ += dS K straight into dQ where its key blocks are not split
    and D is whole vectors (no buffer of dQ's size); an odd head dim or split keys keep the buffers."""
    plans = lane_backward_plans({
        "one_split_gqa_causal": ((1, 4, 96, 64), (1, 2, 130, 64), dict(enable_gqa=True, is_causal=True)),
        "odd_head_dim": ((1, 4, 96, 18), (1, 2, 130, 18), dict(enable_gqa=True, is_causal=True)),
        "split_keys": ((1, 1, 8, 64), (1, 1, 600, 64), {})})
    splits_and_kib = {name: (int(p["key_splits"]), int(p["dq_buffers_kib"])) for name, p in plans.items()}
    assert splits_and_kib["one_split_gqa_causal"] == (1, 0)
    assert splits_and_kib["odd_head_dim"][0] == 1 and splits_and_kib["odd_head_dim"][1] > 0
    assert splits_and_kib["split_keys"][0] > 1 and splits_and_kib["split_keys"][1] > 0


def test_last_wave_pieces_of_several_key_blocks():
    """The last item per thread goes in pieces of four key blocks where that still gives each thread four
    pieces (the last two of eight items of 16 key blocks, on two threads; or of eight items that each take
    every fourth of 64 key blocks), else of one: items of 3 key blocks, or causal ones (their blocks' work
    differs)."""
    plans = lane_backward_plans({
        "long_items": ((1, 8, 64, 32), (1, 8, 1000, 32), {}),
        "split_long_items": ((1, 2, 16, 32), (1, 2, 4096, 32), {}),
        "short_items": ((1, 8, 64, 32), (1, 8, 150, 32), {}),
        "causal_items": ((1, 2, 900, 32), (1, 2, 1000, 32), dict(is_causal=True, causal_alignment="bottom_right"))})
    assert plans["long_items"]["key_splits"] == "1" and plans["long_items"]["order"] == "batch_major+pieces_of_4"
    assert plans["split_long_items"]["key_splits"] == "4"
    assert plans["split_long_items"]["order"] == "batch_major+pieces_of_4"
    assert plans["short_items"]["order"] == "batch_major+pieces"
    assert plans["causal_items"]["key_splits"] == "1" and plans["causal_items"]["order"] == "batch_major+pieces"


BF16_PAIR_CASES = ("plain", "s17_d80", "d256", "long", "gqa_causal", "tiles_d80_dv48", "many_key_blocks_gqa_causal",
                   "short_queries_split_keys_causal")


def test_bf16_pair_products_on_the_vector_build():
    """Where bf16 pairs pay off, the vector build's bf16 backward takes its five products on them
    (lane_gemm_bf16.hpp): odd row counts and key counts (pairs reaching past the last row or key), GQA, causal,
    split keys, a mask with an empty row and its gradient, checked with the choice capped at the vector build
    (AMX would take most of these); an odd head dim keeps the f32 products, as does every call on CPUs where
    pairs do not pay off.  The log names the layout of each."""
    cases = {name: CASES[name] for name in BF16_PAIR_CASES}
    cases["mask_d64"] = dict(q=(1, 2, 37, 64), k=(1, 2, 45, 64), v=(1, 2, 45, 64))
    cases["odd_head_dim_mask"] = dict(q=(1, 2, 37, 33), k=(1, 2, 45, 33), v=(1, 2, 45, 20))
    script = (
        "import sys\n"
        "import numpy as np, graphattn as ga\n"
        "from graphattn.testing import assert_grad_close, random_array, sdpa_reference_backward\n"
        "ga.set_verbose(1)\n"
        "rng = np.random.default_rng(4)\n"
        f"for name, case in {cases!r}.items():\n"
        "    args = dict(case)\n"
        "    q, k, v = (random_array(args.pop(n), 'bf16', rng) for n in ('q', 'k', 'v'))\n"
        "    mask = None\n"
        "    if 'mask' in name:\n"
        "        mask = rng.standard_normal((q.shape[-2], k.shape[-2])).astype(np.float32)\n"
        "        mask[3] = -np.inf  # a row that sees no key\n"
        "    out, st = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_stats=True, **args)\n"
        "    do = random_array(out.shape, 'bf16', rng)\n"
        "    got = ga.scaled_dot_product_attention_backward(do, q, k, v, out, st, attn_mask=mask,\n"
        "                                                   return_mask_grad=mask is not None, **args)\n"
        "    want = sdpa_reference_backward(do, q, k, v, attn_mask=mask, **args)\n"
        "    for what, g, w in zip(('dq', 'dk', 'dv', 'dmask'), got, want):\n"
        "        if w is not None:\n"
        "            assert_grad_close(g, w, 'bf16', name + ' ' + what)\n"
        "    print(name, file=sys.stderr)\n")
    _, log = run_python_logged(script, "avx512", OMP_NUM_THREADS="2")
    layouts = {}
    name_of = iter(cases)
    for line in log.splitlines():  # each case's backward compile line comes before its name
        if ",compile,functional_backward," in line:
            layouts[next(name_of)] = line.split(",layout=")[1].split(",")[0]
    pairs = bf16_pairs_expected()
    assert layouts == {name: "lanes_bf16_pairs" if pairs and not name.startswith("odd") else "lanes" for name in cases}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_q,seq_kv", [(3, 0), (40, 0), (0, 5), (0, 0)])
def test_empty_sequences(seq_q, seq_kv, dtype, rng):
    """No keys: every output row is fully masked (0) and dQ is 0; no queries: dK and dV are 0."""
    q = random_array((1, 2, seq_q, 16), dtype, rng)
    k = random_array((1, 2, seq_kv, 16), dtype, rng)
    v = random_array((1, 2, seq_kv, 8), dtype, rng)
    for causal in (False, True):
        out, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=causal, return_stats=True)
        assert out.shape == (1, 2, seq_q, 8) and not np.any(out.astype(np.float32))
        grad = random_array(out.shape, dtype, rng)
        dq, dk, dv = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, is_causal=causal)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert not (np.any(dq.astype(np.float32)) or np.any(dk.astype(np.float32)) or np.any(dv.astype(np.float32)))


DETERMINISM_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.testing import random_array
rng = np.random.default_rng(3)
same = []
for dtype in ("bf16", "f32"):
    q = random_array((1, 4, 90, 48), dtype, rng)
    k, v = (random_array((1, 4, 650, 48), dtype, rng) for _ in range(2))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    grad_out = random_array(out.shape, dtype, rng)
    first = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats)
    same += [np.array_equal(a, b) for _ in range(20)
             for a, b in zip(first, ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats))]
print(all(same))
"""


@pytest.mark.parametrize("threads", ["2", "4"])
def test_backward_repeats_bitwise(threads):
    """The backwards' last items go in key-block pieces whose adds to dQ take turns in key-block order
    (DqTurns), so twenty calls give bitwise the same gradients, bf16 (AMX where the CPU has it) and f32
    (vector build)."""
    assert run_python(DETERMINISM_SCRIPT, OMP_NUM_THREADS=threads).strip() == "True"


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_operands_go_to_the_kernel_directly(dtype, rng):
    """torch operands without a mask reach the kernel as they are once their signature has a plan: the first
    call (planned through NumPy views) and the next ones (direct) give gradients of the operands' own shapes,
    GQA's dK/dV included, also where one operand requires grad; a mask gradient asked for is None."""
    torch = pytest.importorskip("torch")
    from graphattn.interop import to_numpy

    tdt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    q = torch.randn(1, 8, 20, 48).to(tdt)
    k = torch.randn(1, 2, 70, 48).to(tdt).requires_grad_()
    v = torch.randn(1, 2, 70, 32).to(tdt)
    out, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True)
    grad_out = torch.randn(out.shape).to(tdt)
    want = sdpa_reference_backward(*(to_numpy(x, "operand")[0] for x in (grad_out, q, k, v)), enable_gqa=True)
    for _ in range(3):
        *grads, dmask = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, enable_gqa=True,
                                                                 return_mask_grad=True)
        assert dmask is None
        for name, g, w, src in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
            assert isinstance(g, torch.Tensor) and g.shape == src.shape and g.dtype == tdt, name
            assert_grad_close(to_numpy(g, name)[0], w, dtype, name)
