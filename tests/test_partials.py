"""The native helpers the ring merges its partial results with (graphattn._cpu.merge_attention and
accumulate), against float64 NumPy: parts in f32, bf16 and f16, rows that saw no key, NaN, strided sums, and
arguments that name what is wrong."""
import numpy as np
import pytest

from graphattn import _cpu
from graphattn.dtypes import kernel_code
from graphattn.testing import random_array

DTYPES_UNDER_TEST = ["f32", "bf16", "f16"]


@pytest.mark.parametrize("dtype", DTYPES_UNDER_TEST)
def test_merge_weighs_parts_by_their_log_sum_exp(dtype):
    rng = np.random.default_rng(0)
    shape = (2, 3, 37, 19)  # odd rows and head size
    out = random_array(shape, "f32", rng)
    stats = rng.normal(size=shape[:-1] + (1,)).astype(np.float32) * 3
    part = random_array(shape, dtype, rng)
    part_stats = rng.normal(size=shape[:-1] + (1,)).astype(np.float32) * 3
    stats[0, 0, :5] = -np.inf  # rows of out that saw no key take the part
    part_stats[0, 1, :4] = -np.inf  # rows of the part that saw none leave out as it is
    o64, s64, p64, ps64 = (a.astype(np.float64) for a in (out, stats, part, part_stats))
    m = np.maximum(s64, ps64)
    w, wp = np.exp(s64 - m), np.exp(ps64 - m)
    with np.errstate(invalid="ignore"):
        want = (w * o64 + wp * p64) / (w + wp)
    want = np.where(np.isneginf(s64), p64, np.where(np.isneginf(ps64), o64, want))
    want_stats = np.where(np.isneginf(s64), ps64, np.where(np.isneginf(ps64), s64, m + np.log(w + wp)))
    _cpu.merge_attention(out, stats, part, part_stats, kernel_code(part.dtype))
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)  # the part is widened, never rounded again
    np.testing.assert_allclose(stats, want_stats, rtol=1e-6, atol=1e-6)


def test_merge_into_rows_of_longer_arrays():
    rng = np.random.default_rng(2)
    whole, whole_stats = random_array((2, 3, 40, 8), "f32", rng), rng.normal(size=(2, 3, 40, 1)).astype(np.float32)
    out, stats = whole[..., 11:30, :], whole_stats[..., 11:30, :]  # each head's rows 11..29: one run per head
    part, part_stats = random_array(out.shape, "bf16", rng), rng.normal(size=stats.shape).astype(np.float32)
    want, want_stats = whole.astype(np.float64), whole_stats.astype(np.float64)
    m = np.maximum(stats, part_stats).astype(np.float64)
    w, wp = np.exp(stats - m), np.exp(part_stats - m)
    want[..., 11:30, :] = (w * out + wp * part.astype(np.float64)) / (w + wp)
    want_stats[..., 11:30, :] = m + np.log(w + wp)
    _cpu.merge_attention(out, stats, part, part_stats, kernel_code(part.dtype))
    np.testing.assert_allclose(whole, want, rtol=2e-6, atol=2e-6)  # rows outside the view untouched
    np.testing.assert_allclose(whole_stats, want_stats, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        _cpu.merge_attention(whole[..., 11:30, ::2], stats, np.zeros((2, 3, 19, 4), np.float32), part_stats)


def test_merge_spreads_nan():
    out, stats = np.ones((1, 2, 4), np.float32), np.zeros((1, 2, 1), np.float32)
    part, part_stats = np.ones((1, 2, 4), np.float32), np.array([[[np.nan], [0.0]]], np.float32)
    _cpu.merge_attention(out, stats, part, part_stats)
    assert np.isnan(out[0, 0]).all() and np.isnan(stats[0, 0, 0])
    assert np.array_equal(out[0, 1], np.ones(4)) and stats[0, 1, 0] == pytest.approx(np.log(2.0))


@pytest.mark.parametrize("dtype", DTYPES_UNDER_TEST)
def test_accumulate_adds_parts_into_a_strided_f32_sum(dtype):
    rng = np.random.default_rng(1)
    whole = random_array((1, 3, 29, 17), "f32", rng)
    total = whole[..., 5:18, :]  # rows of each head: runs one head apart
    part = random_array(total.shape, dtype, rng)
    want = whole.astype(np.float64)
    want[..., 5:18, :] += part.astype(np.float64)
    _cpu.accumulate(total, part, kernel_code(part.dtype))
    np.testing.assert_allclose(whole, want, rtol=1e-6, atol=1e-6)  # rows outside the view untouched


def test_accumulate_takes_any_steady_stride():
    whole = np.zeros((4, 6, 5), np.float32)
    total = whole[::2, :, 1:4]  # columns of every other slab: runs of 3, 5 apart, then 60
    with pytest.raises(ValueError, match="one stride"):
        _cpu.accumulate(total, np.ones(total.shape, np.float32))
    rows = whole[:, 1:3, :]  # runs of 10 values, one slab (30) apart
    _cpu.accumulate(rows, np.ones(rows.shape, np.float32))
    assert whole[:, 1:3].sum() == 4 * 10 and whole.sum() == 4 * 10


def test_bad_parts_are_named():
    out, stats = np.zeros((2, 4), np.float32), np.zeros((2, 1), np.float32)
    with pytest.raises(ValueError, match="part_code"):
        _cpu.merge_attention(out, stats, np.zeros((2, 4), np.float32), stats.copy(), 3)
    with pytest.raises(ValueError, match="dtype part_code names"):
        _cpu.merge_attention(out, stats, np.zeros((2, 4), np.float16), stats.copy(), 0)
    with pytest.raises(ValueError, match="do not match"):
        _cpu.merge_attention(out, stats, np.zeros((2, 5), np.float32), stats.copy())
    with pytest.raises(ValueError, match="C-contiguous"):
        _cpu.accumulate(out, np.zeros((4, 2), np.float32).T)
    with pytest.raises(ValueError, match="differ in shape"):
        _cpu.accumulate(out, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="float32"):
        _cpu.accumulate(out.astype(np.float16), np.zeros((2, 4), np.float16), 2)
