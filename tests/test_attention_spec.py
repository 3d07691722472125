"""attention_spec.py: one description of a call and its one lowering, shared by the functional forward, the
functional backward and the fused partitions of the graph API."""
import dataclasses

import numpy as np
import pytest

import graphattn as ga
from graphattn import _cpu, forward_call, functional_backward
from graphattn.attention_spec import AttentionSpec, NotUsable, Operand, kernel_window, lower
from graphattn.dtypes import DataType
from graphattn.logical_tensor import dense_strides
from graphattn.testing import (assert_close, assert_grad_close, random_array, sdpa_reference,
                               sdpa_reference_backward)


def _spec(batch, seq_q=5, seq_kv=7, d=4, **roles):
    operands = {}
    for role, rows, cols in (("query", seq_q, d), ("key", seq_kv, d), ("value", seq_kv, d), ("output", seq_q, d)):
        shape = batch + (rows, cols)
        operands[role] = Operand(DataType.f32, shape, dense_strides(shape))
    operands.update(roles)
    return AttentionSpec("forward", batch, seq_q, seq_kv, d, d, operands)


def test_any_number_of_contiguous_batch_dims_folds_into_three():
    call = lower(_spec((2, 3, 2, 2, 3)))
    assert len(call.batch) == 3 and np.prod(call.batch) == 2 * 3 * 2 * 2 * 3
    assert call.roles["query"][1][-2:] == (4, 1)


def test_size_one_dims_broadcast_with_stride_zero():
    """A bool mask of one row serves every query row and batch index: stride 0 over all but its columns."""
    spec = _spec((2, 3), mask=Operand(DataType.boolean, (1, 7), (7, 1)))
    call = lower(dataclasses.replace(spec, mask_kind="select"))
    assert call.roles["mask"][1][-2:] == (0, 1) and set(call.roles["mask"][1][:3]) == {0}


def test_lowering_says_why_it_cannot():
    batch = (2, 3, 4, 5)
    shape = batch + (5, 4)
    strides = dense_strides(shape)
    # dims 0 and 2 swapped: the four dims walk no two adjacent ones as one, for Q only
    odd = Operand(DataType.f32, shape, (strides[2], strides[1], strides[0]) + strides[3:])
    spec = _spec(batch)
    with pytest.raises(NotUsable, match=r"batch dims \(2, 3, 4, 5\) do not fold into 3"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4, {**spec.operands, "query": odd}))
    with pytest.raises(NotUsable, match="query dtype s32 is not supported"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4,
                            {**spec.operands, "query": Operand(DataType.s32, shape, strides)}))
    with pytest.raises(NotUsable, match="output .* would be written more than once"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4,
                            {**spec.operands, "output": Operand(DataType.f32, (5, 4), (4, 1))}))
    with pytest.raises(NotUsable, match=r"key batch shape \(3,\) does not broadcast"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4,
                            {**spec.operands, "key": Operand(DataType.f32, (3, 7, 4), (28, 4, 1))}))
    with pytest.raises(ValueError, match="has no roles \\['grad_query'\\]"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4, {**spec.operands, "grad_query": spec.operands["query"]}))
    with pytest.raises(ValueError, match="mask_kind 'additive' without a mask"):
        lower(AttentionSpec("forward", batch, 5, 7, 4, 4, spec.operands, mask_kind="additive"))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 1), (4, 4), (-1, -1), (0, -1)])
def test_the_kernel_aligns_the_window_not_python(alignment, window, rng):
    """A call's spec keeps the window about the aligned row (None an open side) and the alignment as it is: the
    kernel shifts the rows by each call's own S_kv - S_q, so one plan holds at every length, and new lengths
    replay it with the same window (checked against the reference at three lengths of K/V)."""
    assert kernel_window(window) == tuple(None if side == -1 else side for side in window)
    forward_call._cache.clear()
    forward_call._by_length_free.clear()
    options = dict(window=window, causal_alignment=alignment)
    for seq_kv in (10, 13, 29):
        q = random_array((1, 2, 7, 16), "f32", rng)
        k, v = (random_array((1, 2, seq_kv, 16), "f32", rng) for _ in range(2))
        assert_close(ga.scaled_dot_product_attention(q, k, v, **options), sdpa_reference(q, k, v, **options), "f32")
    (entry,) = forward_call._cache._entries.values()  # planned once, replayed at the other lengths
    assert entry.call.options["alignment"] == _cpu.ROW_ALIGNMENTS[alignment]
    no_limit = _cpu.NO_KEY_LIMIT
    assert entry.window == tuple(no_limit if side == -1 else side for side in window)


def test_window_whose_left_bound_about_the_row_is_minus_one(rng):
    """window=(2, 5) bottom-right with S_kv - S_q = 3: row i sees keys i + 1 .. i + 8 (a left bound of -1
    about the row itself, which must not read as an open side)."""
    q, k, v = random_array((1, 2, 7, 16), "f32", rng), random_array((1, 2, 10, 16), "f32", rng), \
        random_array((1, 2, 10, 16), "f32", rng)
    options = dict(window=(2, 5), causal_alignment="bottom_right")
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True, **options)
    assert_close(out, sdpa_reference(q, k, v, **options), "f32")
    grad = random_array(out.shape, "f32", rng)
    got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, **options)
    for g, w in zip(got, sdpa_reference_backward(grad, q, k, v, **options)):
        assert_grad_close(g, w, "f32")


def test_forward_and_backward_lower_one_call_alike(rng):
    """The functional forward and backward describe the same call: the same kernel batch and the same strides
    for every operand both read (here six batch dims, folded)."""
    forward_call._cache.clear()
    functional_backward._plans.clear()
    shape = (2, 1, 2, 3, 1, 2)
    q, k, v = (random_array(shape + (9, 16), "f32", rng) for _ in range(3))
    out, stats = ga.scaled_dot_product_attention(q, k, v, window=(3, 0), return_stats=True)
    ga.scaled_dot_product_attention_backward(out, q, k, v, out, stats, window=(3, 0))
    (forward,) = forward_call._cache._entries.values()
    (backward,) = functional_backward._plans._entries.values()
    assert forward.copies is None and backward.call.batch == forward.call.batch
    for role in ("query", "key", "value", "output"):
        assert backward.call.roles[role] == forward.call.roles[role], role
    assert backward.call.options["window_left"] == forward.call.options["window_left"] == 3


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_batch_dims_the_kernel_cannot_walk_are_copied(dtype, rng):
    """Q, K and V whose four batch dims are permuted so that none fold: the forward and the backward copy them
    contiguous and still run fused, matching the reference."""
    base = random_array((3, 2, 4, 2, 11, 16), dtype, rng)
    q = base.transpose(2, 0, 3, 1, 4, 5)  # (4, 3, 2, 2, 11, 16), strides that walk no adjacent dims as one
    k, v = (random_array(q.shape, dtype, rng) for _ in range(2))
    out, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=True, return_stats=True)
    assert_close(out, sdpa_reference(q, k, v, is_causal=True), dtype)
    entry = next(e for s, e in forward_call._cache._entries.items() if e.out_shape == q.shape[:-1] + (16,))
    assert entry.copies is not None
    grad = random_array(out.shape, dtype, rng)
    got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, is_causal=True)
    for g, w in zip(got, sdpa_reference_backward(grad, q, k, v, is_causal=True)):
        assert_grad_close(g, w, dtype)
