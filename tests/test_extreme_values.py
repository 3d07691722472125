"""Score modifiers and scales at the ends of float32's range: values float32 cannot hold as meant are refused
naming the argument, the value given and the range; representable extremes (an infinite scale under a softcap,
huge or infinite ALiBi slopes, huge or infinite sinks) give the mathematical limit, forward and backward, on every
kernel candidate this CPU runs (each forced in a process of its own), in each dtype; a NaN modifier stays in its
own head.  The float64 reference decides where it is defined there; where it is not (inf * 0, inf - inf) the
limit is asserted as such."""
import os
import re

import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import assert_close, assert_grad_close, random_array, sdpa_reference, sdpa_reference_backward
from subprocess_helpers import run_python
from cpu_helpers import AMX_DTYPES

LEAST_CAP, LARGEST_CAP = ga._cpu.softcap_range()
# (query shape, key shape): square, decode under GQA (key splits), long enough for the AMX builds' tiles.
SHAPES = {
    "square": ((2, 2, 37, 32), (2, 2, 37, 32)),
    "decode_gqa": ((1, 4, 1, 64), (1, 2, 150, 64)),
    "long": ((1, 2, 260, 64), (1, 2, 260, 64)),
}
CALLS = {"plain": {}, "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right")}


def _operands(q_shape, k_shape, dtype, rng):
    q, k = random_array(q_shape, dtype, rng, 2.0), random_array(k_shape, dtype, rng, 2.0)
    v = random_array(k_shape[:-1] + (24,), dtype, rng)
    return q, k, v, q_shape[-3] != k_shape[-3]


def _both_passes(q, k, v, gqa, dtype, rng, **kw):
    out, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, return_stats=True, **kw)
    grad_out = random_array(out.shape, dtype, rng)
    grads = ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats, enable_gqa=gqa,
                                                     return_sinks_grad="sinks" in kw, **kw)
    return out, stats, grad_out, grads


def check_infinite_scale_under_softcap(shape, dtype, call, rng):
    """c * tanh(+-inf * q.k / c) = +-c * sign(q.k): the output is the reference's; no score moves with Q or K."""
    q, k, v, gqa = _operands(*SHAPES[shape], dtype, rng)
    for scale in (np.inf, -np.inf):
        kw = dict(softcap=2.0, scale=scale, **CALLS[call])
        out, stats, grad_out, grads = _both_passes(q, k, v, gqa, dtype, rng, **kw)
        want, want_stats = sdpa_reference(q, k, v, enable_gqa=gqa, return_stats=True, **kw)
        what = f"scale {scale} softcap 2 {shape} {call} {dtype}"
        assert_close(out, want, dtype, f"output {what}")
        assert_close(stats, want_stats, "f32", f"stats {what}", (1e-5, 2e-3))
        assert not np.isnan(out).any() and not any(np.isnan(g.astype(np.float32)).any() for g in grads), what
        assert (grads[0] == 0).all() and (grads[1] == 0).all(), f"dq, dk of saturated scores {what}"
        with np.errstate(invalid="ignore"):  # the reference's dQ and dK are inf * 0 there; its dV is defined
            want_dv = sdpa_reference_backward(grad_out, q, k, v, enable_gqa=gqa, **kw)[2]
        assert_grad_close(grads[2], want_dv, dtype, f"dv {what}")


def check_huge_slopes(shape, dtype, call, rng):
    """A finite slope of any size keeps each row on its nearest key (the reference's result); an infinite one
    gives the same limit; a NaN slope makes its own head NaN and no other."""
    q, k, v, gqa = _operands(*SHAPES[shape], dtype, rng)
    heads = q.shape[-3]
    slopes = np.full(heads, 3e38, np.float32)
    slopes[0] = 0.25  # an ordinary head beside them
    kw = dict(alibi_slopes=slopes, **CALLS[call])
    out, stats, grad_out, grads = _both_passes(q, k, v, gqa, dtype, rng, **kw)
    want = sdpa_reference(q, k, v, enable_gqa=gqa, **kw)
    what = f"slopes 3e38 {shape} {call} {dtype}"
    assert_close(out, want, dtype, f"output {what}")
    want_grads = sdpa_reference_backward(grad_out, q, k, v, enable_gqa=gqa, **kw)
    magnitude = max(float(np.abs(g).max()) for g in want_grads[:3])
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_grad_close(got, expected, dtype, f"{name} {what}", magnitude)
    limit = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, alibi_slopes=np.where(slopes > 1, np.inf, slopes)
                                            .astype(np.float32), **CALLS[call])
    np.testing.assert_array_equal(limit, out, err_msg=f"infinite slopes against 3e38 {what}")
    slopes[heads - 1] = np.nan
    confined = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, alibi_slopes=slopes, **CALLS[call])
    assert np.isnan(confined[..., heads - 1, :, :].astype(np.float32)).all(), what
    np.testing.assert_array_equal(confined[..., :heads - 1, :, :], out[..., :heads - 1, :, :], err_msg=what)


def check_huge_sinks(shape, dtype, call, rng):
    """A sink of +inf, or finite past float32's base-2 range, takes every row's weight: output 0, stats +inf,
    every gradient 0 (the sinks' included); the other heads are the reference's, and a NaN sink stays in its head."""
    q, k, v, gqa = _operands(*SHAPES[shape], dtype, rng)
    heads = q.shape[-3]
    for big in (np.inf, 2.4e38, 3.4e38):
        sinks = rng.standard_normal(heads).astype(np.float32)
        sinks[1:] = big
        kw = dict(sinks=sinks, **CALLS[call])
        out, stats, grad_out, grads = _both_passes(q, k, v, gqa, dtype, rng, **kw)
        what = f"sinks {big} {shape} {call} {dtype}"
        assert (out[..., 1:, :, :] == 0).all(), f"output {what}"
        assert (stats[..., 1:, :, :] == np.inf).all(), f"stats {what}"
        want, want_stats = sdpa_reference(q[..., :1, :, :], k[..., :1, :, :], v[..., :1, :, :], return_stats=True,
                                          sinks=sinks[:1], **CALLS[call])
        assert_close(out[..., :1, :, :], want, dtype, f"ordinary head beside {what}")
        dq, dk, dv, dsinks = grads
        assert (dq[..., 1:, :, :] == 0).all(), f"dq {what}"
        assert np.isfinite(dk.astype(np.float32)).all() and np.isfinite(dv.astype(np.float32)).all(), what
        assert (dsinks[1:] == 0).all() and np.isfinite(dsinks[0]), f"dsinks {what}"
    sinks = np.zeros(heads, np.float32)
    sinks[0] = np.nan
    out = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, sinks=sinks, **CALLS[call])
    want = sdpa_reference(q, k, v, enable_gqa=gqa, sinks=np.zeros(heads, np.float32), **CALLS[call])
    assert np.isnan(out[..., 0, :, :].astype(np.float32)).all()
    assert_close(out[..., 1:, :, :], want[..., 1:, :, :], dtype, "heads beside a NaN sink")


def check_softcap_range_ends(shape, dtype, call, rng):
    """The least and the largest softcap the kernels take run and match the reference."""
    q, k, v, gqa = _operands(*SHAPES[shape], dtype, rng)
    for cap in (LEAST_CAP, LARGEST_CAP):
        out = ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, softcap=cap, **CALLS[call])
        assert_close(out, sdpa_reference(q, k, v, enable_gqa=gqa, softcap=cap, **CALLS[call]), dtype,
                     f"softcap {cap} {shape} {call} {dtype}")


CHECKS = {"infinite_scale": check_infinite_scale_under_softcap, "huge_slopes": check_huge_slopes,
          "huge_sinks": check_huge_sinks, "softcap_range_ends": check_softcap_range_ends}


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_extreme_modifier_values_give_the_limit(check, shape, call, dtype, rng):
    CHECKS[check](shape, dtype, call, rng)


KERNEL_SCRIPT = """
import itertools, numpy as np
import test_extreme_values as t
rng = np.random.default_rng(11)
for check, dtype, shape, call in itertools.product(sorted(t.CHECKS), DTYPES, sorted(t.SHAPES), sorted(t.CALLS)):
    t.CHECKS[check](shape, dtype, call, rng)
print("ok")
"""


@pytest.mark.parametrize("kernel", [name for name, _ in ga.kernel_candidates("forward")])
def test_extreme_values_on_each_kernel_candidate(kernel):
    """Each candidate forced on both passes (where the pass has it), two threads: splits and pieces of work."""
    here = os.path.dirname(__file__)
    dtypes = list(AMX_DTYPES.get(kernel, ("f32", "bf16", "f16")))
    script = f"import sys; sys.path.insert(0, {here!r})\nDTYPES = {dtypes!r}\n" + KERNEL_SCRIPT
    assert run_python(script, kernel, OMP_NUM_THREADS="2").strip().endswith("ok")


@pytest.mark.parametrize("value", [1e-39, 1e-45, 1e-50, 1e39, 3e38, LARGEST_CAP * 1.0000001, LEAST_CAP / 2, 0.0, -1.0,
                                   float("inf"), float("nan")])
def test_softcaps_float32_cannot_hold_are_refused(value, rng):
    q = random_array((1, 2, 8, 16), "f32", rng)
    out, stats = ga.scaled_dot_product_attention(q, q, q, return_stats=True)
    text = repr(value)
    for call in (lambda: ga.scaled_dot_product_attention(q, q, q, softcap=value),
                 lambda: ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, softcap=value)):
        with pytest.raises(ValueError) as caught:
            call()
        message = str(caught.value)
        assert message.startswith("softcap must be within [") and f"got {text}" in message, message
        assert f"{LEAST_CAP:.9g}" in message and f"{LARGEST_CAP:.9g}" in message, message


@pytest.mark.parametrize("value", [1e39, -1e39, 3e38, -2.4e38])
def test_finite_scales_past_float32s_base2_range_are_refused(value, rng):
    q = random_array((1, 2, 8, 16), "f32", rng)
    with pytest.raises(ValueError, match=r"scale must be within \+-.*got " + re.escape(repr(value))):
        ga.scaled_dot_product_attention(q, q, q, scale=value)


def test_torch_softcap_errors_name_the_value_given():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"softcap must be within .*got 1e\+39"):
        ga.scaled_dot_product_attention(q, q, q, softcap=1e39)


def test_infinite_sinks_through_torch_autograd_give_zero_gradients():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 9, 16, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([float("inf"), 0.5], requires_grad=True)
    out = ga.scaled_dot_product_attention(q, k, v, sinks=sinks)
    out.sum().backward()
    assert (out[:, 0] == 0).all() and not torch.isnan(out).any()
    assert sinks.grad[0] == 0 and torch.isfinite(sinks.grad).all()
    assert (q.grad[:, 0] == 0).all() and not any(torch.isnan(t.grad).any() for t in (q, k, v))


def test_alibi_slopes_that_require_grad_are_refused():
    """The kernels give the slopes no gradient: a call whose slopes require grad is refused by name, rather than
    leaving their .grad None (or, where only the slopes require grad, returning a result with no grad_fn)."""
    torch = pytest.importorskip("torch")
    slopes = torch.full((2,), 0.5, requires_grad=True)
    for needs_grad in (True, False):
        q = torch.randn(1, 2, 8, 16, requires_grad=needs_grad)
        with pytest.raises(ValueError, match="alibi_slopes requires grad.*alibi_slopes.detach()"):
            ga.scaled_dot_product_attention(q, q, q, alibi_slopes=slopes)
    with torch.no_grad():  # nothing asks for a gradient there
        ga.scaled_dot_product_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
                                        torch.randn(1, 2, 8, 16), alibi_slopes=slopes)
    out = ga.scaled_dot_product_attention(q, q, q, alibi_slopes=slopes.detach())
    assert out.shape == (1, 2, 8, 16)


@pytest.mark.parametrize("seed", range(24))
def test_fuzz_extreme_modifiers(seed):
    """Seeded draws of extreme and ordinary modifier values together, on random shapes and calls: each head's
    output and stats are those of its own call alone (a head's extreme value changes no other head), never NaN,
    0 and +inf under a sink past float32's base-2 range, the reference's under ordinary slopes."""
    r = np.random.default_rng(seed)
    dtype = ["f32", "bf16", "f16"][int(r.integers(3))]
    heads, seq_q, seq_kv = int(r.integers(2, 5)), int(r.choice([1, 5, 33, 70])), int(r.choice([1, 9, 64, 130]))
    dim = int(r.choice([8, 32, 64]))
    q, k, v = (random_array((1, heads, n, dim), dtype, r, 2.0) for n in (seq_q, seq_kv, seq_kv))
    pick = lambda values: np.array([values[int(i)] for i in r.integers(len(values), size=heads)], np.float32)  # noqa: E731
    kw = dict(alibi_slopes=pick([0.0, 0.5, 3e38, np.inf]), sinks=pick([-1.0, 0.0, 2.0, 3e38, np.inf]),
              softcap=float(r.choice([LEAST_CAP, 1.0, 30.0, LARGEST_CAP])),
              is_causal=bool(r.random() < 0.5), causal_alignment="bottom_right")
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **kw)
    for h in range(heads):
        alone = dict(kw, alibi_slopes=kw["alibi_slopes"][h:h + 1], sinks=kw["sinks"][h:h + 1])
        one, one_stats = ga.scaled_dot_product_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], return_stats=True,
                                                         **alone)
        # the same rule on other work items: equal within the dtype's rounding, infinities where they are
        assert_close(out[:, h:h + 1], one, dtype, f"seed {seed} head {h} beside the others")
        assert (np.isinf(stats[:, h:h + 1]) == np.isinf(one_stats)).all(), f"seed {seed} head {h}"
        assert_close(np.where(np.isinf(one_stats), 0, stats[:, h:h + 1]), np.where(np.isinf(one_stats), 0, one_stats),
                     "f32", f"seed {seed} head {h} stats", (1e-5, 2e-3))
        assert not np.isnan(one.astype(np.float32)).any(), f"seed {seed} head {h} {alone}"
        if np.isinf(alone["sinks"][0]) or alone["sinks"][0] > 2.35e38:
            assert (one == 0).all() and (one_stats == np.inf).all()
        elif alone["alibi_slopes"][0] < 1:
            want = sdpa_reference(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], **alone)
            assert_close(one, want, dtype, f"seed {seed} head {h}")
