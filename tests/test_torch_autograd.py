"""torch tensors that require grad get a differentiable result whose backward is graphattn's fused backward
(issue 39's autograd part): gradients against float64 PyTorch SDPA, partial requires_grad, no_grad and
inference_mode, dropout seeds from torch's generator, stats alongside."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import assert_close, assert_grad_close, sdpa_reference, sdpa_reference_backward

torch = pytest.importorskip("torch")
F = torch.nn.functional

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}

CASES = {
    "plain": dict(q=(2, 4, 33, 32), kv=(2, 4, 47, 32), ev=16),
    "causal": dict(q=(2, 4, 33, 32), kv=(2, 4, 47, 32), ev=32, is_causal=True),
    "gqa": dict(q=(1, 8, 20, 48), kv=(1, 2, 70, 48), ev=32, enable_gqa=True),
    "cross": dict(q=(2, 3, 9, 16), kv=(2, 3, 130, 16), ev=16),
    "decode": dict(q=(2, 4, 1, 64), kv=(2, 4, 77, 64), ev=64),
    "float_mask": dict(q=(2, 4, 33, 32), kv=(2, 4, 47, 32), ev=32, mask="float"),
    "bool_mask": dict(q=(2, 4, 33, 32), kv=(2, 4, 47, 32), ev=32, mask="bool"),
}


def _operands(case, dtype, generator):
    tdt = TORCH_DTYPES[dtype]
    spec = CASES[case]
    make = lambda shape: torch.randn(shape, generator=generator).to(tdt).requires_grad_()  # noqa: E731
    q, k = make(spec["q"]), make(spec["kv"])
    v = make(spec["kv"][:-1] + (spec["ev"],))
    mask = None
    if spec.get("mask") == "float":
        mask = make((1, 1) + spec["q"][-2:-1] + spec["kv"][-2:-1])
    elif spec.get("mask") == "bool":
        mask = torch.rand((1, 1) + spec["q"][-2:-1] + spec["kv"][-2:-1], generator=generator) < 0.8
    flags = {name: spec[name] for name in ("is_causal", "enable_gqa") if name in spec}
    return q, k, v, mask, flags


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_float64_torch(case, dtype):
    generator = torch.Generator().manual_seed(7)
    q, k, v, mask, flags = _operands(case, dtype, generator)
    out = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask, **flags)
    assert out.requires_grad and out.grad_fn is not None
    grad_out = torch.randn(out.shape, generator=generator).to(out.dtype)
    out.backward(grad_out)
    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    reference = [x.detach().double().requires_grad_() for x in leaves]
    ref_mask = reference[3] if len(reference) > 3 else mask
    expected = F.scaled_dot_product_attention(*reference[:3], attn_mask=ref_mask, **flags)
    expected.backward(grad_out.double())
    np.testing.assert_allclose(out.detach().double().numpy(), expected.detach().numpy(),
                               **dict(zip(("rtol", "atol"), ga.testing.TOLERANCES[ga.DataType(dtype)])))
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), leaves, reference):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert_grad_close(got.grad.double().numpy(), want.grad.numpy(), dtype, name)


def test_partial_requires_grad_no_grad_and_inference_mode():
    q = torch.randn(1, 2, 16, 32, requires_grad=True)
    k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    out = ga.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None
    reference = q.detach().requires_grad_()
    F.scaled_dot_product_attention(reference, k, v, is_causal=True).sum().backward()
    assert_grad_close(q.grad.numpy(), reference.grad.numpy(), "f32", "dq")
    with torch.no_grad():
        assert not ga.scaled_dot_product_attention(q, k, v).requires_grad
    with torch.inference_mode():
        assert not ga.scaled_dot_product_attention(q, k, v).requires_grad


def test_return_stats_with_grad_gives_stats_without_grad():
    q = torch.randn(1, 2, 16, 32, requires_grad=True)
    out, stats = ga.scaled_dot_product_attention(q, q.detach(), q.detach(), return_stats=True)
    assert out.requires_grad and not stats.requires_grad and stats.shape == (1, 2, 16, 1)
    expected = torch.logsumexp(q.detach() @ q.detach().transpose(-1, -2) / 32 ** 0.5, dim=-1, keepdim=True)
    torch.testing.assert_close(stats, expected, rtol=1e-4, atol=1e-4)


def test_dropout_draws_its_seed_from_torch_and_the_backward_reuses_it():
    """torch.manual_seed repeats the keep-mask; the gradient is that of the same mask (the backward gets the
    forward's seed), checked against graphattn's own backward given that seed."""
    q = torch.randn(1, 2, 24, 32, requires_grad=True)
    k, v = torch.randn(1, 2, 24, 32), torch.randn(1, 2, 24, 32)
    torch.manual_seed(11)
    first = ga.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(11)
    again = ga.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    grad_out = torch.randn(first.shape)
    first.backward(grad_out)
    out, stats = ga.scaled_dot_product_attention(q.detach(), k, v, dropout_p=0.3, dropout_seed=seed,
                                                 return_stats=True)
    torch.testing.assert_close(out, first.detach(), rtol=0, atol=0)
    dq, _, _ = ga.scaled_dot_product_attention_backward(grad_out, q.detach(), k, v, out, stats, dropout_p=0.3,
                                                        dropout_seed=seed)
    torch.testing.assert_close(q.grad, dq, rtol=0, atol=0)


def test_torch_compile_fullgraph_takes_dropout_without_a_seed():
    """dropout_p > 0 and no seed under torch.compile(fullgraph=True): the seed is drawn in the graph as a
    tensor (no graph break), the backward reuses it, and torch.manual_seed repeats the result."""
    def attend(q, k, v):
        return ga.scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    # fallback_random: the compiled graph draws from torch's eager generator, so the eager call below can
    # rebuild the seed it drew
    from torch._inductor import config as inductor_config

    compiled = torch.compile(attend, fullgraph=True)
    q, k, v = (torch.randn(1, 2, 12, 16, requires_grad=True) for _ in range(3))
    with inductor_config.patch(fallback_random=True):
        _check_compiled_dropout(compiled, q, k, v)


def _check_compiled_dropout(compiled, q, k, v):
    """The compiled dropout call: repeatable under torch.manual_seed, and equal (output and gradients) to the
    eager call given the seed the compiled graph drew."""
    torch.manual_seed(7)
    first = compiled(q, k, v)
    torch.manual_seed(7)
    again = compiled(q, k, v)
    assert torch.equal(first, again)
    with torch.no_grad():
        assert not torch.allclose(first, ga.scaled_dot_product_attention(q, k, v)), "dropout dropped nothing"
    grad = torch.randn_like(first)
    first.backward(grad)
    # the same seed through the eager ops gives the same output and gradients
    dq, dk, dv = q.grad.clone(), k.grad.clone(), v.grad.clone()
    q.grad = k.grad = v.grad = None
    torch.manual_seed(7)
    seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
    eager = ga.scaled_dot_product_attention(q, k, v, dropout_p=0.3, dropout_seed=seed)
    assert torch.equal(eager, first)
    eager.backward(grad)
    for got, want in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_traces_forward_and_backward_at_any_length():
    """One graph serves every length (dynamic=True): each call's output and gradient match torch's SDPA."""
    torch._dynamo.reset()

    def attend(q, k, v):
        return ga.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)
    for length in (16, 33, 70):
        q = torch.randn(1, 2, length, 32, requires_grad=True)
        k, v = torch.randn(1, 2, length, 32), torch.randn(1, 2, length, 32)
        out = compiled(q, k, v)
        out.sum().backward()
        reference = q.detach().requires_grad_()
        expected = F.scaled_dot_product_attention(reference, k, v, is_causal=True)
        expected.sum().backward()
        torch.testing.assert_close(out.detach(), expected.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(q.grad, reference.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert compiled(q.detach(), k, v).shape == (1, 2, 70, 32)


def test_custom_ops_pass_opcheck():
    from graphattn import torch_autograd

    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 8)
    mask = torch.randn(1, 1, 9, 11)
    window = [4, 2]  # a key window (left, right), as scaled_dot_product_attention's window=
    torch.library.opcheck(torch_autograd.sdpa_forward,
                          (q, k, v, mask, 0.0, False, None, False, "top_left", 0, 0, window, None, None, None, None))
    out, stats = torch_autograd.sdpa_forward(q.detach(), k, v, mask, 0.0, False, None, False, "top_left", 0, 0, window,
                                             None, None, None, None)
    torch.library.opcheck(torch_autograd.sdpa_backward, (torch.randn(out.shape), q.detach(), k, v, out, stats, mask,
                                                         0.0, False, None, False, "top_left", 0, 0, window, None, None,
                                                         None, None, True, False))
    # with the score modifiers: softcap, ALiBi slopes and sinks that require grad
    slopes = torch.rand(2) * 0.3
    sinks = torch.randn(2, requires_grad=True)
    modified = (q, k, v, None, 0.0, True, None, False, "top_left", 0, 0, [-1, -1], 4.0, slopes, sinks, None)
    torch.library.opcheck(torch_autograd.sdpa_forward, modified)
    out, stats = torch_autograd.sdpa_forward(q.detach(), k, v, None, 0.0, True, None, False, "top_left", 0, 0,
                                             [-1, -1], 4.0, slopes, sinks.detach(), None)
    torch.library.opcheck(torch_autograd.sdpa_backward, (torch.randn(out.shape), q.detach(), k, v, out, stats, None,
                                                         0.0, True, None, False, "top_left", 0, 0, [-1, -1], 4.0,
                                                         slopes, sinks.detach(), None, False, True))
    # dropout with its seed as a tensor (as a traced call draws it)
    seed = torch.tensor(1234, dtype=torch.int64)
    dropped = (q, k, v, None, 0.2, False, None, False, "top_left", 0, 0, [-1, -1], None, None, None, seed)
    torch.library.opcheck(torch_autograd.sdpa_forward, dropped)


@pytest.mark.parametrize("window, alignment", [((3, 0), "top_left"), ((5, 2), "bottom_right"), ((-1, 4), "top_left")])
def test_gradients_flow_through_a_key_window(window, alignment):
    q = torch.randn(1, 2, 13, 16, dtype=torch.float64).float().requires_grad_()
    k = torch.randn(1, 2, 21, 16).requires_grad_()
    v = torch.randn(1, 2, 21, 8).requires_grad_()
    out = ga.scaled_dot_product_attention(q, k, v, window=window, causal_alignment=alignment)
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)
    want = sdpa_reference(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), window=window,
                          causal_alignment=alignment)
    assert_close(out.detach().numpy(), want, "f32", "output")
    want_grads = sdpa_reference_backward(grad_out.numpy(), q.detach().numpy(), k.detach().numpy(),
                                         v.detach().numpy(), window=window, causal_alignment=alignment)
    for got, expected in zip((q.grad, k.grad, v.grad), want_grads):
        assert_grad_close(got.numpy(), expected, "f32")


COMPILE_COUNT_SCRIPT = """
import torch, torch._dynamo
import graphattn as ga
torch._dynamo.config.error_on_recompile = True  # a second compile of the same function raises
compiled = torch.compile(lambda q, k, v: ga.scaled_dot_product_attention(q, k, v, is_causal=True), fullgraph=True,
                         dynamic=True)
for length in (16, 16, 40, 7):
    q, k, v = (torch.randn(1, 2, length, 32, requires_grad=True) for _ in range(3))
    compiled(q, k, v).sum().backward()
eager = ga.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())  # eager calls after it change nothing
compiled(q, k, v)
print("compiles", torch._dynamo.utils.counters["stats"]["unique_graphs"])
"""


def test_torch_compile_compiles_once_from_a_fresh_process():
    """The first compiled call of a fresh process, where graphattn has seen no torch tensor yet, compiles once:
    no guard on module state that the trace itself changes, so later calls (other lengths, an eager call
    between) reuse the graph."""
    pytest.importorskip("torch")
    from subprocess_helpers import run_python

    assert run_python(COMPILE_COUNT_SCRIPT).split()[-1] == "1"
