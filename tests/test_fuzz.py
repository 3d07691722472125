"""Seeded fuzzing of the functional API against the float64 reference, forward and backward.

Each case draws its own shapes (odd sizes, single rows and keys, block edges), dtype, layouts of every operand
(dense, transposed, reversed, sliced, broadcast), mask (none, bool, float, of any broadcast shape), GQA, causal
alignment, scale and array kind (NumPy or torch) from its seed, so a failure names the seed that replays it.
CI runs the first FAST_CASES; the rest are slow cases (a sample in CI, all with --run-slow).  The kernel path a
case takes follows from its shape and dtype: on a CPU with AMX the bf16, f16 and large f32 cases reach the AMX
builds, elsewhere the vector build.
"""
from dataclasses import dataclass

import numpy as np
import pytest

import graphattn as ga
from graphattn.dtypes import as_data_type, numpy_dtype
from graphattn.testing import (STATS_TOLERANCE, assert_close, assert_grad_close, sdpa_reference,
                               sdpa_reference_backward)

FAST_CASES = 48
ALL_CASES = 1000
LAYOUTS = ("dense", "transposed", "reversed", "sliced", "broadcast")


@dataclass
class Case:
    seed: int
    dtype: str
    batch: tuple
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    layouts: dict
    mask: str
    mask_shape: tuple | None
    causal: bool
    alignment: str
    scale: float | None
    as_torch: bool
    backward: bool

    @property
    def gqa(self) -> bool:
        return self.heads_q != self.heads_kv


def draw(seed: int) -> Case:
    r = np.random.default_rng(seed)
    pick = lambda options: options[int(r.integers(len(options)))]  # noqa: E731 - a one-line chooser
    heads_kv = int(pick([1, 1, 2, 3]))
    heads_q = heads_kv * int(pick([1, 1, 2, 4]))
    seq_q = int(pick([1, 2, 7, 16, 33, 64, 100, 129, 200]))
    seq_kv = int(pick([1, 3, 17, 64, 127, 128, 129, 257, 300]))
    head_dim = int(pick([1, 8, 16, 31, 64, 80, 128]))
    head_dim_v = head_dim if r.random() < 0.7 else int(pick([1, 16, 40, 64]))
    batch = tuple(int(pick([1, 2, 3])) for _ in range(int(pick([1, 1, 2]))))
    mask = pick(["none", "none", "bool", "float"])
    mask_shape = None
    if mask != "none":
        full = batch + (heads_q, seq_q, seq_kv)
        mask_shape = tuple(d if r.random() < 0.6 else 1 for d in full[:-2]) + full[-2:]
        mask_shape = mask_shape[int(r.integers(len(mask_shape) - 1)):]  # fewer leading dims broadcast too
    causal = mask == "none" and r.random() < 0.5
    return Case(seed=seed, dtype=pick(["f32", "bf16", "f16"]), batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, head_dim_v=head_dim_v,
                layouts={name: pick(LAYOUTS) for name in ("query", "key", "value", "grad_out")},
                mask=mask, mask_shape=mask_shape, causal=causal,
                alignment=pick(["top_left", "bottom_right"]),
                # the softmax temperatures of real models: 1 / sqrt(E) times 1/4 to 2 (the tolerances are per
                # dtype for scores of that size; far sharper ones amplify every input's rounding)
                scale=None if r.random() < 0.6 else float(r.uniform(0.25, 2) / np.sqrt(head_dim)),
                as_torch=r.random() < 0.3, backward=r.random() < 0.5)


def laid_out(values: np.ndarray, layout: str, r: np.random.Generator) -> np.ndarray:
    """values (..., rows, cols) as a view of the given layout holding the same elements."""
    if layout == "transposed":  # rows and heads swapped in memory, as (N, S, H, E) tensors viewed as (N, H, S, E)
        return np.ascontiguousarray(np.swapaxes(values, -2, -3)).swapaxes(-2, -3) if values.ndim >= 3 else values
    if layout == "reversed":  # negative row stride
        return np.ascontiguousarray(values[..., ::-1, :])[..., ::-1, :]
    if layout == "sliced":  # every other row and column of a larger buffer
        big = np.empty(values.shape[:-2] + (2 * values.shape[-2], 2 * values.shape[-1] + 1), values.dtype)
        big[...] = r.standard_normal(big.shape).astype(values.dtype)  # the gaps hold other numbers
        view = big[..., ::2, 1::2]
        view[...] = values
        return view
    if layout == "broadcast" and values.ndim > 2 and values.shape[0] > 1:  # one batch row, stride 0 over the rest
        return np.broadcast_to(values[:1], values.shape)
    return values


def operands(case: Case):
    r = np.random.default_rng(case.seed + 10**6)
    dt = numpy_dtype(as_data_type(case.dtype))

    def make(shape, layout):
        values = r.standard_normal(shape).astype(dt)
        view = laid_out(values, layout, r)
        return view

    q = make(case.batch + (case.heads_q, case.seq_q, case.head_dim), case.layouts["query"])
    k = make(case.batch + (case.heads_kv, case.seq_kv, case.head_dim), case.layouts["key"])
    v = make(case.batch + (case.heads_kv, case.seq_kv, case.head_dim_v), case.layouts["value"])
    mask = None
    if case.mask == "bool":
        mask = r.random(case.mask_shape) < 0.8
    elif case.mask == "float":
        mask = r.standard_normal(case.mask_shape).astype(np.float32 if r.random() < 0.5 else dt)
    return q, k, v, mask


def check(case: Case) -> None:
    q, k, v, mask = operands(case)
    kwargs = dict(attn_mask=mask, is_causal=case.causal, scale=case.scale, enable_gqa=case.gqa)
    if case.as_torch:
        torch = pytest.importorskip("torch")
        bf16 = numpy_dtype(as_data_type("bf16"))

        def wrap(a):  # torch has no negative strides and no read-only tensors: those layouts are copied
            if a is None:
                return None
            if not a.flags.writeable or any(s < 0 for s in a.strides):
                a = np.ascontiguousarray(a)
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == bf16 else torch.from_numpy(a)

        def unwrap(t):
            return t.view(torch.int16).numpy().view(bf16) if t.dtype == torch.bfloat16 else t.numpy()
    else:
        wrap = unwrap = lambda a: a  # noqa: E731
    out, stats = ga.scaled_dot_product_attention(wrap(q), wrap(k), wrap(v), attn_mask=wrap(mask), is_causal=case.causal,
                                                 scale=case.scale, enable_gqa=case.gqa,
                                                 causal_alignment=case.alignment, return_stats=True)
    expected, expected_stats = sdpa_reference(q, k, v, causal_alignment=case.alignment, return_stats=True, **kwargs)
    assert_close(unwrap(out), expected, case.dtype, f"seed {case.seed} output")
    assert_close(unwrap(stats), expected_stats, "f32", f"seed {case.seed} stats", STATS_TOLERANCE)
    if not case.backward:
        return
    r = np.random.default_rng(case.seed + 2 * 10**6)
    do = laid_out(r.standard_normal(expected.shape).astype(q.dtype), case.layouts["grad_out"], r)
    grads = ga.scaled_dot_product_attention_backward(wrap(do), wrap(q), wrap(k), wrap(v), out, stats,
                                                     attn_mask=wrap(mask), is_causal=case.causal, scale=case.scale,
                                                     enable_gqa=case.gqa, causal_alignment=case.alignment)
    want = sdpa_reference_backward(do, q, k, v, causal_alignment=case.alignment, **kwargs)
    magnitude = max(float(np.abs(g).max()) if g.size else 0.0 for g in want[:3])
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv")):
        assert_grad_close(unwrap(got), ref, case.dtype, f"seed {case.seed} {name}", magnitude)


@pytest.mark.parametrize("seed", range(FAST_CASES))
def test_fuzz(seed):
    check(draw(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(FAST_CASES, ALL_CASES))
def test_fuzz_long(seed):
    check(draw(seed))
