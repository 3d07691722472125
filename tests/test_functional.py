"""ga.scaled_dot_product_attention against a float64 reference, and its argument checks."""

import json

import ml_dtypes
import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import STATS_TOLERANCE, assert_close, random_array, sdpa_reference

from cpu_helpers import bf16_pairs_expected
from subprocess_helpers import run_python, run_python_logged

pytestmark = pytest.mark.cpu

DTYPES = ["f32", "bf16", "f16"]

CASES = {
    "4d": dict(q=(2, 3, 17, 32), k=(2, 3, 29, 32), v=(2, 3, 29, 24)),
    "3d": dict(q=(4, 9, 16), k=(4, 9, 16), v=(4, 9, 16)),
    "5d_broadcast": dict(q=(2, 3, 4, 5, 16), k=(1, 3, 1, 7, 16), v=(2, 1, 4, 7, 8)),
    "gqa": dict(q=(2, 8, 11, 32), k=(2, 2, 19, 32), v=(2, 2, 19, 32), enable_gqa=True),
    "mqa": dict(q=(1, 4, 6, 64), k=(1, 1, 6, 64), v=(1, 1, 6, 64), enable_gqa=True),
    "causal": dict(q=(1, 2, 33, 32), k=(1, 2, 33, 32), v=(1, 2, 33, 32), is_causal=True),
    "causal_bottom_right": dict(q=(1, 2, 9, 32), k=(1, 2, 40, 32), v=(1, 2, 40, 32), is_causal=True,
                                causal_alignment="bottom_right"),
    "causal_gqa_sq_gt_skv": dict(q=(1, 4, 30, 16), k=(1, 2, 12, 16), v=(1, 2, 12, 16), is_causal=True,
                                 causal_alignment="bottom_right", enable_gqa=True),
    "decode": dict(q=(1, 8, 1, 128), k=(1, 2, 300, 128), v=(1, 2, 300, 128), enable_gqa=True),
    # Decode with 7 heads per K/V head (row blocks of 4 and 3), a padded V head dim, keys past whole blocks.
    "decode_mqa_odd": dict(q=(1, 7, 1, 80), k=(1, 1, 150, 80), v=(1, 1, 150, 40), enable_gqa=True),
    # Decode with a head dim of 72 (not whole vectors): K and V rows are copied into padded f32 rows.
    "decode_padded_rows": dict(q=(1, 4, 1, 72), k=(1, 2, 100, 72), v=(1, 2, 100, 72), enable_gqa=True),
    "decode_causal_rows": dict(q=(1, 6, 2, 64), k=(1, 2, 77, 64), v=(1, 2, 77, 64), enable_gqa=True,
                               is_causal=True, causal_alignment="bottom_right"),
    # 68 query rows per K/V head (GQA, 4 x 17): the vector build's three 32-row blocks, the last partial.
    # One item of query rows and 800 keys: two key splits (a lone item's rule), on the vector build and on tiles.
    "lone_item_two_splits": dict(q=(1, 1, 40, 64), k=(1, 1, 800, 64), v=(1, 1, 800, 48)),
    "gqa_rows_68": dict(q=(1, 8, 17, 64), k=(1, 2, 150, 64), v=(1, 2, 150, 64), enable_gqa=True),
    "d80_d256": dict(q=(1, 1, 20, 80), k=(1, 1, 20, 80), v=(1, 1, 20, 256)),
    # 17 to 32 query rows per K/V head: the lane kernel's two-vector blocks; three query heads in one block.
    "short_rows_gqa_causal": dict(q=(2, 6, 9, 48), k=(2, 2, 25, 48), v=(2, 2, 25, 40), enable_gqa=True,
                                  is_causal=True, causal_alignment="bottom_right"),
    "short_rows_long_keys": dict(q=(1, 2, 30, 64), k=(1, 2, 1400, 64), v=(1, 2, 1400, 64)),
    # The row layout (keys as lanes) on AVX-512: 12 rows score against a packed K^T (bf16 with AVX512-BF16
    # takes row-key partials below 16 rows), causal, with a partial last key block; 16 rows, K^T for every dtype.
    # (bf16 from 6 rows on runs on AMX tiles where it can; test_bf16_row_layout_on_the_vector_build below.)
    "row_layout_packed_keys": dict(q=(1, 3, 12, 80), k=(1, 3, 150, 80), v=(1, 3, 150, 40), is_causal=True,
                                   causal_alignment="bottom_right"),
    "row_layout_16_rows": dict(q=(1, 2, 16, 64), k=(1, 2, 90, 64), v=(1, 2, 90, 64)),
    # Items of 5 and 6 rows (GQA groups of 5 heads, one row each; 6 rows per head): the smallest against K^T
    # packed per key block on AVX-512.
    "row_layout_packed_keys_5_rows": dict(q=(1, 10, 1, 80), k=(1, 2, 200, 80), v=(1, 2, 200, 48), enable_gqa=True),
    "row_layout_packed_keys_6_rows": dict(q=(1, 2, 6, 64), k=(1, 2, 140, 64), v=(1, 2, 140, 64), is_causal=True),
    # 40 rows would fill 40 of 64 lanes: a row-layout block of three vectors, in register blocks of 6 rows.
    "row_layout_40_rows": dict(q=(2, 2, 40, 64), k=(2, 2, 130, 64), v=(2, 2, 130, 72)),
    # 7 query rows: bf16 takes AMX tiles (from 6 rows on), each tile mostly padding; GQA, causal, Dv < D.
    "tiles_short_query_gqa": dict(q=(1, 4, 7, 80), k=(1, 2, 150, 80), v=(1, 2, 150, 48), enable_gqa=True,
                                  is_causal=True, causal_alignment="bottom_right"),
    # One head of 64 rows would be one item, leaving the second thread idle: two items of 32 rows instead (the
    # vector build's 32-lane blocks, the AMX kernel's row-tile pairs for bf16 and f16).
    "short_blocks_for_idle_threads": dict(q=(1, 1, 64, 80), k=(1, 1, 150, 80), v=(1, 1, 150, 48), is_causal=True,
                                          causal_alignment="bottom_right"),
    # One K/V head's 12 row-layout rows (4 heads x 3) in two items of 6 on two threads: items cross heads.
    "row_items_for_idle_threads": dict(q=(1, 4, 3, 64), k=(1, 1, 200, 64), v=(1, 1, 200, 64), enable_gqa=True,
                                       is_causal=True, causal_alignment="bottom_right"),
    # 28 rows fill 28 of 32 lanes, but one lane item would leave the second thread idle: the row layout
    # instead, its rows in two items of 14.
    "row_layout_for_idle_threads": dict(q=(1, 1, 28, 64), k=(1, 1, 200, 64), v=(1, 1, 200, 40), is_causal=True,
                                        causal_alignment="bottom_right"),
    # 4 rows (too few to spread over items) against 600 keys: the row layout's shorter key splits, two of 384.
    "row_layout_short_key_splits": dict(q=(1, 1, 4, 64), k=(1, 1, 600, 64), v=(1, 1, 600, 64)),
    # Several full key and query blocks: the packed fast paths of the AMX and lane kernels.
    "long": dict(q=(1, 2, 130, 64), k=(1, 2, 200, 64), v=(1, 2, 200, 64)),
    "long_causal": dict(q=(1, 2, 150, 128), k=(1, 2, 150, 128), v=(1, 2, 150, 128), is_causal=True),
    "long_d80": dict(q=(1, 2, 70, 80), k=(1, 2, 150, 80), v=(1, 2, 150, 48)),
    # Enough query blocks per thread (on up to 4 threads) for the AMX kernel's 128-row items, one of them partial.
    "long_many_heads": dict(q=(2, 4, 200, 64), k=(2, 4, 260, 64), v=(2, 4, 260, 64)),
    # GQA through the AMX kernel: four query heads per K/V head, several query items each, a partial last key block.
    "long_gqa": dict(q=(1, 8, 300, 64), k=(1, 2, 290, 64), v=(1, 2, 290, 64), enable_gqa=True),
    "long_many_heads_causal": dict(q=(2, 4, 200, 64), k=(2, 4, 200, 64), v=(2, 4, 200, 64), is_causal=True),
    # Two key blocks of the AMX kernel, the second partial; the causal cut (offset 400) falls inside row-tile pairs.
    # Eight heads of 260 rows: enough items, and long enough ones, for f32 to take the AMX kernel on two threads.
    "long_causal_bottom_right": dict(q=(1, 8, 260, 64), k=(1, 8, 660, 64), v=(1, 8, 660, 64), is_causal=True,
                                     causal_alignment="bottom_right"),
    # The AMX kernel's largest items (512 rows, on up to 2 threads), each followed by a partial one; causal.
    "long_causal_large_items": dict(q=(1, 8, 520, 64), k=(1, 8, 520, 64), v=(1, 8, 520, 64), is_causal=True),
    # Offset -30: the first rows see no key (output 0); D=80 and Dv=48 pack with masked edge loads.
    "long_causal_sq_gt_skv_d80": dict(q=(1, 16, 300, 80), k=(1, 16, 270, 80), v=(1, 16, 270, 48), is_causal=True,
                                      causal_alignment="bottom_right"),
    # One work item of the AMX kernel (bf16 and f16; f32 takes the vector build's split keys): its keys split
    # across threads and merged; D=256.
    "long_keys_one_item_d256": dict(q=(1, 1, 64, 256), k=(1, 1, 1500, 256), v=(1, 1, 1500, 256)),
    # f16 on two threads: two 256-row AMX items (the second partial) with their keys split in three
    # (plan_items' split_keys_first); the last key block partial.
    "large_items_split_keys": dict(q=(1, 1, 300, 64), k=(1, 1, 2100, 64), v=(1, 1, 2100, 64)),
    # The same for f32 from D = 96 on: two 512-row AMX items (the second of 8 rows) in four key splits each.
    "f32_large_items_split_keys": dict(q=(1, 1, 520, 96), k=(1, 1, 2100, 96), v=(1, 1, 2100, 80)),
    # Two threads: eight 512-row AMX items, the last wave (two items) in 128-row pieces; the last item holds
    # 88 rows, so one of its pieces is partial and three are empty.
    # Top-left causal with many more keys than query rows: only the first 20 keys are visible, and key
    # splits are planned over those (none), not over all 3000.
    "causal_few_visible_keys": dict(q=(1, 1, 20, 32), k=(1, 1, 3000, 32), v=(1, 1, 3000, 32), is_causal=True),
    "last_wave_pieces": dict(q=(1, 4, 600, 64), k=(1, 4, 300, 64), v=(1, 4, 300, 64)),
}

MASK_SHAPES = [(17, 29), (1, 29), (17, 1), (2, 1, 17, 29), (1, 3, 1, 29), (2, 3, 17, 29), (3, 17, 29)]


def run_case(case, dtype, rng, mask=None, return_stats=False, scale=None):
    args = dict(case)
    arrays = [random_array(args.pop(name), dtype, rng) for name in ("q", "k", "v")]
    got = ga.scaled_dot_product_attention(*arrays, attn_mask=mask, return_stats=return_stats, scale=scale, **args)
    want = sdpa_reference(*arrays, attn_mask=mask, return_stats=return_stats, scale=scale, **args)
    if return_stats:
        assert got[0].dtype == arrays[0].dtype and got[1].dtype == np.float32
        assert_close(got[0], want[0], dtype)
        assert_close(got[1], want[1], "f32", "stats", STATS_TOLERANCE)
    else:
        assert got.dtype == arrays[0].dtype
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, dtype, rng):
    run_case(CASES[case], dtype, rng, return_stats=case in ("causal", "gqa", "decode", "decode_mqa_odd"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_non_positive_scale_matches_reference(scale, dtype, rng):
    """A negative or zero scale reverses or flattens the scores: the kernels' max and scale folding must hold."""
    run_case(CASES["long_many_heads"], dtype, rng, return_stats=True, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_shapes(kind, mask_shape, dtype, rng):
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.6
    else:
        mask = random_array(mask_shape, dtype, rng)
    run_case(CASES["4d"], dtype, rng, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_at_tile_lengths(kind, dtype, rng):
    """Masks on calls long enough for the AMX kernels (f32 included, with eight heads on two threads), with
    rows 3 and 70 fully masked."""
    shape = (1, 8, 100, 400)
    mask = rng.random(shape) < 0.7 if kind == "bool" else random_array(shape, dtype, rng)
    if kind == "bool":
        mask[:, :, [3, 70]] = False
    else:
        mask[:, :, [3, 70]] = -np.inf
    case = dict(q=(1, 8, 100, 64), k=(1, 8, 400, 64), v=(1, 8, 400, 64))
    run_case(case, dtype, rng, mask=mask)


def test_gqa_with_per_head_mask(rng):
    mask = rng.random((8, 11, 19)) < 0.5
    run_case(CASES["gqa"], "f32", rng, mask=mask)


def test_strided_views_and_scale(rng):
    base = random_array((2, 13, 4, 32), "f32", rng)  # (N, S, H, D) storage
    q = k = v = base.transpose(0, 2, 1, 3)
    out = ga.scaled_dot_product_attention(q, k[:, :, ::2], v[:, :, ::2], scale=0.3)
    assert_close(out, sdpa_reference(q, k[:, :, ::2], v[:, :, ::2], scale=0.3), "f32")


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_long_views(dtype, head_dim, rng):
    """Long sequences through views with a row stride (BSHD storage) and a column stride of 2: the
    packed fast paths' row strides and the kernels' general path for other layouts (eight heads of 260:
    long enough for f32 to take the AMX kernel too, on two threads; D = 80 leaves part of a tile)."""
    base = random_array((1, 260, 8, 2, head_dim), dtype, rng)  # (N, S, H, 2, D) storage
    bshd = base[:, :, :, 0].transpose(0, 2, 1, 3)
    every_other = base.transpose(0, 2, 1, 3, 4).reshape(1, 8, 260, 2 * head_dim)[..., ::2]
    for k, v in ((bshd, bshd), (every_other, bshd), (bshd, every_other)):
        out = ga.scaled_dot_product_attention(bshd, k, v)
        assert_close(out, sdpa_reference(bshd, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_infinite_inputs_match_reference(where, dtype, rng):
    """An infinity in Q, K or V gives the reference's infinities and NaNs: the f16 and f32 split products on
    AMX cannot (part * inf is NaN), so such calls run on the vector build (eight heads of 300: long enough
    for f32 to take the AMX kernel first, on two threads)."""
    q, k, v = (random_array((1, 8, 300, 64), dtype, rng) for _ in range(3))
    arrays = {"query": q, "key": k, "value": v}
    arrays[where][0, 1, 7, 3] = np.inf
    arrays[where][0, 0, 130, 5] = -np.inf
    assert_close(ga.scaled_dot_product_attention(q, k, v), sdpa_reference(q, k, v), dtype)


F32_ERROR_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.testing import random_array, sdpa_reference
rng = np.random.default_rng(5)
for sq, skv, d, scale in ((256, 600, 64, 1.0), (300, 700, 80, 3.0), (260, 1100, 128, 2.0), (270, 300, 256, 1.0)):
    q, k = (random_array((1, 8, s, d), "f32", rng, scale) for s in (sq, skv))
    v = random_array((1, 8, skv, d), "f32", rng)
    err = np.abs(ga.scaled_dot_product_attention(q, k, v) - sdpa_reference(q, k, v)).max()
    print(ga.forward_isa("f32", sq, skv, batch=8), err)
"""


def test_f32_on_split_tiles_is_as_accurate_as_f32_arithmetic():
    """f32 calls on AMX run as six bf16 tile products per product (three bf16 parts per value): their
    error against the float64 reference stays within twice the vector build's f32 error, shape by shape
    (two parts measured ten to forty times it)."""
    if ga.forward_isa("f32") != "amx_bf16x6":
        pytest.skip("f32 runs on the vector build here")
    runs = {}
    for kernel in ("amx_bf16x6", "avx512"):
        out = run_python(F32_ERROR_SCRIPT, kernel, OMP_NUM_THREADS="2")  # 8 heads fill 2 threads' items
        runs[kernel] = [line.split() for line in out.splitlines()]
    assert {name for name, _ in runs["amx_bf16x6"]} == {"amx_bf16x6"}
    assert {name for name, _ in runs["avx512"]} == {"avx512"}
    for (_, split_error), (_, vector_error) in zip(runs["amx_bf16x6"], runs["avx512"]):
        assert float(split_error) <= 2 * float(vector_error) + 1e-7


CLIMBING_SCORES_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.testing import STATS_TOLERANCE, assert_close, random_array, sdpa_reference
rng = np.random.default_rng(3)
keys = np.arange(700)
profiles = {"climb": keys * 0.8, "sawtooth": (keys % 128) * 2.0, "descend": keys * -0.8}
for name, profile in profiles.items():
    q, k, v = (random_array((1, 2, s, 64), "f32", rng, 0.1) for s in (130, 700, 700))
    q[..., 0] = 1.0
    k[..., 0] += profile  # scores follow the profile: 4-46 log2 units per key block
    got = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    want = sdpa_reference(q, k, v, return_stats=True)
    assert_close(got[0], want[0], "f32", name)
    assert_close(got[1], want[1], "f32", name + " stats", STATS_TOLERANCE)
print(ga.forward_isa("f32", 130, 700, batch=2))
"""


def test_scores_climbing_past_the_running_max():
    """The vector builds fuse the softmax into the score product's register tiles (tile_softmax.hpp), with
    a running max raised only where a score climbs more than 2^8 past it: scores that climb across key
    blocks and within them (raises with earlier tiles rescaled), or only fall, match the reference."""
    features = set(ga.cpu_features())
    builds = (("portable", set()), ("avx2", {"avx2", "fma", "f16c"}), ("avx512", {"avx512f", "avx512bw"}))
    for isa, needs in builds:
        if needs <= features:
            assert run_python(CLIMBING_SCORES_SCRIPT, isa).strip() == isa


BF16_ROW_LAYOUT_CASES = ("gqa", "mqa", "row_layout_packed_keys", "row_layout_16_rows", "tiles_short_query_gqa")


def test_bf16_row_layout_on_the_vector_build():
    """Where AMX tiles take bf16 calls from 6 query rows on, the vector build's bf16 row layout (AVX512-BF16
    row-key partials, K^T from 16 rows) still runs for the calls that stay below: checked here on those
    cases with the choice capped at the vector build (on CPUs without AMX the CASES above run it too)."""
    cases = {name: CASES[name] for name in BF16_ROW_LAYOUT_CASES}
    script = (
        "import numpy as np, graphattn as ga\n"
        "from graphattn.testing import assert_close, random_array, sdpa_reference\n"
        "rng = np.random.default_rng(3)\n"
        f"for name, case in {cases!r}.items():\n"
        "    args = dict(case)\n"
        "    arrays = [random_array(args.pop(n), 'bf16', rng) for n in ('q', 'k', 'v')]\n"
        "    got = ga.scaled_dot_product_attention(*arrays, **args)\n"
        "    assert_close(got, sdpa_reference(*arrays, **args), 'bf16', name)\n"
        "print(ga.forward_isa('bf16', 12), ga.forward_isa('bf16', 1))\n")
    twelve_rows, one_row = run_python(script, "avx512").split()
    assert twelve_rows == one_row and not twelve_rows.startswith("amx")  # the vector build, as decode


def pair_products_script(seed: int, cases: str) -> str:
    """A child script that runs bf16 `cases` (a dict literal: name -> (q, k, v shapes, keyword arguments, how K
    and V are laid out, whether pairs are due)) against the reference and prints each name and flag as JSON;
    the verbose log on stderr names each call's layout."""
    return f"""
import json
import numpy as np, graphattn as ga
from graphattn.testing import assert_close, random_array, sdpa_reference
rng = np.random.default_rng({seed})
ga.set_verbose(True)
cases = {cases}
for name, (qs, ks, vs, kwargs, layout, pairs) in cases.items():
    q, k, v = (random_array(s, "bf16", rng) for s in (qs, ks, vs))
    if layout == "transposed":  # same values, column strides of a whole sequence
        k, v = (np.ascontiguousarray(np.swapaxes(x, -1, -2)).swapaxes(-1, -2) for x in (k, v))
    if kwargs.get("attn_mask") == "empty_rows":
        mask = rng.random((qs[-2], ks[-2])) < 0.7
        mask[5] = False  # a row that sees no key: zeros
        kwargs = dict(kwargs, attn_mask=mask)
    got = ga.scaled_dot_product_attention(q, k, v, **kwargs)
    assert_close(got, sdpa_reference(q, k, v, **kwargs), "bf16", name)
    if "attn_mask" in kwargs:
        assert np.all(got[..., 5, :].astype(np.float32) == 0)
    print(json.dumps([name, pairs]), flush=True)
"""


def run_pair_products(seed: int, cases: str) -> tuple[list[bool], list[str]]:
    """Runs pair_products_script on the vector build, two threads (on more, the row layout takes the shorter
    calls, as its items fill the threads); returns the cases' flags and the layouts the log names."""
    out, log = run_python_logged(pair_products_script(seed, cases), "avx512", OMP_NUM_THREADS="2")
    flags = [json.loads(line)[1] for line in out.splitlines() if line.startswith("[")]
    layouts = [line.split(",layout=")[1].split(",")[0] for line in log.splitlines() if ",compile," in line]
    return flags, layouts


LANE_PAIR_CASES = """{
    # odd head dim: Q and K packed into pairs, the last paired with zero; odd key count, a partial last pair
    "odd_head_dim": ((1, 2, 70, 17), (1, 2, 33, 17), (1, 2, 33, 17), {}, "rows", True),
    "d80_dv_40_causal": ((2, 2, 130, 80), (2, 2, 131, 80), (2, 2, 131, 40), dict(is_causal=True), "rows", True),
    "d256_gqa_bottom_right": ((1, 4, 40, 256), (1, 2, 300, 256), (1, 2, 300, 256),
                              dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right"), "rows", True),
    # K and V read through column strides (transposed views): K copied into pairs, V packed from its columns
    "strided_k_v": ((1, 3, 64, 64), (1, 3, 129, 64), (1, 3, 129, 48), dict(scale=0.3), "transposed", True),
    # Three query blocks per head reuse the head's packed V, its last key block odd.
    "strided_v_reused": ((2, 2, 150, 32), (2, 2, 301, 32), (2, 2, 301, 24), {}, "transposed", True),
    "one_key": ((1, 2, 100, 32), (1, 2, 1, 32), (1, 2, 1, 32), {}, "rows", True),
    "mask_with_empty_rows": ((1, 2, 64, 48), (1, 2, 200, 48), (1, 2, 200, 48), dict(attn_mask="empty_rows"), "rows",
                             True),
}"""


def test_bf16_pair_products_on_the_vector_build():
    """bf16 query blocks on the vector build take both products on bf16 pairs (VDPBF16PS; lane_gemm_bf16.hpp)
    where those pay off, else f32 FMAs: checked on odd head dims, odd key counts, strided K and V, a single
    key, GQA, causal and a mask with an empty row, with the choice capped at the vector build (AMX would take
    these calls); the verbose log names the layout each call took."""
    flags, layouts = run_pair_products(9, LANE_PAIR_CASES)
    assert len(flags) == 7
    assert layouts == ["lanes_bf16_pairs" if bf16_pairs_expected() else "lanes"] * 7, layouts


ROW_PAIR_CASES = """{
    "rows_12_d80": ((2, 3, 12, 80), (2, 3, 300, 80), (2, 3, 300, 80), {}, "rows", True),
    # GQA: four heads of 5 rows in one item; an odd key count, bottom-right causal
    "gqa_causal_odd_keys": ((1, 8, 5, 64), (1, 2, 301, 64), (1, 2, 301, 64),
                            dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right"), "rows", True),
    "dv_32_mask_with_empty_row": ((1, 2, 9, 48), (1, 2, 77, 48), (1, 2, 77, 32), dict(attn_mask="empty_rows"),
                                  "rows", True),
    "dropout": ((1, 2, 12, 64), (1, 2, 130, 64), (1, 2, 130, 64), dict(dropout_p=0.3, dropout_seed=5), "rows", True),
    # decode's few rows keep the row-key partials; strided K and an odd head dim keep the f32 products
    "decode_gqa": ((1, 8, 1, 128), (1, 2, 500, 128), (1, 2, 500, 128), dict(enable_gqa=True), "rows", False),
    "strided_k_v": ((1, 2, 12, 64), (1, 2, 130, 64), (1, 2, 130, 64), {}, "transposed", False),
    "odd_head_dim": ((1, 2, 12, 17), (1, 2, 40, 17), (1, 2, 40, 17), {}, "rows", False),
}"""


def test_bf16_pair_products_in_the_row_layout():
    """Query blocks of 5 rows and more in the row layout take both products on bf16 pairs where those pay off
    (K^T's pairs packed per key block, P rounded to bf16, V's pairs along the keys): checked on odd key counts,
    GQA under a bottom-right causal mask, a mask with an empty row and dropout; decode's few rows, strided K and
    an odd head dim keep their f32 products.  The verbose log names the layout each call took."""
    flags, layouts = run_pair_products(11, ROW_PAIR_CASES)
    assert len(flags) == 7
    assert layouts == ["rows_bf16_pairs" if pairs and bf16_pairs_expected() else "rows" for pairs in flags], layouts


OVERSUBSCRIBED_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.testing import assert_close, random_array, sdpa_reference
rng = np.random.default_rng(11)
cases = {  # name: (q shape, k/v shape, dtype, gqa)
    "lane_blocks": ((2, 5, 70, 48), (2, 5, 90, 48), "f32", False),
    "row_layout_split_keys": ((1, 6, 1, 64), (1, 3, 2000, 64), "f32", True),
    "row_layout_gqa": ((1, 8, 5, 80), (1, 2, 300, 80), "f16", True),
    "tiles": ((2, 3, 40, 64), (2, 3, 300, 64), "bf16", False),
}
for name, (qs, ks, dtype, gqa) in cases.items():
    q, k, v = (random_array(s, dtype, rng) for s in (qs, ks, ks))
    first = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert_close(first, sdpa_reference(q, k, v, enable_gqa=gqa), dtype, name)
    for _ in range(5):  # whichever thread runs a unit, it computes the same rows
        assert np.array_equal(ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), first), name
print("ok")
"""


def test_threads_taking_each_others_units():
    """The forward hands each thread its own units first and lets threads out of work take the others' from
    the back: on 7 threads of a 2-core machine most threads wait descheduled while others take their units.
    Every row is computed (checked against the reference) and comes out the same whichever thread runs it."""
    assert run_python(OVERSUBSCRIBED_SCRIPT, OMP_NUM_THREADS="7").strip() == "ok"


def test_scalar_zero_mask_means_none(rng):
    q = random_array((1, 2, 5, 16), "f32", rng)
    assert np.array_equal(ga.scaled_dot_product_attention(q, q, q, attn_mask=np.float32(0.0)),
                          ga.scaled_dot_product_attention(q, q, q))


def test_fully_masked_row_is_zero_and_nan_row_is_nan(rng):
    q = random_array((1, 1, 4, 16), "f32", rng)
    mask = np.ones((4, 4), bool)
    mask[2] = False
    out = ga.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert np.all(out[0, 0, 2] == 0) and np.all(np.isfinite(out))
    q_nan = q.copy()
    q_nan[0, 0, 1, 3] = np.nan
    out = ga.scaled_dot_product_attention(q_nan, q, q)
    assert np.all(np.isnan(out[0, 0, 1])) and np.all(np.isfinite(np.delete(out[0, 0], 1, axis=0)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowest_float_mask_keeps_its_meaning(dtype, rng):
    """A row masked with finfo.min (not -inf) averages V uniformly, as the reference does."""
    q, k, v = (random_array((1, 2, 40, 32), dtype, rng) for _ in range(3))
    mask = np.zeros((40, 40), np.float32)
    mask[:, 5:] = np.finfo(np.float32).min  # most keys masked this way
    mask[7] = np.finfo(np.float32).min  # and row 7 entirely
    got = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask.astype(q.dtype) if dtype == "f32" else mask)
    want = sdpa_reference(q, k, v, attn_mask=mask)
    assert_close(got, want, dtype)
    assert_close(got[:, :, 7], v.astype(np.float64).mean(axis=2), dtype)


def test_repeated_calls_reuse_the_compiled_partition(rng):
    from graphattn import forward_call

    q = random_array((1, 2, 8, 16), "f32", rng)
    ga.scaled_dot_product_attention(q, q, q, is_causal=True)
    size = len(forward_call._cache)
    for _ in range(3):
        ga.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert len(forward_call._cache) == size


def test_signature_cache_keeps_the_entries_used_since_it_was_half_full():
    """Of its _CACHE_SIZE entries the cache evicts the least recently used, a hit counting as a use once the
    cache is half full: an entry hit then outlives the entries put before it."""
    from graphattn.plan_cache import CACHE_SIZE as _CACHE_SIZE, SignatureCache

    cache = SignatureCache()
    for key in range(_CACHE_SIZE):
        cache.put(key, str(key))
    assert cache.get(3) == "3"  # full: this hit makes 3 the most recent
    for key in range(_CACHE_SIZE, _CACHE_SIZE + _CACHE_SIZE // 2):
        cache.put(key, str(key))
    assert len(cache) == _CACHE_SIZE
    assert cache.get(3) == "3" and cache.get(2) is None and cache.get(_CACHE_SIZE // 2 + 1) == str(_CACHE_SIZE // 2 + 1)


def test_signature_cache_keeps_replayed_entries_apart():
    """Entries re-made for new lengths go to a tier of their own: more of them than it holds evict only the
    oldest of them, never an entry made in full, and both tiers answer get."""
    from graphattn.plan_cache import CACHE_SIZE, REPLAYED_CACHE_SIZE, SignatureCache

    cache = SignatureCache()
    for key in range(CACHE_SIZE):
        cache.put(key, str(key))
    for key in range(-1, -1 - 3 * REPLAYED_CACHE_SIZE, -1):
        cache.put(key, str(key), replayed=True)
    assert len(cache) == CACHE_SIZE and cache.replayed_count() == REPLAYED_CACHE_SIZE
    assert all(cache.get(key) == str(key) for key in range(CACHE_SIZE))
    newest = range(-3 * REPLAYED_CACHE_SIZE, -2 * REPLAYED_CACHE_SIZE)
    assert all(cache.get(key) == str(key) for key in newest)
    assert cache.get(-1) is None and cache.get(-2 * REPLAYED_CACHE_SIZE) is None
    cache.clear()
    assert len(cache) == 0 and cache.replayed_count() == 0 and cache.get(0) is None


@pytest.mark.parametrize("kwargs", [
    dict(is_causal=True, causal_alignment="bottom_right", return_stats=True),
    dict(attn_mask="bool", dropout_p=0.3, dropout_seed=-5, dropout_offset=7),
    dict(attn_mask="float", scale=0.3),
])
def test_direct_kernel_call_matches_the_partition_execute(kwargs, capsys, rng):
    """Repeated calls go straight to the kernel (CompiledPartition.bound_runner); with verbose output on they
    run through the compiled partition's execute, which logs them.  Both give bitwise the same results."""
    q, k, v = (random_array(s, "f32", rng) for s in ((2, 3, 9, 32), (2, 3, 14, 32), (2, 3, 14, 32)))
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask = rng.random((9, 14)) < 0.7 if mask == "bool" else random_array((3, 9, 14), "f32", rng)
        kwargs = dict(kwargs, attn_mask=mask)
    direct = ga.scaled_dot_product_attention(q, k, v, **kwargs)
    ga.set_verbose(1)
    try:
        logged = ga.scaled_dot_product_attention(q, k, v, **kwargs)
    finally:
        ga.set_verbose(0)
    assert "graphattn_verbose,exec" in capsys.readouterr().err
    for a, b in zip(direct if isinstance(direct, tuple) else (direct,), logged if isinstance(logged, tuple) else (logged,)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    (((2, 8), (2, 8), (2, 8)), {}, ValueError, r"query must have at least 3 dims"),
    (((1, 4, 16), (1, 4, 8), (1, 4, 8)), {}, ValueError, r"head dims differ"),
    (((1, 4, 16), (1, 5, 16), (1, 6, 16)), {}, ValueError, r"sequence lengths differ"),
    (((2, 4, 16), (3, 4, 16), (3, 4, 16)), {}, ValueError, r"not broadcastable"),
    (((1, 6, 4, 16), (1, 4, 4, 16), (1, 4, 4, 16)), {"enable_gqa": True}, ValueError, r"Hq=6, Hkv=4"),
    (((1, 6, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16)), {}, ValueError, r"need enable_gqa=True"),
    (((1, 4, 16), (1, 4, 16), (1, 4, 16)), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    (((1, 4, 16), (1, 4, 16), (1, 4, 16)), {"attn_mask": np.ones((5, 4), bool)}, ValueError, r"attn_mask of shape"),
    (((1, 4, 16), (1, 4, 16), (1, 4, 16)), {"is_causal": True, "causal_alignment": "middle"}, ValueError,
     r"causal_alignment"),
    (((1, 4, 16), (1, 4, 16), (1, 4, 16)), {"is_causal": True, "attn_mask": np.ones((4, 4), bool)}, ValueError,
     r"not both"),
    (((1, 4, 16), (1, 4, 16), (1, 4, 16)), {"dropout_p": 0.5, "dropout_seed": 1 << 63}, ValueError,
     r"dropout_seed must fit in a signed 64-bit integer"),
])
def test_bad_arguments(args, kwargs, exc, match, rng):
    arrays = [random_array(s, "f32", rng) for s in args]
    with pytest.raises(exc, match=match):
        ga.scaled_dot_product_attention(*arrays, **kwargs)


def test_mixed_dtypes_rejected(rng):
    q = random_array((1, 4, 16), "f32", rng)
    with pytest.raises(TypeError, match="share one dtype"):
        ga.scaled_dot_product_attention(q, q.astype(np.float16), q)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_in_torch_out(dtype, rng):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, 4, 33, 64, dtype=tdt) for _ in range(3))
    out = ga.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.shape == (1, 4, 33, 64)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert_close(out.float().numpy(), want.numpy(), {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype])


def test_torch_bf16_shares_memory():
    torch = pytest.importorskip("torch")
    from graphattn.interop import to_numpy

    t = torch.randn(2, 3, dtype=torch.bfloat16)
    array, kind = to_numpy(t, "query")
    assert kind == "torch" and array.dtype == ml_dtypes.bfloat16
    assert array.__array_interface__["data"][0] == t.data_ptr()


def test_torch_direct_path_views_grads_and_repeats(rng):
    """torch Q/K/V without a mask reach the kernel without NumPy views: strided views, tensors that require
    grad, GQA stats and repeated calls (the cached signature) must all match the reference."""
    torch = pytest.importorskip("torch")
    base = torch.randn(1, 16, 40, 64)
    q = base.transpose(1, 2)[:, :, :8, :]            # (1, 40, 8, 64) viewed as (N, L, H, E): strided
    q = q.transpose(1, 2)                             # (1, 8, 40, 64), non-contiguous
    k = torch.randn(1, 2, 50, 64, requires_grad=True)
    v = torch.randn(1, 2, 50, 64)[..., ::2]          # column stride 2, Ev = 32
    for _ in range(2):                                # the second call takes the cached signature
        out, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True)
        assert isinstance(out, torch.Tensor) and out.shape == (1, 8, 40, 32) and stats.shape == (1, 8, 40, 1)
        want, want_stats = sdpa_reference(q.numpy(), k.detach().numpy(), v.numpy(), enable_gqa=True,
                                          return_stats=True)
        assert out.requires_grad  # k requires grad: the result is differentiable (test_torch_autograd.py)
        assert_close(out.detach().numpy(), want, "f32")
        assert_close(stats.numpy(), want_stats, "f32", "stats", STATS_TOLERANCE)


@pytest.mark.parametrize("query_layout", ["contiguous", "transposed"])
def test_torch_output_is_a_new_contiguous_tensor(query_layout, rng):
    """The output comes as a new C-contiguous tensor whatever the query's layout (a contiguous query's output
    is made like it, a strided one's from its shape), requiring grad only where an operand does, and right on
    repeated calls."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 3, 24, 32, requires_grad=True)
    if query_layout == "transposed":
        q = torch.randn(1, 24, 3, 32).transpose(1, 2)  # the output's shape, strided
    k, v = torch.randn(1, 3, 40, 32), torch.randn(1, 3, 40, 32)
    for _ in range(2):
        out = ga.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.is_contiguous() and out.shape == q.shape and out.requires_grad == q.requires_grad
        assert out.data_ptr() != q.data_ptr()
        want = sdpa_reference(q.detach().numpy(), k.numpy(), v.numpy(), is_causal=True)
        assert_close(out.detach().numpy(), want, "f32")


def test_torch_tensor_off_the_cpu_is_refused():
    torch = pytest.importorskip("torch")
    x = torch.randn(1, 2, 4, 16)
    ga.scaled_dot_product_attention(x, x, x)          # caches this layout for CPU tensors
    meta = torch.empty(1, 2, 4, 16, device="meta")
    with pytest.raises(TypeError, match="query is a torch tensor on meta"):
        ga.scaled_dot_product_attention(meta, meta, meta)


def test_torch_zero_length_sequences():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 0, 16)
    k = torch.randn(1, 2, 5, 16)
    out = ga.scaled_dot_product_attention(q, k, k)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 2, 0, 16)
