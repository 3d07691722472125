"""graphattn.flash_attn: flash-attn 2's functions, signatures and return conventions, against the reference."""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import graphattn.flash_attn as fa  # noqa: E402
from graphattn.testing import assert_close, assert_grad_close, sdpa_reference, varlen_reference  # noqa: E402
from graphattn.testing import sdpa_reference_backward  # noqa: E402


def test_signatures_are_flash_attn_2s():
    names = lambda f: list(inspect.signature(f).parameters)
    assert names(fa.flash_attn_func) == ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size",
                                         "softcap", "alibi_slopes", "deterministic", "return_attn_probs"]
    assert names(fa.flash_attn_varlen_func) == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
        "causal", "window_size", "softcap", "alibi_slopes", "deterministic", "return_attn_probs", "block_table"]
    defaults = inspect.signature(fa.flash_attn_func).parameters
    assert defaults["window_size"].default == (-1, -1) and defaults["softcap"].default == 0.0


def _tensors(b, sq, sk, h, hk, d, dv=None):
    g = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).requires_grad_()
    return make(b, sq, h, d), make(b, sk, hk, d), make(b, sk, hk, dv or d)


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window_size=(3, 0)),
                                     dict(softcap=3.0, softmax_scale=0.2), dict(causal=False, window_size=(2, 2)),
                                     dict(alibi_slopes="heads", causal=True), dict(alibi_slopes="batch")])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (1, 7)])
def test_flash_attn_func(options, sq, sk):
    q, k, v = _tensors(2, sq, sk, 4, 2, 16, 8)
    slopes = {"heads": torch.tensor([0.5, 0.25, 0.1, 0.05]), "batch": torch.rand(2, 4)}.get(options.get("alibi_slopes"))
    options = dict(options, alibi_slopes=slopes)
    out, lse, probs = fa.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert out.shape == (2, sq, 4, 8) and lse.shape == (2, 4, sq) and probs is None
    t = lambda x: x.detach().numpy().swapaxes(1, 2)
    ref_options = dict(is_causal=options.get("causal", False), window=options.get("window_size"),
                       scale=options.get("softmax_scale"), softcap=options.get("softcap"),
                       alibi_slopes=None if slopes is None else slopes.numpy(), causal_alignment="bottom_right")
    ref, stats = sdpa_reference(t(q), t(k), t(v), enable_gqa=True, return_stats=True, **ref_options)
    assert_close(out.detach().numpy(), ref.swapaxes(1, 2), "f32")
    assert_close(lse.numpy(), np.where(np.isneginf(stats[..., 0]), np.inf, stats[..., 0]), "f32", "lse", (1e-4, 1e-4))
    grad = torch.randn(out.shape)
    out.backward(grad)
    expected = sdpa_reference_backward(t(grad), t(q), t(k), t(v), enable_gqa=True, **ref_options)
    for name, x, want in zip("qkv", (q, k, v), expected):
        assert_grad_close(x.grad.numpy(), want.swapaxes(1, 2), "f32", f"d{name}")


def test_flash_attn_varlen_func():
    lengths_q, lengths_k = (3, 0, 8, 1), (5, 2, 8, 0)
    cq = torch.tensor(np.cumsum((0,) + lengths_q), dtype=torch.int32)
    ck = torch.tensor(np.cumsum((0,) + lengths_k), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(int(c[-1]), h, 16, generator=g) for c, h in ((cq, 4), (ck, 2), (ck, 2)))
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cq, ck, 8, 8, causal=True, return_attn_probs=True)
    assert lse.shape == (4, int(cq[-1])) and probs is None
    ref, stats = varlen_reference(q.numpy(), k.numpy(), v.numpy(), cq.numpy(), ck.numpy(), is_causal=True)
    assert_close(out.numpy(), ref, "f32")
    assert_close(lse.numpy(), np.where(np.isneginf(stats), np.inf, stats), "f32", "lse", (1e-4, 1e-4))
    assert np.isposinf(lse.numpy()[:, cq[3]:]).all()  # the sequence without keys
    packed = fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cq, ck, 8, 8, causal=True)
    assert torch.equal(packed, out)


def test_unsupported_and_bad_arguments():
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q is 3"):
        fa.flash_attn_varlen_func(q, q, q, cu, cu, 3, 4)
    with pytest.raises(ValueError, match="q must be 4-D"):
        fa.flash_attn_func(q, q, q)


def test_qkvpacked_reads_views():
    qkv = torch.randn(2, 6, 3, 4, 8)
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv, causal=True),
                       fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))
