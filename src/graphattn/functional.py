"""The one-call API: scaled_dot_product_attention with PyTorch's arguments and OpenVINO SDPA-13 broadcasting.

Each call builds (once per signature) the SDPA graph through the public graph
API, compiles its single fused partition and caches it; later calls with the
same shapes, strides, dtypes and flags only bind data and run the kernel.
"""
from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import arguments, key_window, sycl_runtime, verbose
from .dtypes import DataType, from_numpy as dtype_of, numpy_dtype
from .engine import Engine, Stream
from .builder import GraphBuilder
from .ops.broadcast import broadcast_shapes
from .interop import (from_numpy, is_torch_tensor, plain_torch_tensors, to_numpy, torch_empty, torch_empty_like,
                      torch_layout, torch_random_seed)
from .tensor import Tensor, element_strides

_ENGINE = Engine("cpu")
_STREAM = Stream(_ENGINE)
_CACHE_SIZE = 256


class SignatureCache:
    """Entries by call signature (layouts, dtypes, flags): the last _CACHE_SIZE used are kept."""

    def __init__(self):
        self._entries: OrderedDict = OrderedDict()

    def get(self, signature):
        """The entry, or None.  A hit counts as a use once the cache is half full: before that nothing can be
        evicted for _CACHE_SIZE / 2 more new signatures, and the reordering took 0.4 us of a tiny call's 5.5 us."""
        entry = self._entries.get(signature)
        if entry is not None and len(self._entries) > _CACHE_SIZE // 2:
            try:
                self._entries.move_to_end(signature)
            except KeyError:  # another thread evicted it since the lookup: the entry itself is still good
                pass
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, signature, entry) -> None:
        self._entries[signature] = entry
        while len(self._entries) > _CACHE_SIZE:
            try:
                self._entries.popitem(last=False)
            except KeyError:  # another thread emptied it meanwhile
                break


_cache = SignatureCache()  # compiled partitions of the forward

ALIGNMENTS = key_window.ALIGNMENTS
_NO_LIMIT = key_window.NO_LIMIT
# The dtypes of query, key and value the kernels take.
_KERNEL_FLOATS = frozenset(numpy_dtype(dt) for dt in (DataType.f32, DataType.bf16, DataType.f16))


@dataclass
class _Compiled:
    compiled: object          # CompiledPartition
    roles: dict[str, int]     # role -> tensor id
    out_shape: tuple
    stats_shape: tuple | None
    fixed: dict               # tensor id -> the inputs every call of this signature passes the same
    runner: object            # the kernel's direct call (CompiledPartition.bound_runner), or None
    out_dtype: np.dtype       # the output's NumPy dtype
    default_scale: float      # 1 / sqrt(E), the scale of calls without one
    out_like_query: bool      # the output has the query's shape and C-contiguous layout (its dtype always)
    query_shape: tuple        # the shape the query was compiled for (V's batch dims may broadcast it)


def new_dropout_seed() -> int:
    """A fresh 63-bit seed from the OS's entropy (what dropout_seed=None uses)."""
    return secrets.randbits(63)


def _strides(a) -> tuple:
    """Element strides of a NumPy or USM array."""
    return sycl_runtime.usm_element_strides(a) if sycl_runtime.is_usm_array(a) else element_strides(a)


def _layout(a) -> tuple:
    if type(a) is np.ndarray:  # byte strides pin the layout as well as element strides, and cost nothing
        return a.shape, a.strides if a.size else a.shape, a.dtype.str
    return tuple(a.shape), _strides(a) if a.size else tuple(a.shape), a.dtype.str


_sycl_engines: dict = {}


def _engine_for(queue) -> tuple[Engine, Stream]:
    """The engine a call runs on: the CPU, or one SYCL engine per dpctl queue its USM inputs live on."""
    if queue is None:
        return _ENGINE, _STREAM
    pair = _sycl_engines.get(queue)
    if pair is None:
        engine = Engine("sycl", queue=queue)
        pair = _sycl_engines[queue] = (engine, Stream(engine))
    return pair


def _sycl_inputs(query, key, value, attn_mask):
    """(q, k, v, mask, queue) when the inputs are USM arrays (dpnp or usm_ndarray), else None."""
    arrays = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    if all(type(a) is np.ndarray or is_torch_tensor(a) for a in arrays):  # host arrays: the common case, checked first
        return None
    on_device = [sycl_runtime.is_usm_array(a) for a in arrays]
    if not any(on_device):
        return None
    if not all(on_device):
        raise TypeError("query, key, value and attn_mask must all be USM arrays (dpnp) or all host arrays")
    queue = sycl_runtime.array_queue(query)
    for name, a in zip(("key", "value", "attn_mask"), arrays[1:]):
        if sycl_runtime.array_queue(a).sycl_context != queue.sycl_context:
            raise ValueError(f"{name} lives on another SYCL context than query")
    for name, a in zip(("query", "key", "value"), arrays[:3]):
        if a.dtype not in (np.float32, np.float16):
            raise TypeError(f"{name} dtype {a.dtype} is not supported on SYCL by the functional API (float32 or "
                            "float16; bf16 data runs through the graph API as uint16 bit patterns)")
    return query, key, value, attn_mask, queue


def _empty_like_kind(template, shape, dtype, queue):
    """An output array: NumPy on the CPU, else the USM kind of template (dpnp array or usm_ndarray)."""
    if queue is None:
        return np.empty(shape, dtype)
    if type(template).__module__.startswith("dpnp.tensor"):
        import dpnp.tensor as dpt

        return dpt.empty(shape, dtype=dtype, sycl_queue=queue)
    import dpnp

    return dpnp.empty(shape, dtype=dtype, sycl_queue=queue)


def _check_inputs(q, k, v, mask, is_causal, enable_gqa, causal_alignment, kind="numpy"):
    """The rules of a new signature (shapes, dtypes, flags) on NumPy or USM arrays; kind is the caller's array
    kind, for messages in its terms.  Returns whether the call is grouped-query (enable_gqa with fewer K/V
    heads)."""
    operands = (("query", q), ("key", k), ("value", v)) + ((("attn_mask", mask),) if mask is not None else ())
    for name, a in operands:
        if isinstance(a, np.ndarray):
            arguments.check_host_array(a, name)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 3:
            raise ValueError(f"{name} must have at least 3 dims (..., seq, head_dim), got shape {a.shape}")
        if a.dtype not in _KERNEL_FLOATS:
            raise arguments.unsupported_float(name, a.dtype, kind)
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"query, key and value must share one dtype, got {arguments.dtype_text(q.dtype, kind)}, "
                        f"{arguments.dtype_text(k.dtype, kind)}, {arguments.dtype_text(v.dtype, kind)}")
    if mask is not None and mask.dtype != np.bool_ and mask.dtype not in (q.dtype, np.float32):
        raise TypeError(f"attn_mask dtype {arguments.dtype_text(mask.dtype, kind)} is not supported; a mask is "
                        f"bool or float ({arguments.dtype_text(np.float32, kind)} or the query's "
                        f"{arguments.dtype_text(q.dtype, kind)})")
    arguments.check_head_sizes(q.shape, k.shape, v.shape)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head dims differ: query {q.shape} (E={q.shape[-1]}) vs key {k.shape} "
                         f"(E={k.shape[-1]})")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value sequence lengths differ: key {k.shape} vs value {v.shape}")
    if is_causal and mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both")
    key_window.checked_alignment(causal_alignment)
    hq, hkv = q.shape[-3], k.shape[-3]
    gqa = enable_gqa and hq != hkv
    if gqa:
        if k.shape[-3] != v.shape[-3]:
            raise ValueError(f"key and value head counts differ: key {k.shape} vs value {v.shape}")
        if hq % hkv:
            raise ValueError(f"enable_gqa needs query heads divisible by key/value heads: Hq={hq}, Hkv={hkv} "
                             f"(query {q.shape}, key {k.shape})")
        batch_shapes = [q.shape[:-3], k.shape[:-3], v.shape[:-3]]
    else:
        batch_shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    try:
        batch = broadcast_shapes(batch_shapes, "batch")
    except ValueError:
        hint = " (different head counts need enable_gqa=True)" if hq != hkv and not enable_gqa else ""
        raise ValueError(f"batch dims of query {q.shape}, key {k.shape} and value {v.shape} "
                         f"are not broadcastable{hint}") from None
    if gqa:
        batch = batch + (hq,)
    if mask is not None:
        target = batch + (q.shape[-2], k.shape[-2])
        try:
            if broadcast_shapes([target, mask.shape], "mask") != target:
                raise ValueError
        except ValueError:
            raise ValueError(f"attn_mask of shape {mask.shape} does not broadcast to {target} "
                             "(batch..., L, S)") from None
    return gqa


def _query_over_value_batch(q: np.ndarray, k: np.ndarray, v: np.ndarray, gqa: bool) -> np.ndarray:
    """Q viewed (stride 0, no copy) over the batch dims that V's alone bring beyond Q's and K's, so that the
    scores, and the stats, have one row per output row: each is then written once, by one thread."""
    lead = 3 if gqa else 2
    batch = broadcast_shapes([q.shape[:-lead], k.shape[:-lead], v.shape[:-lead]], "batch")
    if batch == broadcast_shapes([q.shape[:-lead], k.shape[:-lead]], "batch"):
        return q
    return np.broadcast_to(q, batch + tuple(q.shape[-lead:]))


def _normalize_mask(mask):
    """None, or an array of rank >= 2; a scalar zero float mask means no mask."""
    if mask is None:
        return None
    if mask.dtype != np.bool_ and mask.ndim == 0 and float(mask) == 0.0:
        return None
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    return mask


def _bound_selects(b: GraphBuilder, score, score_shape, left: int, right: int, alignment: str):
    """The key window as the graph's bound Selects on the scores (patterns/sdpa.py): the right bound
    GreaterEqual(row' + right, col), the left bound GreaterEqual(col, row' - left), row' the aligned row."""
    tensor, op = b.tensor, b.op
    s32, f32 = DataType.s32, DataType.f32
    row = op("GenIndex", [score], [tensor(None, s32, score_shape)], axis=-2)
    col = op("GenIndex", [score], [tensor(None, s32, score_shape)], axis=-1)
    if alignment == "bottom_right":
        row = op("Add", [row, tensor("seq_kv", s32, (1,))], [tensor(None, s32, score_shape)])
        row = op("Subtract", [row, tensor("seq_q", s32, (1,))], [tensor(None, s32, score_shape)])
    fill = tensor("window_fill", f32, (1,))
    if right != _NO_LIMIT:
        last = row if right == 0 else op("Add", [row, tensor("window_right", s32, (1,))],
                                         [tensor(None, s32, score_shape)])
        keep = op("GreaterEqual", [last, col], [tensor(None, DataType.boolean, score_shape)])
        score = op("Select", [keep, score, fill], [tensor(None, f32, score_shape)])
    if left != _NO_LIMIT:
        first = op("Subtract", [row, tensor("window_left", s32, (1,))], [tensor(None, s32, score_shape)])
        keep = op("GreaterEqual", [col, first], [tensor(None, DataType.boolean, score_shape)])
        score = op("Select", [keep, score, fill], [tensor(None, f32, score_shape)])
    return score


def _build(q, k, v, mask, gqa, window, alignment, return_stats, dropout_p, engine) -> _Compiled:
    dt = dtype_of(q.dtype)
    f32 = DataType.f32
    b = GraphBuilder()
    tensor, op, reshape = b.tensor, b.op, b.reshape
    lq = tensor("query", dt, tuple(q.shape), _strides(q))
    lk = tensor("key", dt, tuple(k.shape), _strides(k))
    lv = tensor("value", dt, tuple(v.shape), _strides(v))
    hq, hkv = q.shape[-3], k.shape[-3]
    if gqa:
        rep = hq // hkv
        lq = reshape(lq, q.shape[:-3] + (hkv, rep) + q.shape[-2:])
        lk = reshape(lk, k.shape[:-3] + (hkv, 1) + k.shape[-2:])
        lv = reshape(lv, v.shape[:-3] + (hkv, 1) + v.shape[-2:])
    # The scores take the batch dims of Q and K; V's may broadcast them further, as in PyTorch (P V then does).
    seq_q, seq_kv = q.shape[-2], k.shape[-2]
    score_shape = broadcast_shapes([lq.shape[:-2], lk.shape[:-2]], "batch") + (seq_q, seq_kv)
    score = op("MatMul", [lq, lk], [tensor(None, f32, score_shape)], transpose_b=True)
    score = op("Multiply", [score, tensor("scale", f32, (1,))], [tensor(None, f32, score_shape)])
    if mask is not None:
        lm = tensor("mask", dtype_of(mask.dtype), tuple(mask.shape), _strides(mask))
        if gqa:
            full = (1,) * (q.ndim - mask.ndim) + mask.shape
            heads = (hkv, hq // hkv) if full[-3] == hq else (1, 1)
            lm = reshape(lm, full[:-3] + heads + full[-2:])
        masked_shape = broadcast_shapes([score_shape, lm.shape], "mask")
        if mask.dtype == np.bool_:
            score = op("Select", [lm, score, tensor("fill", f32, (1,))], [tensor(None, f32, masked_shape)])
        else:
            score = op("Add", [score, lm], [tensor(None, f32, masked_shape)])
    left, right = window
    if key_window.is_limited(left, right):
        score = _bound_selects(b, score, b.ops[-1].outputs[0].shape, left, right, alignment)
    masked_shape = b.ops[-1].outputs[0].shape
    softmax_out = [tensor(None, dt, masked_shape)]
    if return_stats:
        softmax_out.append(tensor("stats", f32, masked_shape[:-1] + (1,)))
    op("SoftMax", [score], softmax_out, axis=-1, mode="inf_as_zero")
    probabilities = softmax_out[0]
    if dropout_p > 0.0:
        s64 = DataType.s64
        probabilities = op("Dropout", [probabilities, tensor("seed", s64, (1,)), tensor("offset", s64, (1,))],
                           [tensor(None, dt, masked_shape)], p=dropout_p)
    out_batch = broadcast_shapes([masked_shape[:-2], lv.shape[:-2]], "batch")
    out = op("MatMul", [probabilities, lv], [tensor(None, dt, out_batch + (seq_q, v.shape[-1]))])
    if gqa:
        out = reshape(out, out.shape[:-4] + (hq,) + out.shape[-2:])
    roles = b.roles
    roles["output"] = out.id
    graph = b.graph()
    (partition,) = graph.get_partitions()
    compiled = partition.compile(partition.get_input_ports(), partition.get_output_ports(), engine)
    stats_shape = compiled.query_logical_tensor(roles["stats"]).shape if return_stats else None
    fixed = {}
    for name in ("fill", "window_fill"):
        if name in roles:
            fixed[roles[name]] = np.array([-np.inf], np.float32)
    if "seq_kv" in roles:
        fixed[roles["seq_kv"]] = np.array([seq_kv], np.int32)
        fixed[roles["seq_q"]] = np.array([seq_q], np.int32)
    for name, value in (("window_left", left), ("window_right", right)):
        if name in roles:
            fixed[roles[name]] = np.array([value], np.int32)
    return _Compiled(compiled, roles, compiled.query_logical_tensor(out.id).shape, stats_shape, fixed,
                     compiled.bound_runner(fixed), numpy_dtype(dt), 1.0 / math.sqrt(q.shape[-1]),
                     q.flags.c_contiguous and tuple(q.shape) == tuple(out.shape), tuple(q.shape))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 causal_alignment: str = "top_left", return_stats: bool = False,
                                 dropout_seed: int | None = None, dropout_offset: int = 0, window=None):
    """softmax(Q K^T * scale + mask) V, fused, with PyTorch's arguments.

    query (..., L, E), key (..., S, E), value (..., S, Ev), at least 3 dims;
    batch dims broadcast across query, key, value and attn_mask.  A bool mask
    keeps the positions that are True, a float mask is added; a scalar 0 mask
    means no mask.  is_causal applies the implicit causal mask aligned
    "top_left" (PyTorch) or "bottom_right".  enable_gqa lets key/value have
    fewer heads (dim -3) than query, dividing it; K/V are never repeated.
    window=(left, right) limits the keys each row sees, as flash-attn's
    window_size: key j is visible to row i iff (left < 0 or j >= i' - left)
    and (right < 0 or j <= i' + right), i' the row aligned as causal_alignment
    says; is_causal sets right to 0.  It combines with attn_mask.
    Fully masked rows give 0.  dropout_p > 0 drops probabilities with the
    Philox keep-mask of (dropout_seed, dropout_offset) and scales the kept
    ones by 1 / (1 - dropout_p); the same seed and offset always drop the same
    elements (pass them to the backward too); dropout_seed=None draws a fresh
    seed.  Returns an array of query's kind and dtype, or (out, stats) with
    return_stats, stats being the f32 logsumexp (..., L, 1) of the scores
    (dropout does not change it).
    """
    # torch operands that require grad, and calls torch.compile traces, go through graphattn's torch ops
    if type(query) is not np.ndarray and is_torch_tensor(query):
        torch_ops = _torch_ops or _load_torch_ops()
        if torch_ops.takes(query, key, value, attn_mask):
            return torch_ops.attention(query, key, value, attn_mask, return_stats, dropout_p, is_causal, scale,
                                       enable_gqa, causal_alignment, dropout_seed, dropout_offset, window)
    # torch Q, K, V without a mask go to the kernel as they are (no NumPy views): on decode-sized calls the
    # views cost more than torch's whole call.  New signatures are still checked and built through NumPy.
    torch_direct = attn_mask is None and plain_torch_tensors(query, key, value)
    layouts = torch_layout(query, key, value) if torch_direct else None
    torch_direct = layouts is not None
    on_sycl = None if torch_direct else _sycl_inputs(query, key, value, attn_mask)
    if on_sycl is not None:
        q, k, v, mask, queue = on_sycl
        kind = "usm"
        mask = _normalize_mask(mask)
    elif torch_direct:
        q, k, v, mask, queue, kind = query, key, value, None, None, "torch"
    else:
        q, kind = to_numpy(query, "query")
        k, _ = to_numpy(key, "key")
        v, _ = to_numpy(value, "value")
        mask = _normalize_mask(None if attn_mask is None else to_numpy(attn_mask, "attn_mask")[0])
        queue = None
    if type(dropout_p) is not float or not 0.0 <= dropout_p < 1.0:  # the common float in range costs no call
        dropout_p = arguments.dropout_probability(dropout_p)
    # The window as (left, right), is_causal included; a plain call costs no function call here.
    bounds = (_NO_LIMIT, 0 if is_causal else _NO_LIMIT) if window is None else \
        key_window.effective_window(window, is_causal)
    # A signature seen before was validated when it was built: only new ones are checked.
    if torch_direct:
        signature = (layouts, bool(enable_gqa), bounds, causal_alignment, bool(return_stats), dropout_p)
    else:
        signature = (_layout(q), _layout(k), _layout(v), _layout(mask) if mask is not None else None,
                     bool(enable_gqa), bounds, causal_alignment, bool(return_stats), dropout_p, queue)
    entry = _cache.get(signature)
    if entry is None:
        # Checked and built on NumPy views (the same memory); a torch tensor off the CPU is refused here.
        qc, kc, vc = (to_numpy(x, name)[0] for x, name in ((q, "query"), (k, "key"), (v, "value"))) \
            if torch_direct else (q, k, v)
        gqa = _check_inputs(qc, kc, vc, mask, is_causal, enable_gqa, causal_alignment, kind)
        if queue is None:
            qc = _query_over_value_batch(qc, kc, vc, gqa)
        entry = _build(qc, kc, vc, mask, gqa, bounds, causal_alignment, return_stats, dropout_p,
                       _engine_for(queue)[0])
        _cache.put(signature, entry)
    if torch_direct and entry.runner is None:  # the reference executor (or the verbose log) takes NumPy arrays
        q, k, v = (to_numpy(x, name)[0] for x, name in ((q, "query"), (k, "key"), (v, "value")))
        torch_direct = False

    scale_value = entry.default_scale if scale is None else arguments.scale_value(scale)
    seed = offset = 0
    if dropout_p > 0.0:
        if dropout_seed is None:  # torch callers draw from torch's generator, so torch.manual_seed repeats it
            seed = torch_random_seed() if kind == "torch" else new_dropout_seed()
        else:
            seed = _s64(dropout_seed, "dropout_seed")
        offset = _s64(dropout_offset, "dropout_offset")
    if torch_direct:
        # empty_like: 0.9 us a call on the AMD machine, against 1.4 us from the shape and dtype (2.1 for bf16)
        out = torch_empty_like(q) if entry.out_like_query else torch_empty(entry.out_shape, entry.out_dtype)
        stats = torch_empty(entry.stats_shape, np.float32) if return_stats else None
    else:
        out = _empty_like_kind(q, entry.out_shape, entry.out_dtype, queue)
        stats = _empty_like_kind(q, entry.stats_shape, np.float32, queue) if return_stats else None
    if entry.runner is not None and not verbose.enabled():
        # The signature pins every layout this partition was compiled for; the kernel is called directly
        # (a tiny call spends more in building the execute's dicts than in the kernel).
        entry.runner(q, k, v, out, mask, stats, scale_value, seed, offset)
        return _results(out, stats, torch_direct, kind)
    roles = entry.roles
    if queue is None and tuple(q.shape) != entry.query_shape:
        q = np.broadcast_to(q, entry.query_shape)  # as _query_over_value_batch viewed it at build time
    data = {roles["query"]: q, roles["key"]: k, roles["value"]: v,
            roles["scale"]: np.array([scale_value], np.float32), **entry.fixed}
    if "mask" in roles:
        data[roles["mask"]] = mask
    if "seed" in roles:
        data[roles["seed"]] = np.array([seed], np.int64)
        data[roles["offset"]] = np.array([offset], np.int64)
    outputs = {roles["output"]: out}
    if return_stats:
        outputs[roles["stats"]] = stats
    compiled = entry.compiled
    engine, stream = _engine_for(queue)
    if queue is None:  # the signature pins every layout this partition was compiled for
        compiled.execute_unchecked(data, outputs)
    else:
        compiled.execute(stream, [Tensor(lt, engine, data[lt.id]) for lt in compiled.inputs],
                         [Tensor(lt, engine, outputs[lt.id]) for lt in compiled.outputs])
        stream.wait()  # dpnp does not know the kernel's event: its results are ready on return
    return _results(out, stats, torch_direct, kind)


_torch_ops = None  # graphattn.torch_autograd, once a torch call has been seen (it imports torch)


def _load_torch_ops():
    """graphattn.torch_autograd, imported once: an import statement on every torch call would cost a tiny call
    more than its checks."""
    global _torch_ops
    from . import torch_autograd

    _torch_ops = torch_autograd
    return _torch_ops


def _s64(value, name: str) -> int:
    value = arguments.integer(value, name)
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {value}")
    return value


def _results(out, stats, torch_direct: bool, kind: str):
    """out, or (out, stats), as the caller's array kind."""
    if stats is None:
        return out if torch_direct else from_numpy(out, kind)
    stats_shape = tuple(out.shape[:-1]) + (1,)
    if (stats.numel() if torch_direct else stats.size) == math.prod(stats_shape):
        stats = stats.reshape(stats_shape)  # GQA stats come as (..., Hkv, rep, L, 1): query's heads
    else:  # USM only: V's batch dims broadcast the output beyond the scores (host calls view Q over them,
        # _query_over_value_batch), and each row's stats repeat over those dims
        import dpnp

        stats = stats.reshape((1,) * (len(stats_shape) - stats.ndim) + tuple(stats.shape))
        stats = dpnp.ascontiguousarray(dpnp.broadcast_to(stats, stats_shape))
    return (out, stats) if torch_direct else (from_numpy(out, kind), from_numpy(stats, kind))
