"""Bad input is refused by name, odd input takes the same route as ordinary input, and nothing is read or
written outside the buffers given (issue 36): one test per defect found by adversarial use."""
import gc
import sys
import tempfile
import threading

import numpy as np
import pytest

import graphattn as ga
from graphattn import _cpu
from graphattn.dtypes import as_data_type, numpy_dtype
from graphattn.plan_cache import SignatureCache
from graphattn.testing import TOLERANCES, assert_close, assert_grad_close, random_array, sdpa_reference, sdpa_reference_backward

torch = pytest.importorskip("torch")


def _sdpa_graph():
    """A plain SDPA graph (Q K^T, SoftMax, P V) of f32 (1, 2, 5, 8) operands, compiled: (compiled partition,
    engine, stream, Q/K/V logical tensors, output logical tensor)."""
    shape = (1, 2, 5, 8)
    q, k, v = (ga.LogicalTensor(i, "f32", shape) for i in range(3))
    score, probs = ga.LogicalTensor(3, "f32", (1, 2, 5, 5)), ga.LogicalTensor(4, "f32", (1, 2, 5, 5))
    out = ga.LogicalTensor(5, "f32", shape)
    graph = ga.Graph("cpu")
    graph.add_op(ga.Op(0, "MatMul", [q, k], [score], {"transpose_b": True}))
    graph.add_op(ga.Op(1, "SoftMax", [score], [probs], {"axis": -1}))
    graph.add_op(ga.Op(2, "MatMul", [probs, v], [out], {}))
    graph.finalize()
    engine = ga.Engine("cpu")
    (partition,) = graph.get_partitions()
    compiled = partition.compile(partition.get_input_ports(), partition.get_output_ports(), engine)
    assert compiled.kernel_name == "sdpa_forward_cpu"
    return compiled, engine, ga.Stream(engine), (q, k, v), out


@pytest.fixture
def sdpa_graph():
    return _sdpa_graph()


def _qkv(rng, shape=(1, 2, 5, 8), dtype=np.float32):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# ---- graph API: buffers against their ports ------------------------------------------------------------------


def test_execute_refuses_a_tensor_whose_dtype_differs_from_its_port(sdpa_graph, rng):
    compiled, engine, stream, (q, k, v), out = sdpa_graph
    data = _qkv(rng)
    out_f16 = ga.LogicalTensor(out.id, "f16", out.shape)
    with pytest.raises(TypeError, match="output port 5 was compiled for f32"):
        compiled.execute(stream, [ga.Tensor(lt, engine, a) for lt, a in zip((q, k, v), data)],
                         [ga.Tensor(out_f16, engine, np.zeros(out.shape, np.float16))])
    q_f16 = ga.LogicalTensor(q.id, "f16", q.shape)
    with pytest.raises(TypeError, match="input port 0 was compiled for f32"):
        compiled.execute(stream, [ga.Tensor(q_f16, engine, data[0].astype(np.float16)),
                                  ga.Tensor(k, engine, data[1]), ga.Tensor(v, engine, data[2])],
                         [ga.Tensor(out, engine, np.zeros(out.shape, np.float32))])


def _read_only_outputs(shape):
    yield "flag", np.zeros(shape, np.float32)
    yield "bytes", np.frombuffer(bytes(4 * int(np.prod(shape))), np.float32).reshape(shape)
    path = tempfile.NamedTemporaryFile(suffix=".bin", delete=False).name
    np.zeros(shape, np.float32).tofile(path)
    yield "memmap", np.memmap(path, np.float32, "r", shape=shape)


@pytest.mark.parametrize("which", ["flag", "bytes", "memmap"])
def test_execute_refuses_read_only_outputs(sdpa_graph, rng, which):
    compiled, engine, stream, qkv, out = sdpa_graph
    array = dict(_read_only_outputs(out.shape))[which]
    array.flags.writeable = False
    before = np.array(array)
    with pytest.raises(ValueError, match="output port 5 is read-only"):
        compiled.execute(stream, [ga.Tensor(lt, engine, a) for lt, a in zip(qkv, _qkv(rng))],
                         [ga.Tensor(out, engine, array)])
    np.testing.assert_array_equal(array, before)


def test_output_with_stride_0_is_refused_at_compile_and_by_the_kernel(sdpa_graph, rng):
    compiled, engine, stream, qkv, out = sdpa_graph
    broadcast = ga.LogicalTensor(out.id, "f32", out.shape, strides=(0, 0, 8, 1))
    with pytest.raises(ValueError, match="tensor 5: output strides .* in one place"):
        compiled.partition.compile(compiled.partition.get_input_ports(), [broadcast], engine)
    # The kernel's own check, for callers of the C++ API or the binding that bypass compile.
    q, k, v = _qkv(rng)
    strides = {"query": (0, 80, 40, 8, 1), "output": (0, 0, 0, 8, 1)}
    plan = _cpu.ForwardPlan((1, 1, 2), 5, 5, 8, 8, (0, strides["query"]), (0, strides["query"]),
                            (0, strides["query"]), (0, strides["output"]))
    target = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match="output is written, but its strides"):
        plan.run_arrays(q, k, v, target)
    assert not target.any()


def test_output_sharing_memory_with_an_input_is_refused(sdpa_graph, rng):
    compiled, engine, stream, qkv, out = sdpa_graph
    q, k, v = _qkv(rng)
    before = q.copy()
    with pytest.raises(ValueError, match="output port 5 overlaps the memory of input port 0"):
        compiled.execute(stream, [ga.Tensor(lt, engine, a) for lt, a in zip(qkv, (q, k, v))],
                         [ga.Tensor(out, engine, q)])
    np.testing.assert_array_equal(q, before)


def test_kernel_refuses_a_view_that_reaches_past_its_buffer(sdpa_graph, rng):
    """execute_unchecked trusts its caller for layouts; the kernel still checks each view's reach against the
    NumPy buffer it is given, for every operand."""
    compiled, _, _, _, out = sdpa_graph
    q, k, v = _qkv(rng)
    for port, name in ((0, "query"), (1, "key"), (2, "value")):
        arrays = {0: q, 1: k, 2: v}
        arrays[port] = arrays[port][:, :1]  # half the buffer the compiled view walks
        with pytest.raises(ValueError, match=f"{name}: its strides .* outside its buffer"):
            compiled.execute_unchecked(arrays, {out.id: np.zeros(out.shape, np.float32)})
    with pytest.raises(ValueError, match="output: its strides .* outside its buffer"):
        compiled.execute_unchecked({0: q, 1: k, 2: v}, {out.id: np.zeros((1, 1, 5, 8), np.float32)})
    # An f16 buffer under an f32 view reaches twice its bytes.
    with pytest.raises(ValueError, match="query: its strides .* outside its buffer"):
        compiled.execute_unchecked({0: q.astype(np.float16), 1: k, 2: v}, {out.id: np.zeros(out.shape, np.float32)})


def test_backward_kernel_refuses_gradients_too_small_for_their_views(rng):
    q, k, v = _qkv(rng)
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    do = rng.standard_normal(out.shape).astype(np.float32)
    dense = {"query": q, "key": k, "value": v, "output": out, "stats": stats, "grad_output": do}
    strides = {name: (0, a.strides[0] // 4, a.strides[1] // 4, a.strides[2] // 4, a.strides[3] // 4)
               for name, a in dense.items()}
    roles = {name: (0, strides[name]) for name in dense}
    roles.update(grad_query=(0, strides["query"]), grad_key=(0, strides["key"]), grad_value=(0, strides["value"]))
    arrays = dict(dense, grad_query=np.zeros((1, 1, 5, 8), np.float32), grad_key=np.zeros_like(k),
                  grad_value=np.zeros_like(v))
    plan = _cpu.BackwardPlan((1, 1, 2), 5, 5, 8, 8, roles, has_scale=True)
    with pytest.raises(ValueError, match="grad_query: its strides .* outside its buffer"):
        plan.run(arrays, 0.35, 0, 0)


# ---- routes: torch and NumPy, fused kernel and reference ------------------------------------------------------


@pytest.mark.parametrize("case", ["6d", "5d_gqa"])
def test_torch_calls_that_need_the_reference_match_numpy(rng, case):
    if case == "6d":  # four batch dims: more than the kernel's three, so the reference executor runs it
        q, k, v = (random_array((1, 2, 3, 2, 5, 8), "f32", rng) for _ in range(3))
        gqa = False
    else:
        q = random_array((2, 3, 4, 5, 8), "f32", rng)
        k, v = (random_array((2, 3, 2, 6, 8), "f32", rng) for _ in range(2))
        gqa = True
    expected = sdpa_reference(q, k, v, enable_gqa=gqa)
    for _ in range(2):  # the second call takes the cached signature
        from_torch = ga.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)), enable_gqa=gqa)
        assert isinstance(from_torch, torch.Tensor)
        assert_close(from_torch.numpy(), expected, "f32")
    assert_close(ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa), expected, "f32")


@pytest.mark.parametrize("as_torch", [False, True])
def test_value_batch_dims_broadcast_beyond_query_and_key(rng, as_torch):
    q = random_array((1, 2, 5, 8), "f32", rng)
    k = random_array((2, 1, 6, 8), "f32", rng)
    v = random_array((3, 1, 2, 6, 4), "f32", rng)  # a batch dim of its own, and one Q and K broadcast
    wrap = torch.from_numpy if as_torch else (lambda x: x)
    out, stats = ga.scaled_dot_product_attention(wrap(q), wrap(k), wrap(v), return_stats=True)
    expected, expected_stats = sdpa_reference(q, k, v, return_stats=True)
    assert tuple(out.shape) == (3, 2, 2, 5, 4)
    expected_torch = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x).double() for x in (q, k, v)))
    assert_close(np.asarray(out), expected_torch.numpy(), "f32")
    assert_close(np.asarray(stats), np.broadcast_to(expected_stats, (3, 2, 2, 5, 1)), "f32")
    do = random_array(out.shape, "f32", rng)
    grads = ga.scaled_dot_product_attention_backward(wrap(do), wrap(q), wrap(k), wrap(v), out, stats)
    for got, want, name in zip(grads, sdpa_reference_backward(do, q, k, v), ("dq", "dk", "dv")):
        assert tuple(got.shape) == want.shape
        assert_grad_close(np.asarray(got), want, "f32", name)


@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (3, 0, 5, 8), (2, 0, 0, 5, 8), (2, 3, 0, 8)])
@pytest.mark.parametrize("as_torch", [False, True])
def test_empty_dims_give_empty_results_forward_and_backward(shape, as_torch):
    x = np.zeros(shape, np.float32)
    wrap = torch.from_numpy if as_torch else (lambda a: a)
    out, stats = ga.scaled_dot_product_attention(wrap(x), wrap(x), wrap(x), return_stats=True)
    assert tuple(out.shape) == shape and tuple(stats.shape) == shape[:-1] + (1,)
    grads = ga.scaled_dot_product_attention_backward(wrap(np.zeros(shape, np.float32)), wrap(x), wrap(x), wrap(x),
                                                     out, stats)
    # PyTorch's convention: gradients of the operands' own (empty) shapes.
    assert [tuple(g.shape) for g in grads] == [shape] * 3


# ---- extreme values ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 40, 300])
def test_huge_scores_with_one_key_give_its_value_row(rng, dtype, rows):
    """One key: P = 1 whatever the score, so every output row is V's row, on every kernel path (the AMX builds
    took the max before scaling and lost P to the product's rounding once |score * scale| neared 2^32)."""
    big = 6e4 if dtype == "f16" else 1e5
    # Each query row is +-K's row, so |score| is 64 * big^2 / 8 with no cancellation in its sum (a sum that
    # cancelled would leave f32 rounding noise of the size of a whole score).
    pattern = np.sign(rng.standard_normal((2, 2, 1, 64)))
    signs = np.sign(rng.standard_normal((2, 2, rows, 1)))
    q = (signs * pattern * big).astype(numpy_dtype(as_data_type(dtype)))
    k = (pattern * big).astype(q.dtype)
    v = random_array((2, 2, 1, 64), dtype, rng)
    out, stats = ga.scaled_dot_product_attention(q, k, v, return_stats=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.broadcast_to(np.asarray(v, np.float32), out.shape))
    assert np.isfinite(stats).all()
    two = np.concatenate([k, -k], axis=-2)  # two keys a huge score apart: the larger takes all
    out = ga.scaled_dot_product_attention(q, two, np.concatenate([v, v + 1], axis=-2))
    expected = sdpa_reference(q, two, np.concatenate([v, v + 1], axis=-2))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("value", [3e38, -3e38, 3.4e38])
def test_float_mask_values_beyond_flt_max_over_log2e_stay_finite(rng, dtype, value):
    q, k, v = (random_array((1, 2, 5, 16), dtype, rng) for _ in range(3))
    mask = np.zeros((1, 1, 5, 5), np.float32)
    mask[..., 2] = value
    out = ga.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.asarray(x, np.float64)) for x in (q, k, v)), attn_mask=torch.from_numpy(mask).double())
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, expected.numpy(), dtype)


# ---- torch views and the signature cache ------------------------------------------------------------------------


def test_torch_negative_bit_is_honoured_on_cached_signatures(rng):
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng, (1, 2, 7, 16)))
    plain = ga.scaled_dot_product_attention(q, k, v)  # caches the layout of (q, k, v)
    negated = torch._neg_view(q)
    assert negated.is_neg()
    for _ in range(2):
        got = ga.scaled_dot_product_attention(negated, k, v)
        torch.testing.assert_close(got, ga.scaled_dot_product_attention(-q, k, v), rtol=0, atol=0)
    assert not torch.equal(got, plain)
    out, stats = ga.scaled_dot_product_attention(-q, k, v, return_stats=True)
    do = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    ga.scaled_dot_product_attention_backward(do, q, k, v, *ga.scaled_dot_product_attention(q, k, v, return_stats=True))
    for _ in range(2):
        got = ga.scaled_dot_product_attention_backward(do, negated, k, v, out, stats)
        want = ga.scaled_dot_product_attention_backward(do, -q, k, v, out, stats)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_signature_cache_survives_concurrent_eviction(monkeypatch):
    """Lookups that reorder the cache race with other threads' evictions; none may raise."""
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    cache, errors = SignatureCache(), []

    def hammer(seed):
        r = np.random.default_rng(seed)
        try:
            for key in r.integers(0, 600, 20000):
                if cache.get(int(key)) is None:
                    cache.put(int(key), key)
        except Exception as error:  # noqa: BLE001 - the test reports whatever escaped
            errors.append(error)

    try:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
    assert len(cache) <= 256


# ---- arguments refused by name ---------------------------------------------------------------------------------


def _bad_calls(rng):
    q = random_array((1, 2, 5, 8), "f32", rng)
    tq = torch.from_numpy(q)
    yield "dropout_seed", TypeError, dict(query=q, key=q, value=q, dropout_p=0.1, dropout_seed=1.7)
    yield "dropout_p", TypeError, dict(query=q, key=q, value=q, dropout_p="0.1")
    yield "dropout_p", ValueError, dict(query=q, key=q, value=q, dropout_p=1.5)
    yield "query is a NumPy masked array", TypeError, dict(query=np.ma.masked_array(q), key=q, value=q)
    yield "key has byte strides", ValueError, dict(
        query=q, key=np.lib.stride_tricks.as_strided(q, strides=q.strides[:3] + (2,)), value=q)
    yield "query is a torch tensor of layout torch.sparse_coo", TypeError, dict(query=tq.to_sparse(), key=tq, value=tq)
    yield "query dtype float64 is not supported; use float32", TypeError, dict(query=q.astype(np.float64), key=q,
                                                                                value=q)
    yield "query dtype torch.float64 is not supported; use torch.float32", TypeError, dict(
        query=tq.double(), key=tq.double(), value=tq.double())
    yield "value dtype int32", TypeError, dict(query=q, key=q, value=q.astype(np.int32))
    yield "query must have a head size", ValueError, dict(query=q[..., :0], key=q[..., :0], value=q)
    yield "scale must be a real number", TypeError, dict(query=q, key=q, value=q, scale="x")


@pytest.mark.parametrize("index", range(11))
def test_bad_arguments_are_named(rng, index):
    match, error, kwargs = list(_bad_calls(rng))[index]
    with pytest.raises(error, match=match):
        ga.scaled_dot_product_attention(**kwargs)


def test_backward_bad_arguments_are_named(rng):
    q = random_array((1, 2, 5, 8), "f32", rng)
    out, stats = ga.scaled_dot_product_attention(q, q, q, return_stats=True)
    with pytest.raises(TypeError, match="scale must be a real number"):
        ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, scale="x")
    with pytest.raises(TypeError, match="dropout_p must be a real number"):
        ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, dropout_p="0.1", dropout_seed=1)
    with pytest.raises(TypeError, match="dropout_seed must be an integer"):
        ga.scaled_dot_product_attention_backward(out, q, q, q, out, stats, dropout_p=0.1, dropout_seed=1.7)
    with pytest.raises(TypeError, match="query dtype float64 is not supported"):
        ga.scaled_dot_product_attention_backward(out, q.astype(np.float64), q, q, out, stats)
    with pytest.raises(TypeError, match="grad_out is a NumPy masked array"):
        ga.scaled_dot_product_attention_backward(np.ma.masked_array(out), q, q, q, out, stats)


# ---- threads and memory ------------------------------------------------------------------------------------------


def _mixed_call(i, arrays):
    """Call i of a fixed mix: forward and backward, NumPy and torch, a few shapes."""
    q, k, v, do = arrays[i % len(arrays)]
    as_torch = i % 3 == 0
    wrap = torch.from_numpy if as_torch else (lambda a: a)
    causal = i % 2 == 0
    out, stats = ga.scaled_dot_product_attention(wrap(q), wrap(k), wrap(v), is_causal=causal, return_stats=True)
    if i % 4 == 1:
        grads = ga.scaled_dot_product_attention_backward(wrap(do), wrap(q), wrap(k), wrap(v), out, stats,
                                                         is_causal=causal)
        return tuple(np.asarray(g) for g in grads)
    return np.asarray(out), np.asarray(stats)


def _mixed_arrays(rng):
    # (1, 4, 512, 64): enough key blocks that the backward's last items go in pieces sharing dQ rows
    shapes = [(1, 2, 9, 16), (2, 3, 33, 32), (1, 4, 1, 64), (1, 1, 130, 8), (1, 4, 512, 64)]
    return [tuple(random_array(s, "f32", rng) for _ in range(4)) for s in shapes]


def test_eight_threads_give_the_serial_results_bit_for_bit(rng):
    arrays = _mixed_arrays(rng)
    calls = range(160)
    serial = [_mixed_call(i, arrays) for i in calls]
    results: dict = {}

    def worker(start):
        for i in calls[start::8]:
            results[i] = _mixed_call(i, arrays)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in calls:
        for got, want in zip(results[i], serial[i]):
            np.testing.assert_array_equal(got, want, err_msg=f"call {i}")


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    pytest.skip("no /proc/self/status")


def test_ten_thousand_mixed_calls_do_not_grow_memory(rng):
    """10,000 calls (forward and backward, NumPy and torch, cached signatures and, every 25th, a new one that
    evicts an old one) grow the resident set by less than 5 MiB once warmed up."""
    arrays = _mixed_arrays(rng)

    def new_signature(i):  # a query length of its own: a compile, and an eviction once the cache is full
        x = random_array((1, 1, 3 + i % 400, 8), "f32", rng)
        ga.scaled_dot_product_attention(x, x, x)

    for i in range(2000):  # warm-up: every cached shape, and the cache filled to its bound
        _mixed_call(i, arrays)
        if i % 25 == 0:
            new_signature(i)
    gc.collect()
    before = _rss_kib()
    for i in range(10000):
        _mixed_call(i, arrays)
        if i % 25 == 0:
            new_signature(i + 2000)
    gc.collect()
    grown = _rss_kib() - before
    print(f"RSS growth over 10,000 mixed calls: {grown} KiB")
    assert grown < 5 * 1024, f"RSS grew by {grown} KiB"


# ---- SYCL (the OpenCL CPU device in CI) --------------------------------------------------------------------------


@pytest.mark.sycl
def test_sycl_float_mask_beyond_flt_max_over_log2e_and_view_reach(rng):
    from sycl_helpers import get_queue_or_skip

    queue = get_queue_or_skip()
    import dpnp

    q, k, v = _qkv(rng, (1, 2, 5, 16))
    mask = np.zeros((1, 1, 5, 5), np.float32)
    mask[..., 2] = 3e38
    on_device = [dpnp.asarray(x, sycl_queue=queue) for x in (q, k, v, mask)]
    out = dpnp.asnumpy(ga.scaled_dot_product_attention(*on_device[:3], attn_mask=on_device[3]))
    assert_close(out, sdpa_reference(q, k, v, attn_mask=mask), "f32")
    # The plugin checks each USM view's reach against the array it was given, as the CPU binding does.
    partition = _sdpa_graph()[0].partition  # (1, 2, 5, 8) operands
    compiled = partition.compile(partition.get_input_ports(), partition.get_output_ports(), ga.Engine(queue))
    q8, k8, v8 = (dpnp.asarray(x, sycl_queue=queue) for x in _qkv(rng))
    short = dpnp.asarray(np.asarray(dpnp.asnumpy(v8))[:, :1], sycl_queue=queue)
    with pytest.raises(ValueError, match="value: its strides .* outside its buffer"):
        compiled.execute_unchecked({0: q8, 1: k8, 2: short},
                                   {5: dpnp.empty((1, 2, 5, 8), dtype=np.float32, sycl_queue=queue)})


def test_execute_names_a_tensor_whose_byte_strides_are_not_whole_elements(sdpa_graph, rng):
    compiled, engine, stream, (q, k, v), out = sdpa_graph
    base = np.zeros(4000, np.float32)
    odd = np.lib.stride_tricks.as_strided(base, shape=q.shape, strides=(1280, 640, 128, 2))  # 2 bytes: half an f32
    _, key, value = _qkv(rng)
    with pytest.raises(ValueError, match="tensor 0 has byte strides .* not multiples of its element size"):
        compiled.execute(stream, [ga.Tensor(q, engine, odd), ga.Tensor(k, engine, key), ga.Tensor(v, engine, value)],
                         [ga.Tensor(out, engine, np.zeros(out.shape, np.float32))])


HUGE_EQUAL_KEYS_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.dtypes import as_data_type, numpy_dtype
rng = np.random.default_rng(3)
for dtype in ("f32", "bf16", "f16"):
    dt = numpy_dtype(as_data_type(dtype))
    big = 6e4 if dtype == "f16" else 1e5
    pattern = np.sign(rng.standard_normal((1, 8, 1, 64)))
    q = (np.sign(rng.standard_normal((1, 8, 256, 1))) * pattern * big).astype(dt)
    k = np.repeat(pattern * big, 300, axis=2).astype(dt)
    v = rng.standard_normal((1, 8, 300, 64)).astype(dt)
    out = np.asarray(ga.scaled_dot_product_attention(q, k, v), np.float64)
    mean = np.asarray(v, np.float64).mean(axis=2, keepdims=True)
    print(dtype, ga.forward_isa(dtype, 256, 300, batch=8, head_dim=64), float(np.abs(out - mean).max()))
"""


def test_huge_equal_scores_on_every_forward_build_give_the_mean_of_v():
    """300 equal keys whose scores pass 2^32: P is uniform, the output V's mean, on every build (with two
    threads, f32 at these lengths takes the AMX build amx_bf16x6 where there is one)."""
    from subprocess_helpers import run_python

    for line in run_python(HUGE_EQUAL_KEYS_SCRIPT, OMP_NUM_THREADS="2").splitlines():
        dtype, isa, error = line.split()
        rtol, atol = TOLERANCES[as_data_type(dtype)]
        assert float(error) <= atol + rtol, f"{dtype} on {isa}: max error {error}"  # |V's mean| is under 1


FOUR_BATCH_DIMS_SCRIPT = """
import numpy as np, graphattn as ga
from graphattn.testing import assert_close, sdpa_reference
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 2, 2, 4, 16, 32)).astype(np.float32)
assert_close(ga.scaled_dot_product_attention(q, q, q, is_causal=True), sdpa_reference(q, q, q, is_causal=True), "f32")
"""


def test_four_batch_dims_run_fused():
    """Batch dims beyond the kernel's three fold where every operand walks them as one (a causal call of
    shape (2,2,2,4,16,32) ran on the O(S^2) reference)."""
    from subprocess_helpers import run_python_logged

    _, log = run_python_logged(FOUR_BATCH_DIMS_SCRIPT, GRAPHATTN_VERBOSE="1")
    compiles = [line for line in log.splitlines() if ",compile," in line]
    assert compiles and all("sdpa_forward_cpu" in line for line in compiles), compiles
