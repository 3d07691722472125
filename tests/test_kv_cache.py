"""attention_with_kv_cache and kv_cache_append: dense and paged caches against the float64 reference of the
blocks gathered by hand, on every kernel candidate; the append's bytes; the checks that write nothing."""
import threading

import numpy as np
import pytest

import graphattn as ga
from graphattn import testing
from graphattn.testing import assert_close, random_array, varlen_reference

from cpu_helpers import skip_unless_runs_here
from test_varlen import CANDIDATE_DTYPES, cu


def paged_cache(rng, dtype, lengths, block_size, kv_heads=2, d=16, dv=8, spare=3, head_major=False, poison=True):
    """(k_cache, v_cache, block_table) for sequences of `lengths` cached rows: blocks drawn from a random
    permutation of a pool `spare` times the need (flash-attn's tests do so), every row NaN where a sequence does
    not hold it (tails and unused blocks), table entries past a sequence's blocks -1."""
    max_blocks = max(1, max(-(-n // block_size) for n in lengths) if lengths else 1)
    pool = spare * max(1, len(lengths)) * max_blocks
    shape_k, shape_v = (pool, block_size, kv_heads, d), (pool, block_size, kv_heads, dv)
    if head_major:  # (num_blocks, H_kv, block_size, D) buffers seen as their permuted views
        k = random_array((pool, kv_heads, block_size, d), dtype, rng).transpose(0, 2, 1, 3)
        v = random_array((pool, kv_heads, block_size, dv), dtype, rng).transpose(0, 2, 1, 3)
    else:
        k, v = random_array(shape_k, dtype, rng), random_array(shape_v, dtype, rng)
    order = rng.permutation(pool).astype(np.int32)
    table = np.full((len(lengths), max_blocks), -1, np.int32)
    for b, n in enumerate(lengths):
        used = -(-n // block_size)
        table[b, :used] = order[b * max_blocks:b * max_blocks + used]
    if poison:
        held = np.zeros((pool, block_size), bool)
        for b, n in enumerate(lengths):
            for r in range(n):
                held[table[b, r // block_size], r % block_size] = True
        k[~held], v[~held] = np.nan, np.nan
    return k, v, table


def gathered(cache, table, lengths, block_size):
    """The packed (T_k, H_kv, D) rows the table gives, sequence after sequence."""
    rows = [cache[table[b, r // block_size], r % block_size] for b, n in enumerate(lengths) for r in range(n)]
    return np.stack(rows) if rows else np.zeros((0,) + cache.shape[2:], cache.dtype)


def check(q, k_cache, v_cache, table, cached, new, dtype, block_size, k=None, v=None, **options):
    """attention_with_kv_cache (q dense (B, L, H, D) or packed) against the reference of the gathered rows."""
    packed = q.ndim == 3
    cu_q = cu(new) if packed else None
    out, stats = ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array(cached, np.int32),
                                            block_table=table, cu_seqlens_q=cu_q, return_stats=True, **options)
    total = [c + n for c, n in zip(cached, new)] if k is not None else list(cached)
    kk, vv = gathered(k_cache, table, total, block_size), gathered(v_cache, table, total, block_size)
    q_rows = q if packed else q.reshape(-1, *q.shape[2:])
    want, want_stats = varlen_reference(q_rows, kk, vv, cu(new), cu(total), **options)
    got = out if packed else out.reshape(-1, *out.shape[2:])
    got_stats = stats if packed else stats.transpose(1, 0, 2).reshape(stats.shape[1], -1)
    assert out.dtype == q.dtype
    assert_close(got, want, dtype, "out")
    assert_close(got_stats, want_stats, np.float32, "stats", testing.STATS_TOLERANCE)
    return out


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_every_candidate_decode_and_speculative(candidate, dtype, rng):
    skip_unless_runs_here(candidate)
    cached, new, bs = [13, 0, 40, 7], [1, 3, 8, 1], 5
    k_cache, v_cache, table = paged_cache(rng, dtype, [c + n for c, n in zip(cached, new)], bs)
    q = random_array((sum(new), 4, 16), dtype, rng)
    k, v = random_array((sum(new), 2, 16), dtype, rng), random_array((sum(new), 2, 8), dtype, rng)
    with ga.force_kernel(candidate):
        check(q, k_cache, v_cache, table, cached, new, dtype, bs, k, v, is_causal=True)


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_every_candidate_chunked_prefill(candidate, dtype, rng):
    """A chunk of 96 query rows onto 300 cached ones, beside a decode step: blocks crossing every key block."""
    skip_unless_runs_here(candidate)
    cached, new, bs = [300, 50], [96, 1], 16
    k_cache, v_cache, table = paged_cache(rng, dtype, [c + n for c, n in zip(cached, new)], bs, d=64, dv=64)
    q = random_array((sum(new), 4, 64), dtype, rng)
    k, v = random_array((sum(new), 2, 64), dtype, rng), random_array((sum(new), 2, 64), dtype, rng)
    with ga.force_kernel(candidate):
        check(q, k_cache, v_cache, table, cached, new, dtype, bs, k, v, is_causal=True)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_block_sizes(block_size, dtype, rng):
    cached, new = [0, 5, 130, 299], [2, 1, 4, 1]
    k_cache, v_cache, table = paged_cache(rng, dtype, [c + n for c, n in zip(cached, new)], block_size)
    q = random_array((len(new), 1, 4, 16), dtype, rng)  # dense (B, 1, H, D): one decode step each
    check(q, k_cache, v_cache, table, cached, [1] * 4, dtype, block_size, is_causal=True)


# Cached lengths around the row layout's key vectors and blocks (16 and 64 keys on AVX-512), none, a long one.
EDGE_CACHED = [0, 1, 15, 16, 17, 31, 63, 64, 65, 130, 299, 1000]


@pytest.mark.parametrize("block_size", [1, 3, 16, 64, 256, 2048])
@pytest.mark.parametrize("d,dv,heads,kv_heads", [(64, 32, 8, 2), (128, 128, 32, 2), (256, 48, 4, 4), (32, 16, 16, 1)],
                         ids=["d64_dv32_gqa4", "d128_gqa16", "d256_dv48_mha", "d32_dv16_mqa16"])
def test_decode_at_block_edges(block_size, d, dv, heads, kv_heads, rng):
    """bf16 decode steps (the row layout) against the reference of the gathered blocks, at lengths around its
    key vectors and blocks, pages of 1 to 2048 rows (a key block inside one page or across many, the last
    page's rows past the sequence NaN), GQA groups of 1-16 query rows per K/V head, beside one speculative step
    of up to 16 rows per K/V head."""
    new = [1] * len(EDGE_CACHED)
    if heads // kv_heads <= 8:
        new[5] = 16 // (heads // kv_heads)
    lengths = [c + n for c, n in zip(EDGE_CACHED, new)]
    k_cache, v_cache, table = paged_cache(rng, "bf16", lengths, block_size, kv_heads=kv_heads, d=d, dv=dv, spare=2)
    q = random_array((sum(new), heads, d), "bf16", rng)
    k, v = random_array((sum(new), kv_heads, d), "bf16", rng), random_array((sum(new), kv_heads, dv), "bf16", rng)
    check(q, k_cache, v_cache, table, EDGE_CACHED, new, "bf16", block_size, k, v, is_causal=True)


def test_chunked_prefill_512_onto_4096(rng):
    cached, new, bs = [4096], [512], 64
    k_cache, v_cache, table = paged_cache(rng, "bf16", [4608], bs, kv_heads=1, d=32, dv=32, spare=2)
    q = random_array((1, 512, 2, 32), "bf16", rng)
    k, v = random_array((1, 512, 1, 32), "bf16", rng), random_array((1, 512, 1, 32), "bf16", rng)
    check(q, k_cache, v_cache, table, cached, new, "bf16", bs, k, v, is_causal=True)


@pytest.mark.parametrize("options", [
    {"window": (7, 0)}, {"softcap": 5.0, "is_causal": True}, {"alibi_slopes": "per_head", "is_causal": True},
    {"alibi_slopes": "per_sequence"}, {"sinks": True, "is_causal": True}, {"scale": 0.3},
], ids=["window", "softcap", "alibi_h", "alibi_bh", "sinks", "scale"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_score_mods_and_gqa(options, kv_heads, rng):
    options = dict(options)
    cached, new, bs = [9, 33, 0], [1, 4, 2], 4
    k_cache, v_cache, table = paged_cache(rng, "f32", [c + n for c, n in zip(cached, new)], bs, kv_heads=kv_heads)
    if options.get("alibi_slopes") == "per_head":
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, 8).astype(np.float32)
    elif options.get("alibi_slopes") == "per_sequence":
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, (3, 8)).astype(np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(8).astype(np.float32)
    q = random_array((sum(new), 8, 16), "f32", rng)
    k, v = random_array((sum(new), kv_heads, 16), "f32", rng), random_array((sum(new), kv_heads, 8), "f32", rng)
    check(q, k_cache, v_cache, table, cached, new, "f32", bs, k, v, **options)


# Decode over token-major caches takes the K/V heads in turn, a key chunk at a time (the row layout's turns):
# lengths across several chunks (128 keys), a partial one, none, beside speculative steps.
TURN_CACHED, TURN_NEW = [700, 129, 0, 260, 1], [1, 2, 1, 3, 1]
TURN_OPTIONS = {
    "causal": {"is_causal": True},
    "window": {"window": (150, 0)},
    "softcap_alibi": {"softcap": 4.0, "alibi_slopes": "per_head", "is_causal": True},
    "sinks": {"sinks": True, "is_causal": True},
}


@pytest.mark.parametrize("options", TURN_OPTIONS.values(), ids=TURN_OPTIONS.keys())
@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
def test_every_candidate_takes_the_heads_in_turn(candidate, dtype, options, rng):
    """Decode and speculative steps over a token-major paged cache of 3 K/V heads (odd head dims, pages of 7
    rows) on every candidate against the float64 reference; with two threads the long sequence's keys are
    split too, each split's chunks folded in turn before the splits merge."""
    skip_unless_runs_here(candidate)
    options = dict(options)
    if options.get("alibi_slopes") == "per_head":
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, 6).astype(np.float32)
    if options.pop("sinks", False):
        options["sinks"] = rng.standard_normal(6).astype(np.float32)
    lengths = [c + n for c, n in zip(TURN_CACHED, TURN_NEW)]
    k_cache, v_cache, table = paged_cache(rng, dtype, lengths, 7, kv_heads=3, d=40, dv=24, spare=2)
    q = random_array((sum(TURN_NEW), 6, 40), dtype, rng)
    k, v = random_array((sum(TURN_NEW), 3, 40), dtype, rng), random_array((sum(TURN_NEW), 3, 24), dtype, rng)
    with ga.force_kernel(candidate):
        check(q, k_cache, v_cache, table, TURN_CACHED, TURN_NEW, dtype, 7, k, v, **options)


def test_heads_in_turn_only_where_a_token_row_holds_every_head(rng):
    """The plan names the turns ("+turns") where K's and V's rows of all heads lie in each token row, and not
    for head-major rows."""
    lengths = [700, 129, 5, 260]
    cq = cu([1] * 4)
    k = random_array((sum(lengths), 3, 40), "f32", rng)
    v = random_array((sum(lengths), 3, 24), "f32", rng)
    q = random_array((4, 6, 40), "f32", rng)
    assert "+turns" in ga.varlen.dispatch_text(q, k, v, cq, cu(lengths))
    head_major = [np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2) for x in (k, v)]
    assert "+turns" not in ga.varlen.dispatch_text(q, *head_major, cq, cu(lengths))


def test_shared_blocks_between_sequences(rng):
    """Two sequences share a prefix block (a prompt cached once): each reads it through its own table."""
    k_cache, v_cache, table = paged_cache(rng, "f32", [8, 8], 4, poison=False)
    table[1, 0] = table[0, 0]
    q = random_array((2, 1, 4, 16), "f32", rng)
    check(q, k_cache, v_cache, table, [8, 8], [1, 1], "f32", 4, is_causal=True)


@pytest.mark.parametrize("dtype,d", [("f32", 16), ("bf16", 16), ("f16", 16), ("bf16", 64)])
def test_head_major_and_token_major_buffers_agree(dtype, d, rng):
    """bf16 with D 64 also: rows of whole vectors, read in place at either row stride."""
    cached, new, bs = [21, 6], [3, 1], 8
    lengths = [c + n for c, n in zip(cached, new)]
    token = paged_cache(np.random.default_rng(5), dtype, lengths, bs, d=d, dv=d // 2)
    head = paged_cache(np.random.default_rng(5), dtype, lengths, bs, d=d, dv=d // 2, head_major=True)
    k_h, v_h = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in token[:2])
    assert not k_h.flags.c_contiguous
    q = random_array((sum(new), 4, d), dtype, rng)
    k, v = random_array((sum(new), 2, d), dtype, rng), random_array((sum(new), 2, d // 2), dtype, rng)
    a = check(q, token[0], token[1], token[2], cached, new, dtype, bs, k, v, is_causal=True)
    b = check(q, k_h, v_h, token[2], cached, new, dtype, bs, k, v, is_causal=True)
    assert head[0].shape == token[0].shape
    np.testing.assert_array_equal(a, b)


def test_dense_cache_with_batch_idx(rng):
    k_cache = random_array((5, 40, 2, 16), "f32", rng)
    v_cache = random_array((5, 40, 2, 8), "f32", rng)
    idx = np.array([3, 0], np.int32)
    cached = [17, 30]
    q = random_array((2, 2, 4, 16), "f32", rng)
    k, v = random_array((2, 2, 2, 16), "f32", rng), random_array((2, 2, 2, 8), "f32", rng)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    out = ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array(cached, np.int32),
                                     cache_batch_idx=idx, is_causal=True)
    expected_k, expected_v = before_k.copy(), before_v.copy()
    for b in range(2):
        expected_k[idx[b], cached[b]:cached[b] + 2] = k[b]
        expected_v[idx[b], cached[b]:cached[b] + 2] = v[b]
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)
    kk = np.concatenate([k_cache[idx[b], :cached[b] + 2] for b in range(2)])
    vv = np.concatenate([v_cache[idx[b], :cached[b] + 2] for b in range(2)])
    want, _ = varlen_reference(q.reshape(4, 4, 16), kk, vv, cu([2, 2]), cu([c + 2 for c in cached]), is_causal=True)
    assert_close(out.reshape(4, 4, 8), want, "f32")


def test_append_writes_exactly_its_rows_and_poison_stays_unread(rng):
    cached, new, bs = [5, 0, 11], [2, 3, 1], 4
    k_cache, v_cache, table = paged_cache(rng, "f32", [c + n for c, n in zip(cached, new)], bs)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    q = random_array((sum(new), 4, 16), "f32", rng)
    k, v = random_array((sum(new), 2, 16), "f32", rng), random_array((sum(new), 2, 8), "f32", rng)
    out = check(q, k_cache, v_cache, table, cached, new, "f32", bs, k, v, is_causal=True)
    assert np.isfinite(out).all()
    expected_k, expected_v = before_k.copy(), before_v.copy()
    t = 0
    for b, (c, n) in enumerate(zip(cached, new)):
        for r in range(c, c + n):
            expected_k[table[b, r // bs], r % bs] = k[t]
            expected_v[table[b, r // bs], r % bs] = v[t]
            t += 1
    np.testing.assert_array_equal(k_cache, expected_k)  # NaN equals NaN here: the poison where it was
    np.testing.assert_array_equal(v_cache, expected_v)


def test_cache_seqlens_zero_and_no_keys(rng):
    k_cache, v_cache, table = paged_cache(rng, "f32", [4, 4], 2)
    q = random_array((2, 1, 4, 16), "f32", rng)
    out, stats = ga.attention_with_kv_cache(q, k_cache, v_cache, cache_seqlens=0, block_table=table,
                                            return_stats=True)
    np.testing.assert_array_equal(out, 0)
    assert stats.shape == (2, 4, 1) and np.isneginf(stats).all()


def test_bad_calls_write_nothing(rng):
    k_cache, v_cache, table = paged_cache(rng, "f32", [6, 3], 4, poison=False)
    q = random_array((2, 1, 4, 16), "f32", rng)
    k, v = random_array((2, 1, 2, 16), "f32", rng), random_array((2, 1, 2, 8), "f32", rng)
    before = k_cache.copy(), v_cache.copy()
    bad = table.copy()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(IndexError, match="block_table"):
        ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([6, 3], np.int32),
                                   block_table=bad)
    with pytest.raises(ValueError, match="capacity"):
        ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([8, 3], np.int32),
                                   block_table=table)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([6, 3], np.int32),
                                   block_table=table, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        ga.attention_with_kv_cache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([6.0, 3.0]),
                                   block_table=table)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
    dense_k, dense_v = random_array((3, 8, 2, 16), "f32", rng), random_array((3, 8, 2, 8), "f32", rng)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        ga.attention_with_kv_cache(q, dense_k, dense_v, k, v, cache_seqlens=1,
                                   cache_batch_idx=np.array([1, 1], np.int32))
    # Entries past a sequence's blocks are never read: -1 there is fine.
    assert (table[1, 1:] == -1).all()


def test_kv_cache_append_by_position_and_by_slot(rng):
    k_cache, v_cache, table = paged_cache(rng, "bf16", [9, 2], 4, poison=False)
    before_k = k_cache.copy()
    k, v = random_array((2, 2, 2, 16), "bf16", rng), random_array((2, 2, 2, 8), "bf16", rng)
    ga.kv_cache_append(k_cache, v_cache, k, v, cache_seqlens=np.array([7, 0], np.int32), block_table=table)
    expected = before_k.copy()
    for b, c in enumerate([7, 0]):
        for i in range(2):
            expected[table[b, (c + i) // 4], (c + i) % 4] = k[b, i]
    np.testing.assert_array_equal(k_cache.view(np.uint16), expected.view(np.uint16))
    slots = np.array([5, -1, 17], np.int64)
    kt, vt = random_array((3, 2, 16), "bf16", rng), random_array((3, 2, 8), "bf16", rng)
    ga.kv_cache_append(k_cache, v_cache, kt, vt, slot_mapping=slots)
    expected[1, 1], expected[4, 1] = kt[0], kt[2]
    np.testing.assert_array_equal(k_cache.view(np.uint16), expected.view(np.uint16))
    with pytest.raises(ValueError, match="repeats"):
        ga.kv_cache_append(k_cache, v_cache, kt, vt, slot_mapping=np.array([3, 3, -1]))
    with pytest.raises(IndexError, match="slot_mapping"):
        ga.kv_cache_append(k_cache, v_cache, kt, vt, slot_mapping=np.array([0, 1, k_cache.shape[0] * 4]))
    np.testing.assert_array_equal(k_cache.view(np.uint16), expected.view(np.uint16))


def test_threads_append_to_disjoint_blocks_while_attending(rng):
    """Each thread owns one sequence's blocks: it appends a row and attends, step after step."""
    steps, sequences, bs = 6, 4, 2
    k_cache, v_cache, table = paged_cache(rng, "f32", [steps] * sequences, bs, poison=False)
    qs = random_array((sequences, steps, 1, 1, 4, 16), "f32", rng)
    ks = random_array((sequences, steps, 1, 1, 2, 16), "f32", rng)
    vs = random_array((sequences, steps, 1, 1, 2, 8), "f32", rng)
    outs = np.zeros((sequences, steps, 4, 8), np.float32)
    errors = []

    def run(s):
        try:
            for t in range(steps):
                outs[s, t] = ga.attention_with_kv_cache(qs[s, t], k_cache, v_cache, ks[s, t], vs[s, t],
                                                        cache_seqlens=t, block_table=table[s:s + 1],
                                                        is_causal=True)[0, 0]
        except Exception as e:  # re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(sequences)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    for s in range(sequences):
        for t in range(steps):
            kk = gathered(k_cache, table[s:s + 1], [t + 1], bs)
            vv = gathered(v_cache, table[s:s + 1], [t + 1], bs)
            want, _ = varlen_reference(qs[s, t, 0], kk, vv, cu([1]), cu([t + 1]), is_causal=True)
            assert_close(outs[s, t][None], want, "f32")


def test_torch_tensors_in_place(rng):
    torch = pytest.importorskip("torch")
    k_cache, v_cache, table = paged_cache(rng, "f32", [5, 9], 4, poison=False)
    kc, vc = torch.from_numpy(k_cache), torch.from_numpy(v_cache)
    q = torch.from_numpy(random_array((2, 1, 4, 16), "f32", rng))
    k = torch.from_numpy(random_array((2, 1, 2, 16), "f32", rng))
    v = torch.from_numpy(random_array((2, 1, 2, 8), "f32", rng))
    out = ga.attention_with_kv_cache(q, kc, vc, k, v, cache_seqlens=torch.tensor([4, 8], dtype=torch.int32),
                                     block_table=torch.from_numpy(table), is_causal=True)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 4, 8)
    assert torch.equal(kc[table[0, 1], 0], k[0, 0])
    want = check(q.numpy(), k_cache, v_cache, table, [5, 9], [1, 1], "f32", 4, is_causal=True)
    assert_close(out.numpy(), want, "f32")


def rotary_reference(x, cos, sin, positions, interleaved):
    """float64 rotary embedding of x (B, L, H, D) at positions (B, L), written out pair by pair."""
    x = np.asarray(x, np.float64).copy()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            c, s = cos[positions[b, i]], sin[positions[b, i]]
            for p in range(half):
                a, o = (2 * p, 2 * p + 1) if interleaved else (p, p + half)
                x0, x1 = x[b, i, :, a].copy(), x[b, i, :, o].copy()
                x[b, i, :, a], x[b, i, :, o] = x0 * c[p] - x1 * s[p], x1 * c[p] + x0 * s[p]
    return x


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("paged", [True, False])
def test_flash_attn_with_kvcache(interleaved, causal, paged, rng):
    torch = pytest.importorskip("torch")
    from graphattn.flash_attn import flash_attn_with_kvcache

    cached, L, bs, d = [6, 11], 3, 4, 16
    if paged:
        k_cache, v_cache, table = paged_cache(rng, "f32", [c + L for c in cached], bs, d=d, dv=d, poison=False)
    else:
        k_cache, v_cache = random_array((2, 16, 2, d), "f32", rng), random_array((2, 16, 2, d), "f32", rng)
        table = None
    q, k, v = (random_array((2, L, h, d), "f32", rng) for h in (4, 2, 2))
    angles = rng.uniform(0, 3, (32, 4))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    t = torch.from_numpy
    out, lse = flash_attn_with_kvcache(
        t(q), t(k_cache), t(v_cache), t(k), t(v), rotary_cos=t(cos), rotary_sin=t(sin),
        cache_seqlens=torch.tensor(cached, dtype=torch.int32), block_table=None if table is None else t(table),
        causal=causal, rotary_interleaved=interleaved, return_softmax_lse=True)
    assert out.shape == (2, L, 4, d) and lse.shape == (2, 4, L)
    positions = np.array(cached)[:, None] + np.arange(L)[None, :]
    k_rot = rotary_reference(k, cos, sin, positions, interleaved)
    q_rot = rotary_reference(q, cos, sin, positions if causal else np.repeat(positions[:, :1], L, 1), interleaved)
    rows = [c + L for c in cached]
    if paged:
        kk, vv = gathered(k_cache, table, rows, bs), gathered(v_cache, table, rows, bs)
    else:
        kk = np.concatenate([k_cache[b, :rows[b]] for b in range(2)])
        vv = np.concatenate([v_cache[b, :rows[b]] for b in range(2)])
    new_k = np.concatenate([kk[sum(rows[:b]) + cached[b]:sum(rows[:b + 1])] for b in range(2)])
    assert_close(new_k, k_rot.reshape(-1, 2, d), "f32", "rotated k in the cache")
    want, want_stats = varlen_reference(q_rot.reshape(-1, 4, d), kk, vv, cu([L, L]), cu(rows), is_causal=causal)
    assert_close(out.numpy().reshape(-1, 4, d), want, "f32")
    assert_close(lse.numpy().transpose(1, 0, 2).reshape(4, -1), want_stats, np.float32, "lse",
                 testing.STATS_TOLERANCE)


def test_the_native_call_checks_the_table_itself(rng):
    """The C++ entry refuses keys beyond a table row and entries outside the cache (no Python check first)."""
    from graphattn import _cpu

    k_cache, v_cache, table = paged_cache(rng, "f32", [6], 4, poison=False)
    q = random_array((1, 4, 16), "f32", rng)
    out = np.empty((1, 4, 8), np.float32)
    views = {"query": (0, (0, 2 * 16, 16, 4 * 16, 1), q), "output": (0, (0, 2 * 8, 8, 4 * 8, 1), out),
             "key": (0, tuple(s // 4 for s in (k_cache.strides[0], k_cache.strides[2], 0, k_cache.strides[1],
                                               k_cache.strides[3])), k_cache),
             "value": (0, tuple(s // 4 for s in (v_cache.strides[0], v_cache.strides[2], 0, v_cache.strides[1],
                                                 v_cache.strides[3])), v_cache)}

    def call(key_rows, entries):
        spans = np.array([[0, 1, 0, key_rows]], np.int64)
        _cpu.run_packed(views, spans, (1, 2, 2), 1, key_rows, 16, 8, scale=0.25, window_left=_cpu.NO_KEY_LIMIT,
                        window_right=_cpu.NO_KEY_LIMIT, alignment="bottom_right", block_table=entries,
                        block_rows=4, num_blocks=k_cache.shape[0])

    call(6, table)
    with pytest.raises(ValueError, match="beyond its row"):
        call(4 * table.shape[1] + 1, table)
    bad = table.copy()
    bad[0, 1] = -3
    with pytest.raises(ValueError, match="block_table: sequence 0: entry 1 is -3"):
        call(6, bad)
