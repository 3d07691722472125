"""Op semantics: shape inference, dtype rules and the NumPy reference of each op kind."""
import ml_dtypes
import numpy as np
import pytest

import graphattn as ga
from graphattn.ops.philox import dropout_keep_mask, philox4x32_10

pytestmark = pytest.mark.cpu


def run_op(kind, inputs, out_specs, **attrs):
    """Builds a one-op graph over the given arrays and runs it through a compiled partition."""
    lts = [ga.LogicalTensor(i, ga.dtypes.from_numpy(a.dtype), a.shape) for i, a in enumerate(inputs)]
    outs = [ga.LogicalTensor(100 + i, dt, shape) for i, (dt, shape) in enumerate(out_specs)]
    graph = ga.Graph()
    graph.add_op(ga.Op(0, kind, lts, outs, attrs))
    results = ga.run_graph(graph, {lt.id: a for lt, a in zip(lts, inputs)})
    return [results[o.id] for o in outs]


def test_matmul_transposes_and_broadcast(rng):
    a = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4, 6)).astype(np.float32)
    (out,) = run_op("MatMul", [a, b], [("f32", (2, 5, 3, 6))], transpose_b=False)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-6)
    (out,) = run_op("MatMul", [a, np.swapaxes(b, -1, -2).copy()], [("f32", (2, 5, 3, 6))], transpose_b=True)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-6)


def test_matmul_bf16_inputs_f32_output(rng):
    a = rng.standard_normal((3, 8)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((8, 2)).astype(ml_dtypes.bfloat16)
    (out,) = run_op("MatMul", [a, b], [("f32", (3, 2))])
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-6)


def test_softmax_stats_and_modes():
    x = np.array([[0.0, 1.0, 2.0], [-np.inf, -np.inf, -np.inf], [3.0, -np.inf, 3.0]], np.float32)
    dst, stats = run_op("SoftMax", [x], [("f32", (3, 3)), ("f32", (3, 1))], axis=-1, mode="inf_as_zero")
    e = np.exp([0.0, 1.0, 2.0])
    np.testing.assert_allclose(dst[0], e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(stats[0, 0], np.log(e.sum()), rtol=1e-6)
    assert np.all(dst[1] == 0) and stats[1, 0] == -np.inf
    np.testing.assert_allclose(dst[2], [0.5, 0, 0.5])
    dst, stats = run_op("SoftMax", [x], [("f32", (3, 3)), ("f32", (3, 1))], axis=-1, mode="none")
    assert np.all(np.isnan(dst[1])) and np.isnan(stats[1, 0])


def test_softmax_backward_matches_jacobian(rng):
    x = rng.standard_normal((2, 5))
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    g = rng.standard_normal((2, 5))
    (out,) = run_op("SoftMaxBackward", [g.astype(np.float32), p.astype(np.float32)], [("f32", (2, 5))], axis=-1)
    expected = np.stack([(np.diag(pi) - np.outer(pi, pi)) @ gi for pi, gi in zip(p, g)])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_elementwise_broadcast_select_compare(rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    for kind, fn in (("Add", np.add), ("Subtract", np.subtract), ("Multiply", np.multiply), ("Divide", np.divide)):
        (out,) = run_op(kind, [a, b], [("f32", (2, 3))])
        np.testing.assert_allclose(out, fn(a.astype(np.float64), b), rtol=1e-6)
    (ge,) = run_op("GreaterEqual", [a, b], [("boolean", (2, 3))])
    (gt,) = run_op("GreaterThan", [a, a], [("boolean", (2, 3))])
    assert np.array_equal(ge, a >= b) and not gt.any()
    fill = np.array([-np.inf], np.float32)
    (sel,) = run_op("Select", [ge, a, fill], [("f32", (2, 3))])
    assert np.array_equal(sel, np.where(a >= b, a, -np.inf))


def test_exp_typecast_reducesum(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    (e,) = run_op("Exp", [x], [("f32", x.shape)])
    np.testing.assert_allclose(e, np.exp(x.astype(np.float64)), rtol=1e-6)
    (c,) = run_op("TypeCast", [x], [("bf16", x.shape)])
    assert c.dtype == ml_dtypes.bfloat16 and np.array_equal(c, x.astype(ml_dtypes.bfloat16))
    (r,) = run_op("ReduceSum", [x], [("f32", (2, 1, 4))], axes=[1], keep_dims=True)
    np.testing.assert_allclose(r, x.sum(1, keepdims=True), rtol=1e-6)
    (r,) = run_op("ReduceSum", [x], [("f32", (3,))], axes=[0, -1])
    np.testing.assert_allclose(r, x.sum((0, 2)), rtol=1e-5)


def test_reshape_transpose_genindex():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    (r,) = run_op("StaticReshape", [x], [("f32", (2, 12))], shape=[0, -1], special_zero=True)
    assert np.array_equal(r, x.reshape(2, 12))
    (t,) = run_op("StaticTranspose", [x], [("f32", (4, 2, 3))], order=[-1, 0, 1])
    assert np.array_equal(t, x.transpose(2, 0, 1))
    (rows,) = run_op("GenIndex", [x], [("s32", x.shape)], axis=-2)
    assert rows.dtype == np.int32 and np.array_equal(rows[1, :, 2], [0, 1, 2])


def test_philox_known_answer():
    # Known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
    zero = philox4x32_10((0, 0, 0, 0), (0, 0))
    assert [int(w) for w in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = philox4x32_10((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF))
    assert [int(w) for w in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_dropout_determinism_rate_and_scaling():
    shape, p = (64, 256), 0.25
    x = np.ones(shape, np.float32)
    seed, offset = np.array([42], np.int64), np.array([7], np.int64)
    dst, mask = run_op("Dropout", [x, seed, offset], [("f32", shape), ("f32", shape)], p=p)
    dst2, _ = run_op("Dropout", [x, seed, offset], [("f32", shape), ("f32", shape)], p=p)
    assert np.array_equal(dst, dst2)
    keep = mask.mean()
    n = mask.size
    assert abs(keep - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(dst[mask == 1], 1 / (1 - p))
    assert np.all(dst[mask == 0] == 0)
    other = dropout_keep_mask(shape, p, 43, 7)
    assert not np.array_equal(other, mask == 1)
    assert np.array_equal(dropout_keep_mask(shape, p, 42, 7), mask == 1)


@pytest.mark.parametrize("kind,inputs,outs,attrs,error", [
    ("MatMul", [(2, 3), (4, 5)], [("f32", (2, 5))], {}, "contraction dims differ"),
    ("Add", [(2, 3), (4, 3)], [("f32", (2, 3))], {}, "not broadcastable"),
    ("StaticReshape", [(2, 3)], [("f32", (5,))], {"shape": [5]}, "cannot reshape"),
    ("StaticTranspose", [(2, 3)], [("f32", (3, 2))], {"order": [0, 0]}, "not a permutation"),
    ("SoftMax", [(2, 3)], [("f32", (2, 3))], {"axis": 2}, "out of range"),
])
def test_shape_errors_name_the_op(kind, inputs, outs, attrs, error):
    lts = [ga.LogicalTensor(i, "f32", s) for i, s in enumerate(inputs)]
    out = [ga.LogicalTensor(10 + i, dt, s) for i, (dt, s) in enumerate(outs)]
    graph = ga.Graph()
    with pytest.raises(ValueError, match=error) as info:
        graph.add_op(ga.Op(7, kind, lts, out, attrs))
        graph.finalize()
    assert "op 7" in str(info.value)


def test_dynamic_dequantize_per_tensor_channel_and_group(rng):
    src = rng.integers(0, 256, (2, 3, 6, 32)).astype(np.uint8)
    zps = rng.integers(0, 256, (2, 3, 6, 2)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (2, 3, 6, 2)).astype(np.float32)
    (out,) = run_op("DynamicDequantize", [src, scales, zps], [("f32", src.shape)], qtype="per_group",
                    group_shape=[1, 1, 1, 16])
    want = (src.astype(np.float64) - np.repeat(zps, 16, -1)) * np.repeat(scales, 16, -1)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    # K as the (N, H, D, S) view: groups along D, the second-to-last dim
    src_t = np.ascontiguousarray(src.swapaxes(-1, -2))
    (out_t,) = run_op("DynamicDequantize", [src_t, np.ascontiguousarray(scales.swapaxes(-1, -2)),
                                            np.ascontiguousarray(zps.swapaxes(-1, -2))],
                      [("f32", src_t.shape)], qtype="per_group", group_shape=[1, 1, 16, 1])
    np.testing.assert_allclose(out_t, want.swapaxes(-1, -2), rtol=1e-6)
    s8 = rng.integers(-128, 128, (4, 5)).astype(np.int8)
    (per_channel,) = run_op("DynamicDequantize", [s8, np.arange(1, 6, dtype=np.float32) / 8,
                                                  np.array([1, -2, 0, 3, 4], np.int32)],
                            [("f32", (4, 5))], qtype="per_channel", axis=1)
    np.testing.assert_array_equal(per_channel, (s8 - np.array([1, -2, 0, 3, 4])) * (np.arange(1, 6) / 8))
    for dtype, lo, hi in ((ml_dtypes.uint4, 0, 16), (ml_dtypes.int4, -8, 8)):
        q = rng.integers(lo, hi, (3, 8)).astype(dtype)
        (per_tensor,) = run_op("DynamicDequantize", [q, np.array([0.25], ml_dtypes.bfloat16)], [("bf16", (3, 8))])
        assert per_tensor.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(per_tensor.astype(np.float32), q.astype(np.float32) * 0.25)


def test_dynamic_dequantize_refusals(rng):
    src = rng.integers(0, 256, (2, 48)).astype(np.uint8)
    with pytest.raises(ValueError, match="group size 32 must divide 48"):
        run_op("DynamicDequantize", [src, np.ones((2, 1), np.float32)], [("f32", (2, 48))], qtype="per_group",
               group_shape=[1, 32])
    with pytest.raises(ValueError, match="scales must have shape"):
        run_op("DynamicDequantize", [src, np.ones((2, 2), np.float32)], [("f32", (2, 48))], qtype="per_group",
               group_shape=[1, 16])
    with pytest.raises(TypeError, match="src must be u8, s8, u4 or s4"):
        run_op("DynamicDequantize", [src.astype(np.float32), np.ones(1, np.float32)], [("f32", (2, 48))])
    with pytest.raises(TypeError, match="output's dtype must be the scales'"):
        run_op("DynamicDequantize", [src, np.ones(1, np.float32)], [("f16", (2, 48))])
