"""Quantized K/V caches (graphattn.kv_quant): attention over stored bytes built by hand against "decode the
bytes to f32, then attend" in float64, on every format, group size and kernel candidate; the append's
quantize-on-write rules; nibble order; refusals; llama.cpp's q8_0/q4_0 blocks."""
import ml_dtypes
import numpy as np
import pytest

import graphattn as ga
from graphattn import kv_quant, testing
from graphattn.testing import assert_close, random_array, varlen_reference

from cpu_helpers import skip_unless_runs_here
from test_varlen import CANDIDATE_DTYPES, cu

INT_FORMATS = ("u8", "s8", "u4", "s4")
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
FP8_DTYPES = {"fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn), "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


def hand_decode(fmt: str, data: np.ndarray, scales: np.ndarray, zero_points, d: int) -> np.ndarray:
    """The f32 values of stored rows (..., bytes) by the format table of graphattn.kv_quant's docstring, column
    by column: written apart from the library's decoder so that each checks the other."""
    data = np.asarray(data).view(np.uint8)
    out = np.empty(data.shape[:-1] + (d,), np.float64)
    if fmt in FP8_FORMATS:
        values = data.view(FP8_DTYPES[fmt]).astype(np.float64)
        return values * np.asarray(scales, np.float64)  # a scale broadcast against the values
    groups = scales.shape[-1]
    g_size = d // groups
    for c in range(d):
        if fmt in ("u4", "s4"):
            byte = data[..., c // 2].astype(np.int64)
            q = byte & 15 if c % 2 == 0 else byte >> 4
            if fmt == "s4":
                q = np.where(q >= 8, q - 16, q)
        elif fmt == "u8":
            q = data[..., c].astype(np.int64)
        else:
            q = data[..., c].view(np.int8).astype(np.int64)
        g = c // g_size
        z = 0 if zero_points is None else np.asarray(zero_points)[..., g].astype(np.int64)
        out[..., c] = (q - z) * np.asarray(scales)[..., g].astype(np.float64)
    return out


def stored_tensor(rng, fmt: str, shape_rows: tuple, d: int, group: int, scale_dtype="f16", zero_points=True,
                  sequences=None):
    """(data, scales, zero_points) of random stored rows (..., D): random bytes (fp8: N(0, 1) values rounded to
    the format), scales near a unit that keeps the values about 1, zero points of the format's range."""
    if fmt in FP8_FORMATS:
        data = (rng.standard_normal(shape_rows + (d,)) * 2).astype(FP8_DTYPES[fmt])
        scales = np.asarray(rng.uniform(0.3, 0.6, sequences) if sequences else rng.uniform(0.3, 0.6), np.float32)
        return data, scales, None
    cols = d // 2 if fmt in ("u4", "s4") else d
    data = rng.integers(0, 256, shape_rows + (cols,), dtype=np.uint8)
    if fmt == "s8":
        data = data.view(np.int8)
    unit = 1 / 64 if fmt in ("u8", "s8") else 1 / 4
    groups = shape_rows + (d // group,)
    scales = (rng.uniform(0.5, 1.5, groups) * unit).astype(kv_quant.SCALE_DTYPES[scale_dtype])
    zps = None
    if zero_points:
        zp_type = kv_quant.FORMATS[fmt].zero_point_dtype
        lo, hi = {"u8": (0, 256), "u4": (0, 16), "s8": (-128, 128), "s4": (-8, 8)}[fmt]
        zps = rng.integers(lo, hi, groups).astype(zp_type)
    return data, scales, zps


def poisoned(scales: np.ndarray, table: np.ndarray, lengths, block_size: int) -> np.ndarray:
    """The scales NaN on every row no sequence holds, so that a read of one shows in the result."""
    held = np.zeros(scales.shape[:2], bool)
    for b, n in enumerate(lengths):
        for r in range(n):
            held[table[b, r // block_size], r % block_size] = True
    out = scales.copy()
    out[~held] = np.nan
    return out


def random_table(rng, lengths, block_size, spare=3):
    """A block table from a random permutation of a pool `spare` times the need; entries past a sequence's
    blocks -1."""
    max_blocks = max(1, max(-(-n // block_size) for n in lengths))
    pool = spare * len(lengths) * max_blocks
    order = rng.permutation(pool).astype(np.int32)
    table = np.full((len(lengths), max_blocks), -1, np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // block_size)
        table[b, :used] = order[b * max_blocks:b * max_blocks + used]
    return pool, table


def gathered_rows(values: np.ndarray, table, lengths, block_size):
    rows = [values[table[b, r // block_size], r % block_size] for b, n in enumerate(lengths) for r in range(n)]
    return np.stack(rows) if rows else np.zeros((0,) + values.shape[2:])


def run_and_check(rng, dtype, k_fmt, v_fmt, lengths, new, *, block_size=16, heads=4, kv_heads=2, d=64, dv=32,
                  k_group=None, v_group=None, scale_dtype="f16", zero_points=True, per_sequence_fp8=False,
                  **options):
    """A packed call of new[b] query rows over lengths[b] cached rows stored in k_fmt/v_fmt, against the
    float64 reference of the hand-decoded gathered rows."""
    pool, table = random_table(rng, lengths, block_size)
    seqs = len(lengths) if per_sequence_fp8 else None
    k_data, k_s, k_z = stored_tensor(rng, k_fmt, (pool, block_size, kv_heads), d, k_group or d, scale_dtype,
                                     zero_points, (seqs, kv_heads) if seqs else None)
    v_data, v_s, v_z = stored_tensor(rng, v_fmt, (pool, block_size, kv_heads), dv, v_group or dv, scale_dtype,
                                     zero_points, (seqs, kv_heads) if seqs else None)
    if k_fmt not in FP8_FORMATS:
        k_s = poisoned(k_s, table, lengths, block_size)
    if v_fmt not in FP8_FORMATS:
        v_s = poisoned(v_s, table, lengths, block_size)
    q = random_array((sum(new), heads, d), dtype, rng)
    out, stats = ga.attention_with_kv_cache(
        q, k_data, v_data, cache_seqlens=np.array(lengths, np.int32), block_table=table, cu_seqlens_q=cu(new),
        kv_format=(k_fmt, v_fmt), k_scales=k_s, v_scales=v_s, k_zero_points=k_z, v_zero_points=v_z,
        return_stats=True, **options)

    def decoded(fmt, data, s, z, cols):
        if fmt in FP8_FORMATS and s.size > 1:  # one scale per (sequence, head): decode sequence by sequence
            parts = [hand_decode(fmt, _rows_of_sequence(data, table, lengths, b, block_size), s[b][:, None], None,
                                 cols) for b in range(len(lengths))]
            return np.concatenate(parts)
        rows = gathered_rows(data.view(np.uint8), table, lengths, block_size).astype(np.uint8)
        gs = None if fmt in FP8_FORMATS else gathered_rows(s.astype(np.float32), table, lengths, block_size)
        gz = None if z is None else gathered_rows(z, table, lengths, block_size).astype(z.dtype)
        return hand_decode(fmt, rows, gs if gs is not None else s, gz, cols)

    kk, vv = decoded(k_fmt, k_data, k_s, k_z, d), decoded(v_fmt, v_data, v_s, v_z, dv)
    want, want_stats = varlen_reference(q, kk, vv, cu(new), cu(lengths), **options)
    assert out.dtype == q.dtype
    assert_close(out, want, dtype, "out")
    # The kernels read the rows decoded to q's dtype: 16-bit queries' stats are within that dtype's tolerance
    # of the f32 decoding's.
    assert_close(stats, want_stats, np.float32, "stats", testing.STATS_TOLERANCE if dtype == "f32" else
                 testing.TOLERANCES[ga.DataType(dtype)])


def _rows_of_sequence(data, table, lengths, b, block_size):
    rows = [data.view(np.uint8)[table[b, r // block_size], r % block_size] for r in range(lengths[b])]
    return np.stack(rows) if rows else np.zeros((0,) + data.shape[2:], np.uint8)


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("group", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_format_and_group_size(fmt, group, dtype, rng):
    # Decode, a speculative step and a prefill chunk beside an empty cache; D = 256 takes every group size.
    run_and_check(rng, dtype, fmt, fmt, [0, 1, 37, 150], [3, 1, 1, 6], d=256, dv=64, k_group=group,
                  v_group=min(group, 64), is_causal=True)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_fp8_per_tensor_and_per_head_scales(fmt, per_sequence, dtype, rng):
    run_and_check(rng, dtype, fmt, fmt, [5, 0, 70], [1, 2, 4], per_sequence_fp8=per_sequence, is_causal=True)


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_every_candidate(candidate, dtype, rng):
    skip_unless_runs_here(candidate)
    with ga.force_kernel(candidate):
        for k_fmt, v_fmt, group in (("u8", "u8", 32), ("u4", "s4", 16), ("s8", "fp8_e4m3", 64)):
            run_and_check(rng, dtype, k_fmt, v_fmt, [1, 200, 64], [1, 40, 2], k_group=group,
                          v_group=min(group, 32), is_causal=True)


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_every_candidate_takes_quantized_heads_in_turn(candidate, dtype, rng):
    """Quantized token-major rows of 3 K/V heads over several key chunks of the heads' turns (lengths past
    128 keys, pages of 5 rows), decode and speculative steps, window and sinks."""
    skip_unless_runs_here(candidate)
    sinks = rng.standard_normal(6).astype(np.float32)
    with ga.force_kernel(candidate):
        run_and_check(rng, dtype, "u4", "u8", [600, 130, 0], [1, 3, 1], block_size=5, heads=6, kv_heads=3,
                      k_group=16, v_group=32, window=(200, 0), sinks=sinks)


@pytest.mark.parametrize("block_size", [1, 3, 64])
@pytest.mark.parametrize("scale_dtype", ["f16", "bf16", "f32"])
def test_block_sizes_scale_dtypes_and_no_zero_points(block_size, scale_dtype, rng):
    for zero_points in (True, False):
        run_and_check(rng, "bf16", "u4", "u8", [130, 7], [2, 1], block_size=block_size, k_group=32, v_group=16,
                      scale_dtype=scale_dtype, zero_points=zero_points, is_causal=True)


@pytest.mark.parametrize("options", [dict(window=(16, 0)), dict(softcap=8.0), dict(is_causal=False)])
@pytest.mark.parametrize("kv_heads,heads", [(1, 8), (2, 2), (4, 16)])
def test_gqa_and_modifiers(options, kv_heads, heads, rng):
    run_and_check(rng, "f32", "s4", "u8", [90, 3], [4, 1], heads=heads, kv_heads=kv_heads, k_group=16,
                  v_group=32, **options)


def test_nibble_order_byte_by_byte(rng):
    # Bytes 0x21 and 0xf8: columns 1, 2, 8, 15 unsigned; 1, 2, -8, -1 signed.
    data = np.array([[0x21, 0xf8]], np.uint8)
    ones = np.ones((1, 1), np.float32)
    np.testing.assert_array_equal(kv_quant.dequantize_kv(data, "u4", ones), [[1, 2, 8, 15]])
    np.testing.assert_array_equal(kv_quant.dequantize_kv(data, "s4", ones), [[1, 2, -8, -1]])
    np.testing.assert_array_equal(kv_quant.pack_nibbles(np.array([[1, 2, 8, 15]])), data)
    # The kernel's: one cached key, so the output is its value row, decoded.
    v_bytes = rng.integers(0, 256, (1, 1, 1, 32), dtype=np.uint8)
    for fmt in ("u4", "s4"):
        k = np.zeros((1, 1, 1, 8), np.uint8)
        scales = np.ones((1, 1, 1, 1), np.float32)
        out = ga.attention_with_kv_cache(np.ones((1, 1, 1, 16), np.float32), k, v_bytes, cache_seqlens=1,
                                         kv_format=fmt, k_scales=scales, v_scales=np.ones((1, 1, 1, 1), np.float32))
        want = [(int(b) >> (4 * (c % 2))) & 15 for b in v_bytes.ravel() for c in (0, 1)]
        want = [w - 16 if fmt == "s4" and w >= 8 else w for w in want]
        np.testing.assert_array_equal(out.ravel(), np.array(want, np.float32))


@pytest.mark.parametrize("k_fmt,v_fmt", [("u8", "u4"), ("s8", "s4"), ("s4", "fp8_e4m3"), ("fp8_e5m2", "u8")])
def test_dense_cache_with_batch_idx_and_chunked_prefill(k_fmt, v_fmt, rng):
    b_cache, s_cache, kv_heads, d = 4, 300, 2, 64
    k_data, k_s, k_z = stored_tensor(rng, k_fmt, (b_cache, s_cache, kv_heads), d, 32)
    v_data, v_s, v_z = stored_tensor(rng, v_fmt, (b_cache, s_cache, kv_heads), d, 16)
    idx = np.array([2, 0], np.int32)
    lengths = [300, 17]
    q = random_array((2, 64, 8, d), "bf16", rng)
    out = ga.attention_with_kv_cache(q, k_data, v_data, cache_seqlens=np.array(lengths, np.int32),
                                     cache_batch_idx=idx, kv_format=(k_fmt, v_fmt), k_scales=k_s, v_scales=v_s,
                                     k_zero_points=k_z, v_zero_points=v_z, is_causal=True)

    def rows(fmt, data, s, z, i, n):
        if fmt in FP8_FORMATS:
            return hand_decode(fmt, data[i, :n], s, None, d)
        return hand_decode(fmt, data[i, :n], s[i, :n], None if z is None else z[i, :n], d)

    kk = np.concatenate([rows(k_fmt, k_data, k_s, k_z, i, n) for i, n in zip(idx, lengths)])
    vv = np.concatenate([rows(v_fmt, v_data, v_s, v_z, i, n) for i, n in zip(idx, lengths)])
    # q's 64 rows of sequence 1 sees more rows than it has keys: the first ones see none (output 0).
    want, _ = varlen_reference(q.reshape(-1, 8, d), kk, vv, cu([64, 64]), cu(lengths), is_causal=True)
    assert_close(out.reshape(-1, 8, d), want, "bf16")


def rule_quantize(x: np.ndarray, fmt: str, group: int, scale_dtype=np.float16):
    """The append's documented rules restated group by group in float64 (graphattn.kv_quant's docstring)."""
    bits = 4 if fmt in ("u4", "s4") else 8
    flat = x.reshape(-1, x.shape[-1]).astype(np.float32)
    q = np.zeros(flat.shape, np.int64)
    scales = np.zeros((flat.shape[0], x.shape[-1] // group), scale_dtype)
    zps = np.zeros(scales.shape, np.int64)
    for r in range(flat.shape[0]):
        for g in range(scales.shape[1]):
            vals = flat[r, g * group:(g + 1) * group]
            if fmt in ("s8", "s4"):
                top = 2 ** (bits - 1) - 1
                s = float(np.array(np.abs(vals).max() / top, np.float32).astype(scale_dtype))
                qs = np.clip(np.rint(vals / np.float32(s)), -top - 1, top) if s > 0 else 0
                z = 0
            else:
                top = 2 ** bits - 1
                lo, hi = float(vals.min()), float(vals.max())
                s32 = np.float32(hi - lo) / np.float32(top) if hi > lo else np.float32(abs(lo)) / np.float32(top)
                s = float(np.array(s32).astype(scale_dtype))
                z = int(np.clip(np.rint(np.float32(-lo) / np.float32(s)), 0, top)) if s > 0 else 0
                qs = np.clip(np.rint(vals / np.float32(s)) + z, 0, top) if s > 0 else 0
            q[r, g * group:(g + 1) * group] = qs
            scales[r, g], zps[r, g] = s, z
    return q.reshape(x.shape), scales.reshape(x.shape[:-1] + (-1,)), zps.reshape(x.shape[:-1] + (-1,))


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_append_quantizes_by_the_rules(fmt, rng):
    block_size, kv_heads, d, group = 4, 2, 32, 16
    k_data, k_s, k_z = stored_tensor(rng, fmt, (6, block_size, kv_heads), d, group)
    v_data, v_s, v_z = stored_tensor(rng, fmt, (6, block_size, kv_heads), d, group)
    before = [a.copy() for a in (k_data, k_s, k_z, v_data, v_s, v_z)]
    table = np.array([[3, 1], [5, 0]], np.int32)
    k_new = rng.standard_normal((2, 3, kv_heads, d)).astype(np.float32)
    k_new[0, 0, 0, :16] = 0.75  # a constant group decodes to itself
    k_new[0, 1, 1, 16:] = -2.5
    k_new[1, 2, 0, :16] = 0.0  # an all-zero group: scale 0, no NaN
    v_new = rng.standard_normal((2, 3, kv_heads, d)).astype(np.float32)
    seqlens = np.array([2, 1], np.int32)
    ga.kv_cache_append(k_data, v_data, k_new, v_new, cache_seqlens=seqlens, block_table=table, kv_format=fmt,
                       k_scales=k_s, v_scales=v_s, k_zero_points=k_z, v_zero_points=v_z)
    slots = [(table[b, (seqlens[b] + i) // block_size], (seqlens[b] + i) % block_size) for b in range(2)
             for i in range(3)]
    written = np.zeros((6, block_size), bool)
    for blk, row in slots:
        written[blk, row] = True
    for new, data, s, z, old in ((k_new, k_data, k_s, k_z, before[:3]), (v_new, v_data, v_s, v_z, before[3:])):
        q, want_s, want_z = rule_quantize(new.reshape(6, kv_heads, d), fmt, group)
        for t, (blk, row) in enumerate(slots):
            stored = hand_decode(fmt, data[blk, row], np.ones((kv_heads, d), np.float32), None, d)
            np.testing.assert_array_equal(stored, q[t])  # the stored integers, column by column
            np.testing.assert_array_equal(s[blk, row], want_s[t])
            np.testing.assert_array_equal(z[blk, row], want_z[t] if fmt in ("u8", "u4") else 0)
        for a, b in zip((data, s, z), old):  # every other row as it was
            np.testing.assert_array_equal(a[~written], b[~written])
    decoded = hand_decode(fmt, k_data[table[0, 0], 2], k_s[table[0, 0], 2], k_z[table[0, 0], 2], d)
    assert not np.isnan(decoded).any()
    np.testing.assert_allclose(decoded[0, :16], 0.75, rtol=1e-3)
    zero_row = hand_decode(fmt, k_data[table[1, 0], 3], k_s[table[1, 0], 3], k_z[table[1, 0], 3], d)
    np.testing.assert_array_equal(zero_row[0, :16], 0.0)


@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS)
def test_quantize_round_trip_bound(fmt, rng):
    # Each value within half a step of its group (fp8: within the format's relative spacing).
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    data, scales, zps = ga.quantize_kv(x, fmt, group_size=32, scale_dtype="f32") if fmt in INT_FORMATS else \
        ga.quantize_kv(x, fmt)
    back = ga.dequantize_kv(data, fmt, scales, zps)
    np.testing.assert_allclose(back, hand_decode(fmt, data, scales, zps, 64), rtol=1e-6, atol=1e-6)
    if fmt in FP8_FORMATS:
        spacing = 2.0 ** -(3 if fmt == "fp8_e4m3" else 2)
        assert np.all(np.abs(back - x) <= spacing * np.abs(x) + float(scales) * 2.0 ** -9 + 1e-7)
    else:
        step = np.repeat(scales, 32, axis=-1)
        assert np.all(np.abs(back - x) <= step * 0.5 + 1e-6)


def test_fp8_append_takes_the_sequence_scale(rng):
    k = np.zeros((4, 8, 2, 16), np.uint8)
    v = np.zeros((4, 8, 2, 16), np.uint8)
    scales = np.array([[0.5, 1.0], [2.0, 0.25]], np.float32)
    new = rng.standard_normal((2, 3, 2, 16)).astype(np.float32)
    table = np.array([[2], [0]], np.int32)
    ga.kv_cache_append(k, v, new, new, cache_seqlens=np.array([0, 4], np.int32), block_table=table,
                       kv_format="fp8_e4m3", k_scales=scales, v_scales=scales)
    for b, (blk, first) in enumerate(((2, 0), (0, 4))):
        for h in range(2):
            want = (new[b, :, h] / scales[b, h]).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            np.testing.assert_array_equal(k[blk, first:first + 3, h], want)


def test_refusals_name_the_argument_and_write_nothing(rng):
    d = 64
    k, k_s, k_z = stored_tensor(rng, "u8", (2, 8, 1), d, 32)
    v, v_s, v_z = stored_tensor(rng, "u8", (2, 8, 1), d, 32)
    kept = [a.copy() for a in (k, k_s, k_z)]
    q = random_array((1, 1, 1, d), "f32", rng)
    new = random_array((1, 1, 1, d), "f32", rng)
    base = dict(cache_seqlens=3, kv_format="u8", k_scales=k_s, v_scales=v_s, k_zero_points=k_z, v_zero_points=v_z)

    def call(**changes):
        return ga.attention_with_kv_cache(q, k, v, new, new, **{**base, **changes})

    bad = np.ones((2, 8, 1, 3), np.float16)  # 64 % 3 != 0
    with pytest.raises(ValueError, match="group size"):
        call(k_scales=bad)
    with pytest.raises(ValueError, match=r"group size G = 8"):  # G must be 16, 32, 64, 128 or D
        call(k_scales=np.ones((2, 8, 1, 8), np.float16), k_zero_points=np.zeros((2, 8, 1, 8), np.uint8))
    with pytest.raises(ValueError, match="k_scales"):
        call(k_scales=None)
    with pytest.raises(ValueError, match="k_zero_points"):
        call(k_zero_points=k_z.astype(np.int8))
    with pytest.raises(ValueError, match="k_zero_points"):  # an asymmetric append writes a zero point
        call(k_zero_points=None)
    with pytest.raises(ValueError, match="kv_format"):
        call(kv_format="q3")
    with pytest.raises(TypeError, match="k_cache"):
        ga.attention_with_kv_cache(q, k.astype(np.int16), v, **base)
    with pytest.raises(ValueError, match="kv_format"):
        ga.attention_with_kv_cache(q, k_s.astype(np.float32), v_s.astype(np.float32), cache_seqlens=1,
                                   k_scales=k_s)
    odd = np.zeros((2, 8, 1, 3), np.uint8)  # 4-bit rows of an odd D cannot be; D = 6 needs G = 6 (D itself)
    with pytest.raises(ValueError, match="group size"):
        ga.attention_with_kv_cache(random_array((1, 1, 1, 6), "f32", rng), odd, odd, cache_seqlens=1,
                                   kv_format="u4", k_scales=np.ones((2, 8, 1, 4), np.float16),
                                   v_scales=np.ones((2, 8, 1, 1), np.float16))
    with pytest.raises(ValueError, match="even head size and group size"):
        kv_quant.quantize_kv(np.zeros((2, 7)), "u4", group_size=7)
    for a, b in zip((k, k_s, k_z), kept):
        np.testing.assert_array_equal(a, b)


def test_gguf_blocks_convert_exactly(rng):
    gguf = pytest.importorskip("gguf")
    from gguf import quants
    x = rng.standard_normal((3, 4, 128)).astype(np.float32)
    x[0, 0, :32] = 0.0
    for kind, fmt, convert in ((gguf.GGMLQuantizationType.Q8_0, "s8", kv_quant.from_gguf_q8_0),
                               (gguf.GGMLQuantizationType.Q4_0, "u4", kv_quant.from_gguf_q4_0)):
        blocks = quants.quantize(x, kind)
        data, scales, zps = convert(blocks)
        np.testing.assert_array_equal(ga.dequantize_kv(data, fmt, scales, zps), quants.dequantize(blocks, kind))
        # and the kernel reads them so: one key, its value row out
        k = data[:1, :1].reshape(1, 1, 1, -1)
        out = ga.attention_with_kv_cache(np.zeros((1, 1, 1, 128), np.float32), k, k, cache_seqlens=1,
                                         kv_format=fmt, k_scales=scales[:1, :1].reshape(1, 1, 1, -1),
                                         v_scales=scales[:1, :1].reshape(1, 1, 1, -1),
                                         k_zero_points=None if zps is None else zps[:1, :1].reshape(1, 1, 1, -1),
                                         v_zero_points=None if zps is None else zps[:1, :1].reshape(1, 1, 1, -1))
        np.testing.assert_array_equal(out.ravel(), quants.dequantize(blocks, kind)[0, 0])


def test_torch_quantized_caches(rng):
    torch = pytest.importorskip("torch")
    d = 32
    k, k_s, k_z = stored_tensor(rng, "u8", (3, 16, 2), d, 16)
    v = (rng.standard_normal((3, 16, 2, d)) * 2).astype(ml_dtypes.float8_e5m2)
    v_s = np.array(0.5, np.float32)
    table = np.array([[2, 0]], np.int32)
    q = random_array((1, 2, 4, d), "bf16", rng)
    new = random_array((1, 2, 2, d), "bf16", rng)
    tk, tks, tkz = (torch.from_numpy(a) for a in (k, k_s, k_z))
    tv = torch.from_numpy(v.view(np.uint8)).view(torch.float8_e5m2)
    tq = torch.from_numpy(q.view(np.int16)).view(torch.bfloat16)
    tn = torch.from_numpy(new.view(np.int16)).view(torch.bfloat16)
    out = ga.attention_with_kv_cache(tq, tk, tv, tn, tn, cache_seqlens=torch.tensor([20], dtype=torch.int32),
                                     block_table=torch.from_numpy(table), kv_format=("u8", "fp8_e5m2"),
                                     k_scales=tks, v_scales=torch.from_numpy(v_s), k_zero_points=tkz, is_causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    # The append went into the torch tensors' memory; the numpy views see it.
    rows = [(table[0, r // 16], r % 16) for r in range(22)]
    kk = np.stack([hand_decode("u8", k[b, r], k_s[b, r], k_z[b, r], d) for b, r in rows])
    vv = np.stack([hand_decode("fp8_e5m2", v.view(np.uint8)[b, r], v_s, None, d) for b, r in rows])
    want, _ = varlen_reference(q[0], kk, vv, cu([2]), cu([22]), is_causal=True)
    assert_close(out[0].float().numpy(), want, "bf16")


def test_append_by_slot_and_attend_after(rng):
    # vLLM's slot_mapping into a u4 cache, -1 skipped; then attention over the rows, against their decoding.
    d, kv_heads, block_size = 32, 2, 4
    k, k_s, k_z = stored_tensor(rng, "u4", (5, block_size, kv_heads), d, 16)
    v, v_s, v_z = stored_tensor(rng, "s8", (5, block_size, kv_heads), d, 32, zero_points=False)
    before = k.copy()
    new_k, new_v = (rng.standard_normal((4, kv_heads, d)).astype(np.float32) for _ in range(2))
    slots = np.array([9, -1, 2, 19], np.int64)
    ga.kv_cache_append(k, v, new_k, new_v, slot_mapping=slots, kv_format=("u4", "s8"), k_scales=k_s, v_scales=v_s,
                       k_zero_points=k_z)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        blk, row = divmod(int(slot), block_size)
        q, s, z = rule_quantize(new_k[t], "u4", 16)
        np.testing.assert_array_equal(hand_decode("u4", k[blk, row], np.ones((kv_heads, d)), None, d), q)
        np.testing.assert_array_equal(k_s[blk, row], s)
        np.testing.assert_array_equal(k_z[blk, row], z)
    untouched = np.ones((5, block_size), bool)
    untouched.flat[[9, 2, 19]] = False
    np.testing.assert_array_equal(k[untouched], before[untouched])


@pytest.mark.parametrize("options", [dict(alibi_slopes="heads"), dict(sinks="heads"), dict(softcap=5.0, window=(7, 0))])
def test_alibi_sinks_and_softcap_over_quantized_rows(options, rng):
    heads = 4
    opts = {name: (rng.standard_normal(heads).astype(np.float32) * (0.1 if name == "alibi_slopes" else 1.0)
                   if value == "heads" else value) for name, value in options.items()}
    run_and_check(rng, "f32", "u8", "fp8_e5m2", [40, 0, 9], [2, 1, 3], heads=heads, k_group=16, is_causal=True,
                  **opts)


def test_threads_append_to_disjoint_blocks_of_a_quantized_cache(rng):
    import threading
    d, kv_heads, block_size, sequences = 32, 2, 8, 6
    k, k_s, k_z = stored_tensor(rng, "u8", (sequences * 4, block_size, kv_heads), d, 16)
    v, v_s, v_z = stored_tensor(rng, "u8", (sequences * 4, block_size, kv_heads), d, 16)
    table = np.arange(sequences * 4, dtype=np.int32).reshape(sequences, 4)
    new_k, new_v = (rng.standard_normal((sequences, 1, kv_heads, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((sequences, 1, 4, d)).astype(np.float32)
    outs = [None] * sequences
    quant = dict(kv_format="u8", k_scales=k_s, v_scales=v_s, k_zero_points=k_z, v_zero_points=v_z)

    def run(s):
        outs[s] = ga.attention_with_kv_cache(q[s:s + 1], k, v, new_k[s:s + 1], new_v[s:s + 1], cache_seqlens=20,
                                             block_table=table[s:s + 1], **quant)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(sequences)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in range(sequences):  # each against a call over the cache as the threads left it (no new rows)
        again = ga.attention_with_kv_cache(q[s:s + 1], k, v, cache_seqlens=21, block_table=table[s:s + 1], **quant)
        np.testing.assert_array_equal(outs[s], again)


GRAPH_SRC = {"u8": (np.uint8, 0, 256), "s8": (np.int8, -128, 128), "u4": (ml_dtypes.uint4, 0, 16),
             "s4": (ml_dtypes.int4, -8, 8)}
GRAPH_ZPS = {"u8": "u8", "s8": "s8", "u4": "u4", "s4": "s8"}


def compressed_kv_graph(rng, fmt="u8", *, dequant=("k", "v"), k_transposed=False, gqa_5d=False, qtype="per_group",
                        group=16, zero_points=True, dtype="f32"):
    """oneDNN's compressed-KV SDPA graph: DynamicDequantize (per group along D) on K and/or V, then
    MatMul(Q, K^T) * scale -> SoftMax -> MatMul(P, V).  K is (N, H, S, D) with transpose_b, or the (N, H, D, S)
    view (k_transposed); gqa_5d: Q (N, H_kv, 2, L, D) over K/V (N, H_kv, 1, S, D).  (graph, inputs, want)."""
    n, hk, s, d, L = 1, 2, 40, 32, 6
    lt = ga.LogicalTensor
    np_src, lo, hi = GRAPH_SRC[fmt]
    head = (n, hk, 1) if gqa_5d else (n, hk)
    q_shape = (n, hk, 2, L, d) if gqa_5d else (n, hk, L, d)
    q = random_array(q_shape, dtype, rng)
    graph, inputs, next_id = ga.Graph(), {}, [0]
    np_float = q.dtype

    def port(array, dt):
        i = next_id[0]
        next_id[0] += 1
        inputs[i] = array
        return lt(i, dt, array.shape)

    q_lt = port(q, dtype)
    decoded, ops = {}, []
    for side in ("k", "v"):
        rows_first = side == "v" or not k_transposed
        shape = head + ((s, d) if rows_first else (d, s))
        gshape = head + ((s, d // group) if rows_first else (d // group, s))
        if qtype == "per_tensor":
            gshape, group = (1,), 1
        src = rng.integers(lo, hi, shape).astype(np_src)
        # decoded values about 1, so that bf16's rounding of the scores stays within its tolerance
        scales = (rng.uniform(0.5, 1.5, gshape) / (128 if fmt in ("u8", "s8") else 8)).astype(np_float)
        zps = rng.integers(lo // 2 if lo < 0 else 0, hi // 2, gshape).astype(GRAPH_SRC[GRAPH_ZPS[fmt]][0]) \
            if zero_points else None
        z = None if zps is None else zps.astype(np.float64)
        if qtype == "per_tensor":
            g, zz = scales.astype(np.float64)[0], (0 if z is None else z[0])
        else:
            g = np.repeat(scales.astype(np.float64), group, axis=-1 if rows_first else -2)
            zz = 0 if z is None else np.repeat(z, group, axis=-1 if rows_first else -2)
        decoded[side] = (src.astype(np.float64) - zz) * g
        if side[0] not in [x[0] for x in dequant]:
            plain = decoded[side].astype(np_float)
            decoded[side] = plain.astype(np.float64)
            ops.append(port(plain, dtype))
            continue
        ins = [port(src, fmt), port(scales, dtype)] + ([port(zps, GRAPH_ZPS[fmt])] if zps is not None else [])
        out = lt(100 + len(ops), dtype, shape)
        attrs = {"qtype": qtype}
        if qtype == "per_group":
            attrs["group_shape"] = [1] * (len(shape) - 2) + ([1, group] if rows_first else [group, 1])
        graph.add_op(ga.Op(10 + len(ops), "DynamicDequantize", ins, [out], attrs))
        ops.append(out)
    k_lt, v_lt = ops
    scale_lt = port(np.array([d ** -0.5], np_float), dtype)
    score_shape = q_shape[:-1] + (s,)
    scores, scaled, probs = (lt(200 + i, dtype, score_shape) for i in range(3))
    out = lt(300, dtype, q_shape)
    graph.add_op(ga.Op(1, "MatMul", [q_lt, k_lt], [scores], {"transpose_b": not k_transposed}))
    graph.add_op(ga.Op(2, "Multiply", [scores, scale_lt], [scaled]))
    graph.add_op(ga.Op(3, "SoftMax", [scaled], [probs], {"axis": -1}))
    graph.add_op(ga.Op(4, "MatMul", [probs, v_lt], [out]))
    kk = decoded["k"] if not k_transposed else decoded["k"].swapaxes(-1, -2)
    logits = q.astype(np.float64) @ kk.swapaxes(-1, -2) * d ** -0.5
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return graph, inputs, (p / p.sum(-1, keepdims=True)) @ decoded["v"]


def run_compressed(graph, inputs):
    partitions = graph.get_partitions()
    results = ga.run_graph(graph, inputs, partitions=partitions)
    return partitions, results[300]


@pytest.mark.parametrize("fmt", ["u8", "s8", "u4", "s4"])
@pytest.mark.parametrize("form", ["k_and_v", "k_only", "v_only", "k_transposed", "gqa_5d", "bf16", "no_zps"])
def test_compressed_kv_sdpa_is_one_fused_partition(fmt, form, rng):
    options = {"k_and_v": {}, "k_only": dict(dequant=("k",)), "v_only": dict(dequant=("v",)),
               "k_transposed": dict(k_transposed=True), "gqa_5d": dict(gqa_5d=True), "bf16": dict(dtype="bf16"),
               "no_zps": dict(zero_points=False)}[form]
    graph, inputs, want = compressed_kv_graph(rng, fmt, **options)
    partitions, got = run_compressed(graph, inputs)
    assert [p.kind for p in partitions] == ["sdpa_forward"], partitions
    engine = ga.Engine("cpu")
    in_lts = [ga.LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape) for lt in partitions[0].get_input_ports()]
    compiled = partitions[0].compile(in_lts, partitions[0].get_output_ports(), engine)
    assert compiled.kernel_name == "sdpa_forward_cpu", getattr(compiled.kernel, "reason", "")
    assert_close(got, want, options.get("dtype", "f32"), "output")
    reference = ga.run_graph(graph, inputs, policy="debug")[300]  # op by op, in float64
    assert_close(got, reference, options.get("dtype", "f32"), "output against the op-by-op graph")


def test_compressed_kv_forms_the_kernel_does_not_take_stay_op_by_op(rng, capfd):
    # per_tensor scales: the DynamicDequantize stays its own partition (the log says why), the SDPA fused.
    graph, inputs, want = compressed_kv_graph(rng, "u8", qtype="per_tensor")
    ga.set_verbose(1)
    try:
        partitions, got = run_compressed(graph, inputs)
    finally:
        ga.set_verbose(0)
    assert sorted(p.kind for p in partitions) == ["op", "op", "sdpa_forward"]
    assert "qtype per_tensor" in capfd.readouterr().err
    assert_close(got, want, "f32", "output")


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_compressed_kv_graph_on_every_candidate(candidate, dtype, rng):
    skip_unless_runs_here(candidate)
    for fmt, options in (("u8", {}), ("s4", dict(k_transposed=True)), ("u4", dict(gqa_5d=True))):
        graph, inputs, want = compressed_kv_graph(rng, fmt, dtype=dtype, **options)
        with ga.force_kernel(candidate):
            partitions, got = run_compressed(graph, inputs)
        assert [p.kind for p in partitions] == ["sdpa_forward"]
        assert_close(got, want, dtype, f"{fmt} {options}")


def test_graph_groups_smaller_than_the_python_formats_take(rng):
    # The graph's DynamicDequantize may group by any size: groups of 8 over D = 4096 (512 a row) decode too.
    d, s, group = 4096, 5, 8
    lt = ga.LogicalTensor
    k_src = rng.integers(0, 256, (1, 1, s, d)).astype(np.uint8)
    k_s = rng.uniform(0.5, 1.5, (1, 1, s, d // group)).astype(np.float32) / 128
    q = rng.standard_normal((1, 1, 2, d)).astype(np.float32) / 16
    v = rng.standard_normal((1, 1, s, 8)).astype(np.float32)
    graph = ga.Graph()
    ins = [lt(0, "f32", q.shape), lt(1, "u8", k_src.shape), lt(2, "f32", k_s.shape), lt(3, "f32", v.shape)]
    k = lt(10, "f32", k_src.shape)
    graph.add_op(ga.Op(0, "DynamicDequantize", ins[1:3], [k], {"qtype": "per_group", "group_shape": [1, 1, 1, group]}))
    scores, probs, out = lt(11, "f32", (1, 1, 2, s)), lt(12, "f32", (1, 1, 2, s)), lt(13, "f32", (1, 1, 2, 8))
    graph.add_op(ga.Op(1, "MatMul", [ins[0], k], [scores], {"transpose_b": True}))
    graph.add_op(ga.Op(2, "SoftMax", [scores], [probs], {"axis": -1}))
    graph.add_op(ga.Op(3, "MatMul", [probs, ins[3]], [out]))
    partitions = graph.get_partitions()
    assert [p.kind for p in partitions] == ["sdpa_forward"]
    got = ga.run_graph(graph, {0: q, 1: k_src, 2: k_s, 3: v}, partitions=partitions)[13]
    kk = k_src.astype(np.float64) * np.repeat(k_s.astype(np.float64), group, -1)
    logits = q.astype(np.float64) @ kk.swapaxes(-1, -2)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    assert_close(got, (p / p.sum(-1, keepdims=True)) @ v, "f32")
