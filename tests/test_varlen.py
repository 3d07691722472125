"""varlen_attention and its backward against the float64 reference, per sequence, on every kernel candidate."""
import numpy as np
import pytest

import graphattn as ga
from graphattn import testing
from graphattn.testing import assert_close, assert_grad_close, random_array, varlen_reference, varlen_reference_backward

from cpu_helpers import skip_unless_runs_here

# Query and key lengths of a batch with short, empty and long sequences, S_q > S_k (rows that see nothing under
# bottom-right causal) and S_q < S_k.
LENGTHS_Q = (5, 0, 17, 1, 70, 3, 33)
LENGTHS_K = (7, 4, 17, 0, 81, 1, 20)


def cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, dtype, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, heads=4, kv_heads=2, d=16, dv=8):
    cq, ck = cu(lengths_q), cu(lengths_k)
    q = random_array((int(cq[-1]), heads, d), dtype, rng)
    k = random_array((int(ck[-1]), kv_heads, d), dtype, rng)
    v = random_array((int(ck[-1]), kv_heads, dv), dtype, rng)
    return q, k, v, cq, ck


def check_call(q, k, v, cq, ck, dtype, rng, **options):
    """Forward (out and stats) and backward against the reference."""
    out, stats = ga.varlen_attention(q, k, v, cq, ck, return_stats=True, **options)
    ref_out, ref_stats = varlen_reference(q, k, v, cq, ck, **options)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, dtype, "out")
    assert_close(stats, ref_stats, np.float32, "stats", testing.STATS_TOLERANCE)
    grad = random_array(out.shape, dtype, rng)
    want_sinks = options.get("sinks") is not None
    grads = ga.varlen_attention_backward(grad, q, k, v, out, stats, cq, ck, return_sinks_grad=want_sinks, **options)
    expected = varlen_reference_backward(grad, q, k, v, cq, ck, **options)
    magnitude = max(float(np.abs(e).max()) for e in expected[:3] if e.size) if q.size and k.size else None
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, expected):
        assert got.shape == want.shape
        assert_grad_close(got, want, dtype, name, magnitude)


# Each candidate with the dtypes it takes (AMX builds take one dtype class each).
CANDIDATE_DTYPES = [("portable", dt) for dt in ("f32", "bf16", "f16")] + \
    [("avx2", dt) for dt in ("f32", "bf16", "f16")] + [("avx512", dt) for dt in ("f32", "bf16", "f16")] + \
    [("amx_bf16", "bf16"), ("amx_bf16x3", "f16"), ("amx_bf16x6", "f32")]


@pytest.mark.parametrize("candidate,dtype", CANDIDATE_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_every_candidate(candidate, dtype, causal, rng):
    skip_unless_runs_here(candidate)
    q, k, v, cq, ck = packed(rng, dtype)
    with ga.force_kernel(candidate):
        check_call(q, k, v, cq, ck, dtype, rng, is_causal=causal)


OPTIONS = {
    "window": dict(window=(6, 2)),
    "causal_window": dict(is_causal=True, window=(9, -1)),
    "top_left": dict(is_causal=True, causal_alignment="top_left"),
    "softcap": dict(softcap=2.5, is_causal=True),
    "alibi_heads": dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32), is_causal=True),
    "alibi_per_sequence": dict(alibi_slopes=np.linspace(0.05, 0.6, 7 * 4).reshape(7, 4).astype(np.float32)),
    "sinks": dict(sinks=np.array([0.3, -1.0, 2.0, 0.0], np.float32), is_causal=True),
    "scale": dict(scale=0.3),
    "dropout": dict(dropout_p=0.3, dropout_seed=1234, dropout_offset=7, is_causal=True),
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_options(name, dtype, rng):
    q, k, v, cq, ck = packed(rng, dtype)
    check_call(q, k, v, cq, ck, dtype, rng, **OPTIONS[name])


@pytest.mark.parametrize("kv_heads,group", [(4, 1), (2, 2), (2, 4), (1, 8)])
@pytest.mark.parametrize("d,dv", [(1, 1), (8, 8), (59, 59), (64, 80), (80, 64), (128, 128), (256, 32)])
def test_heads_and_sizes(kv_heads, group, d, dv, rng):
    q, k, v, cq, ck = packed(rng, "f32", (3, 9, 1, 20), (5, 9, 2, 11), kv_heads * group, kv_heads, d, dv)
    check_call(q, k, v, cq, ck, "f32", rng, is_causal=True)


def test_equals_dense_calls_and_padded_batch(rng):
    """varlen equals each sequence's own dense call (bottom-right) and a padded batch with a key-padding mask."""
    lengths = (9, 30, 1, 17)
    q, k, v, cq, ck = packed(rng, "f32", lengths, lengths)
    out = ga.varlen_attention(q, k, v, cq, ck, is_causal=True)
    for b in range(len(lengths)):
        s = slice(cq[b], cq[b + 1])
        dense = ga.scaled_dot_product_attention(q[s].swapaxes(0, 1), k[s].swapaxes(0, 1), v[s].swapaxes(0, 1),
                                                is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
        assert_close(out[s], dense.swapaxes(0, 1), "f32", f"sequence {b}")
    longest = max(lengths)
    pad = lambda x: np.stack([np.pad(x[cq[b]:cq[b + 1]], ((0, longest - n), (0, 0), (0, 0)))
                              for b, n in enumerate(lengths)]).swapaxes(1, 2)
    keep = np.arange(longest)[None, :] < np.array(lengths)[:, None]          # (B, S): keys each sequence has
    causal = np.tril(np.ones((longest, longest), bool))
    mask = (keep[:, None, :] & causal[None])[:, None]                         # (B, 1, L, S)
    padded = ga.scaled_dot_product_attention(pad(q), pad(k), pad(v), mask, enable_gqa=True).swapaxes(1, 2)
    for b, n in enumerate(lengths):
        assert_close(out[cq[b]:cq[b + 1]], padded[b, :n], "f32", f"padded sequence {b}")


def test_views_of_one_packed_projection(rng):
    """q, k and v as strided views of one (T, 3, H, D) projection are read in place."""
    cq = cu((4, 11, 6))
    qkv = random_array((int(cq[-1]), 3, 4, 16), "bf16", rng)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert not q.flags.c_contiguous
    check_call(q, k, v, cq, cq, "bf16", rng, is_causal=True)


def test_output_into_a_view_writes_nothing_else(rng):
    q, k, v, cq, ck = packed(rng, "f32")
    buffer = np.full((q.shape[0] + 3, 4, 8 + 5), testing.SENTINEL, np.float32)
    view = buffer[1:-2, :, 2:-3]
    result = ga.varlen_attention(q, k, v, cq, ck, is_causal=True, out=view)
    assert result is view
    assert_close(view, varlen_reference(q, k, v, cq, ck, is_causal=True)[0], "f32")
    untouched = np.ones(buffer.shape, bool)
    untouched[1:-2, :, 2:-3] = False
    assert np.all(buffer[untouched] == testing.SENTINEL)


@pytest.mark.parametrize("lengths_q,lengths_k", [((), ()), ((0, 0), (0, 0)), ((0, 3), (2, 0)), ((4,), (0,))])
def test_empty_sequences(lengths_q, lengths_k, rng):
    q, k, v, cq, ck = packed(rng, "f32", lengths_q, lengths_k)
    out, stats = ga.varlen_attention(q, k, v, cq, ck, is_causal=True, return_stats=True)
    assert out.shape == (q.shape[0], 4, 8) and stats.shape == (4, q.shape[0])
    assert np.all(out == 0) and np.all(np.isneginf(stats))
    dq, dk, dv = ga.varlen_attention_backward(np.ones_like(out), q, k, v, out, stats, cq, ck, is_causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


def test_long_sequence_beside_short_ones(rng):
    """One long sequence beside many short ones: every sequence right, and the short ones pooled over the threads
    where there are several."""
    lengths = (300,) + (8, 9) * 15  # no two neighbours alike: 30 runs of one short sequence each
    q, k, v, cq, ck = packed(rng, "f32", lengths, lengths, heads=2, kv_heads=1, d=8, dv=8)
    check_call(q, k, v, cq, ck, "f32", rng, is_causal=True)
    plan = ga.varlen.dispatch_text(q, k, v, cq, ck, is_causal=True)
    assert plan.startswith("layout=packed,sequences=31,")
    if ga.thread_count() > 1:
        assert "team_calls=1," in plan and "pooled_tasks=30," in plan


def test_verbose_log_names_the_plan(rng, capfd):
    q, k, v, cq, ck = packed(rng, "f32")
    ga.set_verbose(1)
    try:
        ga.varlen_attention(q, k, v, cq, ck, is_causal=True)
    finally:
        ga.set_verbose(0)
    lines = capfd.readouterr().err.splitlines()
    assert any(l.startswith("graphattn_verbose,compile,varlen,varlen_forward_cpu,layout=packed,sequences=7,")
               for l in lines), lines
    assert any(l.startswith("graphattn_verbose,exec,varlen,varlen_forward_cpu,sequences=7,") and l.endswith("ms")
               for l in lines), lines


def test_dense_batch_is_one_dense_call(rng):
    q, k, v, cq, ck = packed(rng, "f32", (16,) * 5, (16,) * 5)
    plan = ga.varlen.dispatch_text(q, k, v, cq, ck, is_causal=True)
    assert "team_calls=1,pooled_tasks=0," in plan


BAD_CU = [
    (np.array([0, 2.0, 5.0]), TypeError, "cu_seqlens_q must be int32 or int64"),
    (np.array([[0, 5]], np.int32), ValueError, "cu_seqlens_q must be 1-D"),
    (np.array([1, 5], np.int32), ValueError, "cu_seqlens_q must start at 0"),
    (np.array([0, 4, 3, 5], np.int32), ValueError, "cu_seqlens_q must be non-decreasing"),
    (np.array([0, 2, 4], np.int32), ValueError, "cu_seqlens_q must end at the packed length 5"),
]


@pytest.mark.parametrize("cu_q,error,text", BAD_CU)
def test_bad_cu_seqlens(cu_q, error, text, rng):
    q, k, v, _, _ = packed(rng, "f32", (2, 3), (2, 3))
    with pytest.raises(error, match=text):
        ga.varlen_attention(q, k, v, cu_q, np.array([0, 2, 5], np.int32))


def test_bad_arguments(rng):
    q, k, v, cq, ck = packed(rng, "f32", (2, 3), (2, 3))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have one entry per sequence"):
        ga.varlen_attention(q, k, v, cq, np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="max_seqlen_q is 2, below the longest sequence's 3 rows"):
        ga.varlen_attention(q, k, v, cq, ck, max_seqlen_q=2)
    with pytest.raises(ValueError, match="max_seqlen_k is 1"):
        ga.varlen_attention(q, k, v, cq, ck, 3, 1)
    assert ga.varlen_attention(q, k, v, cq, ck, 40, 40).shape == (5, 4, 8)
    with pytest.raises(ValueError, match=r"q's heads \(4\) must be a multiple"):
        ga.varlen_attention(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), cq, ck)
    with pytest.raises(ValueError, match="q must be 3-D"):
        ga.varlen_attention(q[None], k, v, cq, ck)
    with pytest.raises(TypeError, match="q dtype float64 is not supported"):
        ga.varlen_attention(q.astype(np.float64), k, v, cq, ck)
    with pytest.raises(ValueError, match="out must have shape"):
        ga.varlen_attention(q, k, v, cq, ck, out=np.empty((5, 4, 9), np.float32))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        ga.varlen_attention(q, k, v, cq, ck, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="dropout_seed: the backward"):
        ga.varlen_attention_backward(q[..., :8], q, k, v, q[..., :8], np.zeros((4, 5), np.float32), cq, ck,
                                     dropout_p=0.1)


torch = pytest.importorskip("torch")


def torch_packed(dtype=torch.float32, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, heads=4, kv_heads=2, d=16, dv=8):
    g = torch.Generator().manual_seed(0)
    cq, ck = torch.tensor(cu(lengths_q)), torch.tensor(cu(lengths_k))
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return make(int(cq[-1]), heads, d), make(int(ck[-1]), kv_heads, d), make(int(ck[-1]), kv_heads, dv), cq, ck


def numpy_of(t):
    return t.detach().float().numpy()


@pytest.mark.parametrize("options", [dict(is_causal=True), dict(sinks="grad", window=(5, 0)),
                                     dict(dropout_p=0.2, is_causal=True)])
def test_torch_autograd(options):
    q, k, v, cq, ck = torch_packed()
    sinks = None
    if options.get("sinks") == "grad":
        sinks = torch.tensor([0.3, -1.0, 2.0, 0.0], requires_grad=True)
        options = dict(options, sinks=sinks)
    torch.manual_seed(3)
    out = ga.varlen_attention(q, k, v, cq, ck, **options)
    assert isinstance(out, torch.Tensor) and out.requires_grad
    grad = torch.randn(out.shape)
    out.backward(grad)
    ref_options = dict(options)
    if "dropout_p" in options:  # the seed the call drew from torch's generator
        torch.manual_seed(3)
        ref_options["dropout_seed"] = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    if sinks is not None:
        ref_options["sinks"] = numpy_of(sinks)
    arrays = [numpy_of(x) for x in (q, k, v)]
    assert_close(numpy_of(out), varlen_reference(*arrays, cq.numpy(), ck.numpy(), **ref_options)[0], "f32")
    expected = varlen_reference_backward(grad.numpy(), *arrays, cq.numpy(), ck.numpy(), **ref_options)
    for name, x, want in zip(("q", "k", "v", "sinks"), (q, k, v, sinks), expected):
        assert_grad_close(numpy_of(x.grad), want, "f32", f"d{name}")


def test_torch_compile_does_not_recompile_for_new_lengths():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v, cq, ck: ga.varlen_attention(q, k, v, cq, ck, is_causal=True),
                       backend=counter, fullgraph=True, dynamic=True)
    q, k, v, cq, ck = torch_packed(lengths_k=LENGTHS_Q, dv=12)  # no size equal to len(cu_seqlens): no duck sizing
    for lengths in (LENGTHS_Q, (30, 30, 33, 36), (129,)):
        cq = torch.tensor(cu(lengths))
        out = fn(q, k, v, cq, cq)
        out.sum().backward()
        arrays = [numpy_of(x) for x in (q, k, v)]
        assert_close(numpy_of(out), varlen_reference(*arrays, cq.numpy(), cq.numpy(), is_causal=True)[0], "f32")
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_inference_bf16(dtype):
    q, k, v, cq, ck = torch_packed(dtype)
    with torch.no_grad():
        out = ga.varlen_attention(q, k, v, cq, ck, is_causal=True)
    assert out.dtype == dtype and not out.requires_grad
    arrays = [numpy_of(x) for x in (q, k, v)]
    assert_close(numpy_of(out), varlen_reference(*arrays, cq.numpy(), ck.numpy(), is_causal=True)[0],
                 "bf16" if dtype == torch.bfloat16 else "f32")
