"""A call that differs from a planned one only in its sequence lengths re-makes that plan (native/cpu's
LengthFreeForward replays the lowering) instead of being checked and lowered anew.  Each case runs a series of
lengths and checks, per length: the plan was replayed, the result matches the float64 reference, and it
equals bit for bit the result of a plan lowered from scratch for the same call."""
import numpy as np
import pytest

import graphattn as ga
from graphattn import _cpu, forward_call, functional_backward
from graphattn.attention_spec import lower
from graphattn.testing import (STATS_TOLERANCE, assert_close, assert_grad_close, random_array, sdpa_reference,
                               sdpa_reference_backward)


REPLAYED = "plan=replayed"


def _fresh_caches():
    forward_call._cache.clear()
    forward_call._by_length_free.clear()


def _numpy(x):
    if isinstance(x, np.ndarray):
        return x
    import torch

    return (x.float() if x.dtype == torch.bfloat16 else x).numpy()


def _run_lengths(make, lengths, dtype, capsys, **kwargs):
    """Calls make(length) -> (q, k, v, mask) for each length in order; the first plans, every later one must be
    a replay that agrees with the reference and with a plan lowered from scratch."""
    _fresh_caches()
    for index, length in enumerate(lengths):
        q, k, v, mask = make(length)
        ga.set_verbose(1)
        try:
            replayed = ga.scaled_dot_product_attention(q, k, v, mask, **kwargs)
        finally:
            ga.set_verbose(0)
        log = capsys.readouterr().err
        if index:
            assert REPLAYED in log, f"length {length}: planned anew, not replayed:\n{log}"
        results = replayed if isinstance(replayed, tuple) else (replayed,)
        quiet = ga.scaled_dot_product_attention(q, k, v, mask, **kwargs)  # unlogged: NumPy's one native call
        for got, want in zip(quiet if isinstance(quiet, tuple) else (quiet,), results):
            np.testing.assert_array_equal(_numpy(got), _numpy(want))
        expected = sdpa_reference(*(_numpy(a) for a in (q, k, v)), None if mask is None else _numpy(mask),
                                  **{k: v for k, v in kwargs.items() if k not in ("dropout_p", "dropout_seed")})
        expected = expected if isinstance(expected, tuple) else (expected,)
        if "dropout_p" not in kwargs:
            assert_close(_numpy(results[0]), expected[0], dtype, f"output at length {length}")
            if len(results) == 2:
                assert_close(_numpy(results[1]), expected[1], dtype, f"stats at length {length}",
                             tolerance=STATS_TOLERANCE)
        _fresh_caches()  # the same call planned from scratch gives the same bits
        fresh = ga.scaled_dot_product_attention(q, k, v, mask, **kwargs)
        fresh = fresh if isinstance(fresh, tuple) else (fresh,)
        for got, want in zip(results, fresh):
            np.testing.assert_array_equal(_numpy(got), _numpy(want))
        # keep the replay's template: the next length replays the plan made for this one
        forward_call._cache.clear()


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_decode_gqa_with_a_growing_cache(dtype, rng, capsys):
    q = random_array((2, 8, 1, 16), dtype, rng)
    keys = {n: (random_array((2, 2, n, 16), dtype, rng), random_array((2, 2, n, 16), dtype, rng))
            for n in range(5, 12)}
    _run_lengths(lambda n: (q,) + keys[n] + (None,), list(keys), dtype, capsys, enable_gqa=True)


def test_static_cache_views_keep_their_strides(rng, capsys):
    """K/V as views of one preallocated buffer: the strides stay, only the length changes."""
    q = random_array((1, 4, 1, 32), "f32", rng)
    buffer = random_array((1, 2, 40, 32), "f32", rng)
    _run_lengths(lambda n: (q, buffer[:, :, :n], buffer[:, :, :n] * 1, None), [7, 8, 20, 39], "f32", capsys,
                 enable_gqa=True)


@pytest.mark.parametrize("window", [None, (2, 0), (3, 1)])
def test_chunked_prefill_bottom_right_moves_with_the_lengths(window, rng, capsys):
    """S_q < S_kv, causal aligned bottom-right: the kernel's window shifts by S_kv - S_q at each length."""
    q = random_array((1, 3, 4, 8), "f32", rng)
    kv = {n: random_array((1, 3, n, 8), "f32", rng) for n in (6, 9, 13)}
    _run_lengths(lambda n: (q, kv[n], kv[n], None), list(kv), "f32", capsys, is_causal=True,
                 causal_alignment="bottom_right", window=window)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_masks_follow_the_key_length(mask_kind, rng, capsys):
    """A padding mask (N, 1, 1, S) and a full float mask (N, H, L, S), L and S changing together."""
    def make(n):
        q, k, v = (random_array((2, 3, n, 8), "f32", rng) for _ in range(3))
        if mask_kind == "bool":
            mask = np.ones((2, 1, 1, n), bool)
            mask[0, ..., : n // 2] = False
        else:
            mask = random_array((2, 3, n, n), "f32", rng)
        return q, k, v, mask

    _run_lengths(make, [4, 7, 10], "f32", capsys, return_stats=True)


def test_five_batch_dims_fold_at_every_length(rng, capsys):
    def make(n):
        return tuple(random_array((2, 3, 2, 2, n, 8), "f32", rng) for _ in range(3)) + (None,)

    _run_lengths(make, [3, 6, 11], "f32", capsys)


def test_a_new_length_whose_strides_break_a_fold_is_planned_anew(rng):
    """Batch dims folded by the first call's lowering: a K of a new length whose outer batch stride no longer
    steps over the inner ones (a view of a wider buffer) is planned in full, with the right result."""
    _fresh_caches()
    q, k, v = (random_array((2, 3, 2, 2, 4, 8), "f32", rng) for _ in range(3))
    ga.scaled_dot_product_attention(q, k, v)
    wide = random_array((3, 3, 2, 2, 6, 8), "f32", rng)[::2]  # the outermost stride skips a block
    k = wide[..., :5, :]
    v = random_array((2, 3, 2, 2, 5, 8), "f32", rng)
    assert_close(ga.scaled_dot_product_attention(q, k, v), sdpa_reference(q, k, v), "f32", "strided K")
    assert len(forward_call._cache) == 2


def test_dropout_draws_the_same_mask_as_a_fresh_plan(rng, capsys):
    def make(n):
        return tuple(random_array((2, 2, n, 8), "f32", rng) for _ in range(3)) + (None,)

    _run_lengths(make, [5, 9, 16], "f32", capsys, dropout_p=0.3, dropout_seed=7)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_projections_transposed_as_transformers_does(dtype, capsys):
    """(N, S, H, D) projections viewed as (N, H, S, D): strides that change with S."""
    torch = pytest.importorskip("torch")
    tdtype = torch.float32 if dtype == "f32" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    def make(n):
        q, k, v = (torch.randn(2, n, 4, 16, generator=gen).to(tdtype).transpose(1, 2) for _ in range(3))
        return q, k, v, None

    _run_lengths(make, [5, 6, 17], dtype, capsys, is_causal=True)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_torch_decode_with_stats_at_new_lengths(dtype, capsys):
    """A torch decode step's query (N, Hq, 1, D) against contiguous K/V of a new length each call, GQA, with the
    stats: the output laid out as the query, the stats made for it."""
    torch = pytest.importorskip("torch")
    tdtype = torch.float32 if dtype == "f32" else torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 1, 32, generator=gen).to(tdtype)

    def make(n):
        k, v = (torch.randn(2, 2, n, 32, generator=gen).to(tdtype) for _ in range(2))
        return q, k, v, None

    _run_lengths(make, [9, 10, 33], dtype, capsys, enable_gqa=True, return_stats=True)


def test_a_length_rule_broken_by_a_new_length_is_named(rng):
    """The replay re-checks the length rules: K and V of different lengths still raise the full check's error."""
    _fresh_caches()
    q = random_array((1, 2, 1, 8), "f32", rng)
    ga.scaled_dot_product_attention(q, random_array((1, 2, 5, 8), "f32", rng), random_array((1, 2, 5, 8), "f32", rng))
    with pytest.raises(ValueError, match="key and value sequence lengths differ"):
        ga.scaled_dot_product_attention(q, random_array((1, 2, 6, 8), "f32", rng),
                                        random_array((1, 2, 7, 8), "f32", rng))


def test_a_new_length_writes_into_out_and_checks_it(rng):
    """out= on a replayed call: the result is written into it and returned as it; an out of the plan's old
    shape, or one over an input's memory, is refused by name with nothing written."""
    _fresh_caches()
    q = random_array((1, 4, 2, 8), "f32", rng)
    ga.scaled_dot_product_attention(q, *(random_array((1, 2, 5, 8), "f32", rng) for _ in range(2)), enable_gqa=True,
                                    return_stats=True)
    k, v = (random_array((1, 2, 9, 8), "f32", rng) for _ in range(2))
    out = np.full((1, 4, 2, 8), np.nan, np.float32)
    got, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True, out=out)
    assert got is out
    expected, expected_stats = sdpa_reference(q, k, v, enable_gqa=True, return_stats=True)
    assert_close(out, expected, "f32", "out")
    assert_close(stats, expected_stats, "f32", "stats", tolerance=STATS_TOLERANCE)
    k, v = (random_array((1, 2, 11, 8), "f32", rng) for _ in range(2))
    wrong = np.zeros((1, 4, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"out must have the result's shape \(1, 4, 2, 8\)"):
        ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True, out=wrong)
    assert not wrong.any()
    before = q.copy()
    with pytest.raises(ValueError, match="out shares memory with query"):
        ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True, out=q)
    np.testing.assert_array_equal(q, before)


def test_the_replay_declines_where_a_batch_fold_no_longer_holds(rng):
    """Four batch dims fold into three only while the outer stride is the inner one times its size: strides
    that break the fold the lowering made make the replay decline (and the caller lower the call anew)."""
    from graphattn.attention_spec import AttentionSpec, Operand
    from graphattn.dtypes import DataType
    from graphattn.logical_tensor import dense_strides

    batch, n, d = (2, 3, 2, 2), 5, 4
    operands = {role: Operand(DataType.f32, batch + (n, d), dense_strides(batch + (n, d)))
                for role in ("query", "key", "value", "output")}
    call = lower(AttentionSpec("forward", batch, n, n, d, d, operands))
    assert call.folds, "the lowering folded no batch dims"
    replay = call.forward_plan().length_free(call.sources, call.folds, dense_strides(batch + (1,))[:-1])
    dense = dense_strides(batch + (n + 1, d))
    open_side = _cpu.NO_KEY_LIMIT
    assert replay.plan_for(n + 1, n + 1, dense, dense, dense, None, open_side, open_side) is not None
    broken = (dense[0] + 1,) + dense[1:]  # the outermost dim no longer steps over the next ones
    assert replay.plan_for(n + 1, n + 1, broken, dense, dense, None, open_side, open_side) is None


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_score_modifiers_keep_the_replay(dtype, rng, capsys):
    """gpt-oss-like decode (sinks, a window), Gemma-2-like (softcap) and ALiBi bottom-right: the per-head
    operands keep their strides at every length, and ALiBi's row shift follows the lengths."""
    q = random_array((1, 8, 3, 16), dtype, rng)
    keys = {n: (random_array((1, 2, n, 16), dtype, rng), random_array((1, 2, n, 16), dtype, rng))
            for n in range(5, 11)}
    modifiers = dict(softcap=3.0, alibi_slopes=(rng.random(8) * 0.5).astype(np.float32),
                     sinks=rng.standard_normal(8).astype(np.float32))
    _run_lengths(lambda n: (q,) + keys[n] + (None,), list(keys), dtype, capsys, enable_gqa=True, is_causal=True,
                 causal_alignment="bottom_right", window=(4, 0), return_stats=True, **modifiers)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("options", [dict(enable_gqa=True), dict(enable_gqa=True, is_causal=True,
                                                                 causal_alignment="bottom_right"),
                                     dict(window=(3, 0)), dict(enable_gqa=True, sinks="yes", softcap=4.0)],
                         ids=["gqa", "gqa_causal_bottom_right", "window", "sinks_softcap"])
def test_backward_replays_its_plan_for_new_lengths(options, dtype, rng, monkeypatch):
    """The functional backward re-makes a direct plan for new K/V lengths (functional_backward's
    _LengthFreeBackward): one plan for ten lengths, each call's gradients (dsinks included) against the
    reference."""
    planned = _backward_plans_counted(monkeypatch)
    kw = dict(options)
    if kw.get("sinks") == "yes":
        kw["sinks"] = rng.standard_normal(8).astype(np.float32)
    heads_kv = 2 if kw.get("enable_gqa") else 8
    q = random_array((2, 8, 5, 16), dtype, rng)
    for n in range(20, 30):
        k, v = random_array((2, heads_kv, n, 16), dtype, rng), random_array((2, heads_kv, n, 16), dtype, rng)
        out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)
        grad = random_array(out.shape, dtype, rng)
        got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, return_sinks_grad="sinks" in kw,
                                                       **kw)
        want = sdpa_reference_backward(grad, q, k, v, **kw)
        want = want[:3] + want[4:]
        magnitude = max(float(np.abs(w).max()) for w in want[:3])
        for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
            assert_grad_close(g, w, dtype, f"{name} at length {n}", magnitude)
    assert len(planned) == 1, f"{len(planned)} plans for 10 lengths"


def _backward_plans_counted(monkeypatch) -> list:
    """Clears the backward's caches; the list grows by one per call planned from scratch."""
    from graphattn import functional_backward

    functional_backward._plans.clear()
    functional_backward._by_length_free.clear()
    planned = []
    plan = functional_backward._plan
    monkeypatch.setattr(functional_backward, "_plan", lambda *a, **k: planned.append(1) or plan(*a, **k))
    return planned


def _backward_against_reference(q, k, v, dtype, rng, where, **kw):
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)
    grad = random_array(out.shape, dtype, rng)
    got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, **kw)
    want = sdpa_reference_backward(grad, q, k, v, **kw)[:3]
    magnitude = max(float(np.abs(w).max()) for w in want)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_grad_close(g, w, dtype, f"{name} {where}", magnitude)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_backward_replays_both_lengths_on_strided_views(dtype, rng, monkeypatch):
    """Query and key lengths both change; Q, K, V are (N, S, H, D) projections viewed as (N, H, S, D), as
    transformers passes them: one plan serves every pair of lengths, each against the reference."""
    planned = _backward_plans_counted(monkeypatch)
    for seq_q, seq_kv in ((7, 11), (3, 19), (12, 5), (9, 9), (2, 30)):
        q = random_array((2, seq_q, 8, 16), dtype, rng).transpose(0, 2, 1, 3)
        k, v = (random_array((2, seq_kv, 2, 16), dtype, rng).transpose(0, 2, 1, 3) for _ in range(2))
        _backward_against_reference(q, k, v, dtype, rng, f"at lengths {(seq_q, seq_kv)}", enable_gqa=True,
                                    is_causal=True, causal_alignment="bottom_right")
    assert len(planned) == 1, f"{len(planned)} plans for 5 pairs of lengths"


MASKS = {  # name: (mask shape for lengths (L, S) and query heads H, bool or float, GQA)
    "padding_bool": (lambda seq_q, seq_kv: (2, 1, 1, seq_kv), np.bool_, True),
    "rows_bool_gqa": (lambda seq_q, seq_kv: (2, 1, seq_q, seq_kv), np.bool_, True),
    "per_head_float_gqa": (lambda seq_q, seq_kv: (2, 8, seq_q, seq_kv), np.float32, True),
    "two_dim_float": (lambda seq_q, seq_kv: (seq_q, seq_kv), np.float32, False),
    "padding_float": (lambda seq_q, seq_kv: (2, 1, 1, seq_kv), np.float32, False),
    # a padding mask broadcast over the query rows as a view (stride 0), as an expanded torch mask is
    "padding_expanded_bool": (lambda seq_q, seq_kv: (2, 1, seq_q, seq_kv), "expanded", True),
}


def _random_mask(shape, dtype, rng):
    if dtype == "expanded":
        return np.broadcast_to(_random_mask(shape[:-2] + (1, shape[-1]), np.bool_, rng), shape)
    if dtype == np.bool_:
        mask = rng.random(shape) < 0.8
        mask[..., 0] = True  # every row sees a key
        return mask
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("mask_case", list(MASKS))
def test_backward_with_a_mask_replays_for_new_lengths(mask_case, dtype, rng, monkeypatch):
    """A backward with a mask (bool or float, broadcast over heads or rows, or as long as the scores) re-makes
    its plan for new lengths of Q and K/V, the mask's with them: one plan for five pairs of lengths, each
    call's dQ, dK, dV and dMask (float masks) against the reference."""
    planned = _backward_plans_counted(monkeypatch)
    shape_of, mask_dtype, gqa = MASKS[mask_case]
    heads_kv = 2 if gqa else 8
    for seq_q, seq_kv in ((7, 11), (3, 19), (12, 5), (9, 9), (1, 30)):
        q = random_array((2, 8, seq_q, 16), dtype, rng)
        k, v = (random_array((2, heads_kv, seq_kv, 16), dtype, rng) for _ in range(2))
        mask = _random_mask(shape_of(seq_q, seq_kv), mask_dtype, rng)
        kw = dict(enable_gqa=gqa, window=(4, 2) if seq_q == 9 else None)
        out, stats = ga.scaled_dot_product_attention(q, k, v, mask, return_stats=True, **kw)
        grad = random_array(out.shape, dtype, rng)
        got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, mask, return_mask_grad=True, **kw)
        want = sdpa_reference_backward(grad, q, k, v, mask, **kw)
        magnitude = max(float(np.abs(w).max()) for w in want[:3])
        where = f"at lengths {(seq_q, seq_kv)}"
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert_grad_close(g, w, dtype, f"{name} {where}", magnitude)
        if mask_dtype != np.float32:
            assert got[3] is None
        else:
            assert got[3].shape == mask.shape
            assert_grad_close(got[3], want[3], dtype, f"dmask {where}", magnitude)
    # the windowed call (9, 9) has its own template; a query of one row keeps its own class (1 is not a length)
    assert len(planned) == 3, f"{len(planned)} plans for 5 pairs of lengths"


def test_backward_replay_declines_where_a_batch_fold_breaks(rng, monkeypatch):
    """Five-dim GQA inputs have four batch dims once the heads are split, two of which the lowering folds into
    one kernel dim; a query that is a view of a wider dim 1 breaks that fold, so its call is planned anew
    (and is right), while contiguous calls of other lengths keep replaying."""
    planned = _backward_plans_counted(monkeypatch)
    for seq, view, plans in ((6, False, 1), (9, False, 1), (7, True, 2), (11, False, 2)):
        q = random_array((2, 3, 4, seq, 8), "f32", rng)
        if view:
            wider = random_array((2, 5, 4, seq, 8), "f32", rng)
            wider[:, :3] = q
            q = wider[:, :3]
        k, v = (random_array((2, 3, 2, seq + 3, 8), "f32", rng) for _ in range(2))
        _backward_against_reference(q, k, v, "f32", rng, f"at length {seq}, view {view}", enable_gqa=True)
        assert len(planned) == plans, (seq, view, len(planned))


def test_a_loop_of_new_lengths_leaves_the_plan_cache_as_it_was(rng, monkeypatch):
    """A decode loop of more new lengths than the plan cache holds keeps every other signature's plan in it,
    plans only its first call and keeps nothing per length: every later call, a model's other layers too, runs
    through the first call's plan replayed at its lengths."""
    from graphattn.plan_cache import CACHE_SIZE

    _fresh_caches()
    replays = []
    run = forward_call._LengthFreePlan.run
    monkeypatch.setattr(forward_call._LengthFreePlan, "run", lambda *a: replays.append(1) or run(*a))
    other = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    ga.scaled_dot_product_attention(other, other, other)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    cache = rng.standard_normal((1, 2, 20 + CACHE_SIZE + 10, 8)).astype(np.float32)
    for n in range(20, 20 + CACHE_SIZE + 10):
        kv = np.ascontiguousarray(cache[:, :, :n])
        for layer in range(3):
            got = ga.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        if n % 97 == 0:
            assert_close(got, sdpa_reference(q, kv, kv, enable_gqa=True), "f32", f"length {n}")
    assert len(forward_call._cache) == 2  # the other call's plan and the loop's first
    assert forward_call._cache.replayed_count() == 0
    assert len(forward_call._by_length_free) == 2
    assert len(replays) == 3 * (CACHE_SIZE + 10) - 1  # every call but the first, which planned


def _key(arrays, flags=(True, (-1, 0), "top_left", False, 0.0, None), free=False):
    return _cpu.signature_key(arrays, forward_call._FREE_AXES, flags, free)


def test_a_signature_key_tells_apart_what_a_plan_depends_on(rng):
    """The bytes a NumPy call's plans are cached under: equal for calls of equal layouts, dtypes and flags, and
    different where any of them differs (strides, dtype, byte order, a mask, each flag); the length-free key
    leaves out the sequence lengths of 2 or more and the strides, and keeps lengths 0 and 1."""
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    mask = np.ones((1, 1, 3, 9), bool)
    base = _key((q, k, k, None))
    assert type(base) is bytes
    assert _key((q.copy(), k.copy(), k.copy(), None)) == base
    wide = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
    others = [
        _key((q, wide[:, :, :9], k, None)),                          # another stride
        _key((q, k.astype(np.float16), k, None)),                    # another dtype
        _key((q, k.astype(">f4"), k, None)),                         # another byte order
        _key((q, k, k, mask)),                                       # a mask
        _key((q, k, k, mask.astype(np.float32))),                    # a mask of another dtype
        _key((q[..., :4], k[..., :4], k, None)),                     # another head size
        _key((q, k, k, None), (False, (-1, 0), "top_left", False, 0.0, None)),
        _key((q, k, k, None), (True, (-1, -1), "top_left", False, 0.0, None)),
        _key((q, k, k, None), (True, (-1, 0), "bottom_right", False, 0.0, None)),
        _key((q, k, k, None), (True, (-1, 0), "top_left", True, 0.0, None)),
        _key((q, k, k, None), (True, (-1, 0), "top_left", False, 0.25, None)),
        _key((q, k, k, None), (True, (-1, 0), "top_left", False, 0.0, (30.0, None, (4,)))),
        _key((q, k, k, None), (True, (-1, 0), "top_left", False, 0.0, (30.0, (4,), None))),
        _key((q, k, k, None), (True, (-1, 0), "top_left", False, 0.0, (50.0, None, (4,)))),
        _key((q, k, k, None), (True, (-1, 0), "top_left", False, 0.0, (30.0, None, (1, 4)))),
    ]
    assert len(set(others + [base])) == len(others) + 1
    free = _key((q, k, k, None), free=True)
    longer = rng.standard_normal((1, 2, 17, 8)).astype(np.float32)
    assert free != base
    assert _key((q, wide[:, :, :9], wide[:, :, :9], None), free=True) == free  # strides left out
    assert _key((q, longer, longer, None), free=True) == free
    assert _key((q, k[:, :, :1], k[:, :, :1], None), free=True) != free  # a length of 1 stays
    assert _key((q, k, k, mask), free=True) == _key((q, longer, longer, np.ones((1, 1, 3, 17), bool)), free=True)
    assert _key((q, k, k, mask), free=True) != _key((q, k, k, mask[..., :1]), free=True)


class _Subclass(np.ndarray):
    pass


def test_a_signature_key_is_none_where_a_tuple_must_do(rng):
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    assert _key((q, q, q, None), free=True) is not None
    assert _key((q, q[:, :, :0], q[:, :, :0], None), free=True) is None  # an empty operand has no free key
    assert _key((q, q[:, :, :0], q[:, :, :0], None)) is not None
    assert _key((q.view(_Subclass), q, q, None)) is None  # a NumPy subclass
    assert _key((q, q, q, None), (True, (1 << 70, 0), "top_left", False, 0.0, None)) is None
    assert _key((q, q, q, None), (np.True_, (-1, 0), "top_left", False, 0.0, None)) is None
    assert _key((q, q, q, None), (True, (-1, 0), "top_left", False, 0.0, [1])) is None


def test_a_byte_swapped_call_after_a_native_one_is_still_refused(rng):
    """A cached plan serves only arrays of its own byte order: a big-endian call of the same shape is checked
    and refused by name."""
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    ga.scaled_dot_product_attention(q, q, q)
    swapped = q.astype(">f4")
    with pytest.raises(TypeError, match="query dtype >f4"):
        ga.scaled_dot_product_attention(swapped, swapped, swapped)
    with pytest.raises(TypeError, match="dtype >f4"):
        ga.scaled_dot_product_attention_backward(q, swapped, swapped, swapped, q, np.zeros((1, 2, 3, 1), np.float32))


def test_a_key_naming_its_lengths_tells_equal_lengths_from_unequal(rng):
    """The graph API's length-free key (name_lengths): unknown dims are named by the place of their size among
    the sizes met, so calls share it only where their lengths are equal in the same places; a dim marked on an
    array of another rank stays as it is, and dtypes=False leaves the dtypes out."""
    def key(*arrays, axes=(4, 0b10, 4, 0b10), dtypes=True):
        return _cpu.signature_key(list(arrays), axes, (0, 1), True, name_lengths=True, dtypes=dtypes)

    def a(n, dtype=np.float32, rank=4):
        return np.zeros((1, 2, n, 8)[4 - rank:], dtype)

    assert key(a(5), a(7)) == key(a(9), a(11))
    assert key(a(5), a(7)) != key(a(9), a(9))
    assert key(a(6), a(6)) == key(a(12), a(12))
    assert key(a(5), a(1)) != key(a(5), a(2))  # a length of 1 stays
    assert key(a(5), a(7, rank=3)) != key(a(5), a(9, rank=3))  # rank 3 where 4 is marked: its dims stay
    assert key(a(5), a(7, np.float16)) != key(a(5), a(7))
    assert key(a(5), a(7, np.float16), dtypes=False) == key(a(5), a(7), dtypes=False)
    assert key(a(5), a(7)) != _cpu.signature_key([a(5), a(7)], (4, 0b10, 4, 0b10), (0, 1), True)  # -1 for all


@pytest.mark.parametrize("return_mask_grad", [False, True])
def test_backward_of_a_class_with_modifiers_at_new_lengths(return_mask_grad, rng):
    """Backward calls of one class at new lengths (sinks with their gradient, a softcap, ALiBi, a window,
    GQA), each against the float64 reference: gradients as new arrays run through the class's plan; the
    results keep their order (dq, dk, dv, then the mask's gradient where asked, then d(sinks))."""
    functional_backward._plans.clear()
    functional_backward._by_length_free.clear()
    sinks = rng.standard_normal(4).astype(np.float32)
    slopes = rng.random(4).astype(np.float32)
    mods = dict(softcap=20.0, alibi_slopes=slopes, sinks=sinks, window=(5, 0), enable_gqa=True)
    for n in (7, 12, 19):
        q = random_array((1, 4, n, 16), "f32", rng)
        k, v = (random_array((1, 2, n, 16), "f32", rng) for _ in range(2))
        out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **mods)
        do = random_array(out.shape, "f32", rng)
        got = ga.scaled_dot_product_attention_backward(do, q, k, v, out, stats, return_sinks_grad=True,
                                                       return_mask_grad=return_mask_grad, **mods)
        want = sdpa_reference_backward(do, q, k, v, **mods)
        assert len(got) == (5 if return_mask_grad else 4)
        if return_mask_grad:
            assert got[3] is None  # no mask: no mask gradient
        for name, g, w in zip(("dq", "dk", "dv"), got[:3], want[:3]):
            assert_grad_close(g, w, "f32", f"{name} at length {n}")
        assert_grad_close(got[-1], want[-1], "f32", f"dsinks at length {n}")
    assert len(functional_backward._plans) == 1  # planned once, at the first length


def test_a_key_naming_more_lengths_than_it_holds_is_none():
    """A length-free key names at most 16 distinct lengths; a call with more keys on a tuple instead."""
    arrays = [np.zeros((1, 2 + i, 4), np.float32) for i in range(17)]
    axes = (3, 0b10) * 17
    ids = tuple(range(17))
    assert _cpu.signature_key(arrays[:16], axes[:32], ids[:16], True, name_lengths=True) is not None
    assert _cpu.signature_key(arrays, axes, ids, True, name_lengths=True) is None


# Operands whose layout a fresh call lowers apart from a dense one's (copies, no fold of their batch dims): a
# replay made from a dense call of the same shapes and dtypes must not take them, whatever came before.
def _layout_of(kind: str, a: np.ndarray) -> np.ndarray:
    if kind == "broadcast":  # stride 0 over the batch dim
        return np.broadcast_to(a[:1], a.shape)
    if kind == "reversed":  # negative row stride
        return np.ascontiguousarray(a[..., ::-1, :])[..., ::-1, :]
    return a


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("operands", ["kv", "q", "qkv"])
@pytest.mark.parametrize("kind", ["broadcast", "reversed"])
@pytest.mark.parametrize("history", ["fresh", "dense_first", "dense_other_length_first"])
def test_replay_takes_what_a_fresh_call_takes_whatever_came_before(history, kind, operands, dtype):
    """Forward and backward of stride-0 or reversed Q, K, V against the float64 reference, in a fresh process
    state and after dense calls of the same signature (at the same or another length), which leave a plan of
    that signature to replay."""
    rng = np.random.default_rng(5)
    _fresh_caches()
    functional_backward._plans.clear()
    functional_backward._by_length_free.clear()
    shape = (3, 2, 20, 16)
    if history != "fresh":
        length = 20 if history == "dense_first" else 13
        q, k, v = (random_array((3, 2, length, 16), dtype, rng) for _ in range(3))
        out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
        ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats)
    q, k, v = (random_array(shape, dtype, rng) for _ in range(3))
    q, k, v = (_layout_of(kind, a) if name in operands else a for name, a in zip("qkv", (q, k, v)))
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    want, want_stats = sdpa_reference(q, k, v, return_stats=True)
    assert_close(out, want, dtype, f"output {history} {kind} {operands}")
    assert_close(stats, want_stats, "f32", "stats", STATS_TOLERANCE)
    grad_out = random_array(out.shape, dtype, rng)
    grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats)
    want_grads = sdpa_reference_backward(grad_out, q, k, v)
    magnitude = max(float(np.abs(g).max()) for g in want_grads[:3])
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
        assert got.shape == expected.shape, name
        assert_grad_close(got, expected, dtype, f"{name} {history} {kind} {operands}", magnitude)


@pytest.mark.parametrize("history", ["fresh", "dense_first"])
def test_torch_expanded_key_value_backward_after_a_dense_one(history):
    """out.sum().backward() with K/V expanded over the batch (torch's stride 0), after a dense call or not: the
    gradients reach the unexpanded leaves, summed over the expanded dim."""
    torch = pytest.importorskip("torch")
    _fresh_caches()
    functional_backward._plans.clear()
    functional_backward._by_length_free.clear()
    torch.manual_seed(0)
    if history == "dense_first":
        q, k, v = (torch.randn(3, 2, 20, 16, requires_grad=True) for _ in range(3))
        ga.scaled_dot_product_attention(q, k, v).sum().backward()
    q = torch.randn(3, 2, 20, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(2))
    ga.scaled_dot_product_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q64, k64.expand(3, -1, -1, -1),
                                                     v64.expand(3, -1, -1, -1)).sum().backward()
    for name, got, want in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert_grad_close(got.numpy(), want.numpy(), "f32", f"{name} {history}")
