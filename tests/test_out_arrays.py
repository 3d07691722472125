"""out= of the forward and grads_out= of the backward: results written into the caller's arrays, exactly as
the calls that allocate them would compute them, with clear errors for arrays the kernels cannot write."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.testing import random_array

pytestmark = pytest.mark.cpu


def _case(rng, dtype, gqa=True):
    q = random_array((2, 4, 5, 8), dtype, rng)
    kv_heads = 2 if gqa else 4
    k, v = (random_array((2, kv_heads, 7, 8), dtype, rng) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_out_receives_the_result_the_call_would_allocate(dtype, rng):
    q, k, v = _case(rng, dtype)
    want, want_stats = ga.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_stats=True)
    # a larger buffer: the kernel writes the middle rows it is given and nothing around them
    base = np.full((2 + 2 * 4 * 5 * 8,), 7, q.dtype)
    out = base[1:-1].reshape(2, 4, 5, 8)
    for _ in range(2):  # a loop of equal calls reusing its array
        got, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_stats=True,
                                                     out=out)
        assert got is out
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(stats, want_stats)
    assert base[0] == 7 and base[-1] == 7


def test_bad_out_arrays_are_named(rng):
    q, k, v = _case(rng, "f32")
    call = dict(enable_gqa=True)
    cases = [
        (np.empty((2, 4, 5, 9), np.float32), ValueError, r"out must have the result's shape \(2, 4, 5, 8\)"),
        (np.empty((2, 4, 5, 8), np.float16), ValueError, r"dtype float32, got \(2, 4, 5, 8\) float16"),
        (np.empty((2, 4, 8, 5), np.float32).transpose(0, 1, 3, 2), ValueError, "writable C-contiguous"),
        ([[0.0]], TypeError, "out must be a NumPy array, got list"),
    ]
    readonly = np.empty((2, 4, 5, 8), np.float32)
    readonly.flags.writeable = False
    cases.append((readonly, ValueError, "writable C-contiguous"))
    for out, error, message in cases:
        with pytest.raises(error, match=message):
            ga.scaled_dot_product_attention(q, k, v, out=out, **call)
    with pytest.raises(ValueError, match="out shares memory with query"):
        ga.scaled_dot_product_attention(q, q, q, out=q)


def test_out_takes_numpy_inputs_only(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="out takes NumPy inputs"):
        ga.scaled_dot_product_attention(q, q, q, out=np.empty((1, 2, 3, 8), np.float32))
    with pytest.raises(TypeError, match="out must be a NumPy array, got Tensor"):
        ga.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy(), out=torch.empty(1, 2, 3, 8))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("broadcast", [False, True], ids=["direct", "broadcast_query"])
def test_grads_out_receive_the_gradients(dtype, broadcast, rng):
    """Direct calls write the gradients in place; a query broadcast over the batch has its gradient summed
    after the kernel, into grads_out too."""
    q, k, v = _case(rng, dtype)
    if broadcast:
        q = q[:1]
    out, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True)
    grad = random_array(out.shape, dtype, rng)
    want = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, enable_gqa=True)
    buffers = tuple(np.full(a.shape, 3, a.dtype) for a in (q, k, v))
    for _ in range(2):
        got = ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, enable_gqa=True, grads_out=buffers)
        assert all(g is b for g, b in zip(got, buffers))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_bad_grads_out_are_named(rng):
    q, k, v = _case(rng, "f32")
    out, stats = ga.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_stats=True)
    grad = np.ones_like(out)
    fresh = [np.empty_like(a) for a in (q, k, v)]

    def backward(grads_out):
        return ga.scaled_dot_product_attention_backward(grad, q, k, v, out, stats, enable_gqa=True,
                                                        grads_out=grads_out)

    with pytest.raises(TypeError, match=r"grads_out must be a tuple of three arrays \(dq, dk, dv\)"):
        backward(tuple(fresh[:2]))
    with pytest.raises(ValueError, match=r"grads_out\[1\] \(dk\) must have the result's shape \(2, 2, 7, 8\)"):
        backward((fresh[0], fresh[0], fresh[2]))
    with pytest.raises(ValueError, match=r"grads_out\[2\] \(dv\) shares memory with grads_out\[1\] \(dk\)"):
        backward((fresh[0], fresh[1], fresh[1]))
    with pytest.raises(ValueError, match=r"grads_out\[0\] \(dq\) shares memory with grad_out"):
        backward((grad, fresh[1], fresh[2]))
