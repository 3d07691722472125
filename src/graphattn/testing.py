"""Helpers for checking graphattn against its reference: tolerances, random data, SDPA graph builders.

TOLERANCES is the one place where the accepted error of a fused kernel
against the float64 reference executor is stated, per output dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import key_window
from .attention_spec import default_scale
from .dtypes import DataType, as_data_type, numpy_dtype
from .builder import GraphBuilder
from .graph import Graph

# (rtol, atol) of a fused kernel's result against the reference executor.
# bf16/f16: the output itself is rounded to 8/11 significant bits, so one
# rounding step of a value near 2 must pass.
TOLERANCES: dict[DataType, tuple[float, float]] = {
    DataType.f32: (1e-4, 1e-5),
    DataType.bf16: (2e-2, 2e-2),
    DataType.f16: (2e-3, 2e-3),
}
# stats (logsumexp) are f32 whatever the input dtype.
STATS_TOLERANCE = (1e-4, 1e-4)
# (rtol, atol as a fraction of the largest expected magnitude) of gradients:
# each is a sum over a whole sequence of rounded products, so its absolute
# error grows with the gradient's scale, not with the single element's.
GRAD_TOLERANCES: dict[DataType, tuple[float, float]] = {
    DataType.f32: (1e-4, 1e-5),
    DataType.bf16: (2e-2, 1e-2),
    DataType.f16: (4e-3, 2e-3),
}



def cpuinfo_field(key: str) -> str:
    """The first value of `key` ("model name", "vendor_id", ...) in /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.split(":", 1)[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

def assert_close(actual: np.ndarray, expected: np.ndarray, dtype, what: str = "result",
                 tolerance: tuple[float, float] | None = None) -> None:
    """Asserts equal NaN and infinity positions and |actual - expected| <= atol + rtol * |expected| elsewhere."""
    rtol, atol = tolerance or TOLERANCES[as_data_type(dtype)]
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}")
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    if not np.array_equal(nan_a, nan_e):
        raise AssertionError(f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} differs from expected")
    inf_e = np.isinf(e)
    if not np.array_equal(a[inf_e], e[inf_e]):
        raise AssertionError(f"{what}: infinities differ from expected")
    finite = ~(nan_e | inf_e)
    err = np.abs(a[finite] - e[finite])
    bound = atol + rtol * np.abs(e[finite])
    if err.size and np.any(err > bound):
        worst = int(np.argmax(err - bound))
        raise AssertionError(f"{what}: max error {err.max():.3g} exceeds atol={atol} rtol={rtol} "
                             f"(worst: got {a[finite][worst]:.6g}, expected {e[finite][worst]:.6g})")


def random_array(shape, dtype, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(numpy_dtype(as_data_type(dtype)))


# Rows and columns of sentinel around each output of run_into_padded_outputs; SENTINEL is exact in every
# float dtype, and no kernel writes it by chance where a gap stays untouched.
PADDED_OUTPUT_GAPS = ((1, 2), (3, 5))  # (before, after) the rows, then the columns
SENTINEL = -1536.0


def run_into_padded_outputs(partition, inputs: dict) -> tuple[dict, dict]:
    """Compiles a CPU partition with every output a view into a larger buffer of SENTINEL (gaps around its
    rows and its columns, PADDED_OUTPUT_GAPS), runs it, and returns ({id: output view}, {id: True where
    the gaps around that output still hold only SENTINEL})."""
    from .engine import Engine, Stream
    from .logical_tensor import LogicalTensor
    from .tensor import Tensor, element_strides

    engine = Engine("cpu")
    (rows_before, rows_after), (cols_before, cols_after) = PADDED_OUTPUT_GAPS
    backings, views, out_lts = {}, {}, []
    for port in partition.get_output_ports():
        *outer, rows, cols = port.shape
        backing = np.full((*outer, rows_before + rows + rows_after, cols_before + cols + cols_after), SENTINEL,
                          numpy_dtype(port.dtype))
        views[port.id] = backing[..., rows_before:rows_before + rows, cols_before:cols_before + cols]
        backings[port.id] = backing
        out_lts.append(LogicalTensor(port.id, port.dtype, port.shape, element_strides(views[port.id])))
    in_lts = [LogicalTensor(lt.id, lt.dtype, inputs[lt.id].shape, element_strides(inputs[lt.id]))
              for lt in partition.get_input_ports()]
    compiled = partition.compile(in_lts, out_lts, engine)
    compiled.execute(Stream(engine), [Tensor(lt, engine, inputs[lt.id]) for lt in compiled.inputs],
                     [Tensor(lt, engine, views[lt.id]) for lt in compiled.outputs])
    untouched = {}
    for tid, backing in backings.items():
        gaps = np.ones(backing.shape, bool)
        gaps[..., rows_before:backing.shape[-2] - rows_after, cols_before:backing.shape[-1] - cols_after] = False
        untouched[tid] = bool(np.all(backing[gaps] == SENTINEL))
    return views, untouched


@dataclass
class SdpaGraphSpec:
    """One variant of the spec's SDPA forward pattern, built through the public graph API.

    mask: None | "add" | "select" | "causal_top_left" | "causal_bottom_right"
    gqa: "none" | "4d" (StaticReshape around 4D tensors) | "5d" (native 5D)
    reorder: None | "transpose" | "transpose_reshape" (output to (N, S, H, Dv) or (N, S, H*Dv))
    causal_form: "ge" = Select(row >= col, score, -inf) (oneDNN's form);
                 "gt" = Select(col > row, -inf, score) (the RFC's form)
    layout: "bhsd" (dense inputs) or "bshd" (Q, K, V are strided views of (N, S, H, D) arrays)
    dropout: p of a Dropout between SoftMax and MatMul(P, V) (0 = none), with s64 seed and offset inputs
    window_left: a key window's left bound after any mask, Select(GreaterEqual(col, row' - left), score, -inf),
                 left an s32 input (None = none); row' is shifted as the causal mask's (bottom-right aligns
                 to the keys' end)
    window_alignment: the row shift of a left bound without a causal mask: "top_left" or "bottom_right"
    softcap: c of a logit softcap after the scale, Divide(c) -> Tanh -> Multiply(c), c two f32 inputs
             (softcap_divisor, softcap) (None = none; forward graphs only)
    """
    batch: int = 1
    heads_q: int = 2
    heads_kv: int | None = None
    seq_q: int = 16
    seq_kv: int | None = None
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "f32"
    scale: str | None = "multiply"
    mask: str | None = None
    mask_shape: tuple | None = None
    gqa: str = "none"
    reorder: str | None = None
    stats: bool = False
    softmax_mode: str = "none"
    causal_form: str = "ge"
    key_transposed: bool = False
    layout: str = "bhsd"
    dropout: float = 0.0
    window_left: int | None = None
    window_alignment: str = "top_left"
    softcap: float | None = None
    ids: dict = field(default_factory=dict, init=False, repr=False)

    def with_(self, **changes) -> "SdpaGraphSpec":
        return replace(self, **changes)

    @property
    def hkv(self) -> int:
        return self.heads_kv or self.heads_q

    @property
    def skv(self) -> int:
        return self.seq_kv or self.seq_q

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    def input_shapes(self) -> dict[str, tuple]:
        n, hq, hkv, sq, skv, d, dv = self.batch, self.heads_q, self.hkv, self.seq_q, self.skv, self.head_dim, self.dv
        if self.gqa == "5d":
            rep = hq // hkv
            q, k, v = (n, hkv, rep, sq, d), (n, hkv, 1, skv, d), (n, hkv, 1, skv, dv)
        else:
            q, k, v = (n, hq, sq, d), (n, hkv, skv, d), (n, hkv, skv, dv)
        if self.key_transposed:
            k = k[:-2] + (d, skv)
        mask = self.mask_shape or ((1, 1, sq, skv) if self.gqa != "none" else (n, hq, sq, skv))
        return {"query": q, "key": k, "value": v, "mask": mask}

    def _scores(self, b: GraphBuilder):
        """Q, K, V and the masked scores, as the forward and the backward graphs both begin."""
        dt = as_data_type(self.dtype)
        f32 = DataType.f32
        shapes = self.input_shapes()
        tensor, op, reshape = b.tensor, b.op, b.reshape

        n, hq, hkv, sq, skv, d, dv = self.batch, self.heads_q, self.hkv, self.seq_q, self.skv, self.head_dim, self.dv
        rep = hq // hkv
        q = tensor("query", dt, shapes["query"])
        k = tensor("key", dt, shapes["key"])
        v = tensor("value", dt, shapes["value"])
        if self.gqa == "4d":
            q = reshape(q, (n, hkv, rep, sq, d))
            k = reshape(k, (n, hkv, 1) + shapes["key"][-2:])
            v = reshape(v, (n, hkv, 1, skv, dv))
        batch = q.shape[:-2]
        score_shape = batch + (sq, skv)
        score = op("MatMul", [q, k], [tensor(None, f32, score_shape)], transpose_b=not self.key_transposed)
        if self.scale == "multiply":
            score = op("Multiply", [score, tensor("scale", dt, (1,))], [tensor(None, f32, score_shape)])
        elif self.scale == "divide":
            score = op("Divide", [score, tensor("scale", dt, (1,))], [tensor(None, f32, score_shape)])
        if self.softcap is not None:
            capped = op("Divide", [score, tensor("softcap_divisor", f32, (1,))], [tensor(None, f32, score_shape)])
            capped = op("Tanh", [capped], [tensor(None, f32, score_shape)])
            score = op("Multiply", [capped, tensor("softcap", f32, (1,))], [tensor(None, f32, score_shape)])
        masked_shape = score_shape
        if self.mask == "add":
            mask = tensor("mask", dt, shapes["mask"])
            masked_shape = _broadcast(score_shape, mask.shape)
            score = op("Add", [score, mask], [tensor(None, f32, masked_shape)])
        elif self.mask == "select":
            mask = tensor("mask", DataType.boolean, shapes["mask"])
            masked_shape = _broadcast(score_shape, mask.shape)
            fill = tensor("fill", f32, (1,))
            score = op("Select", [mask, score, fill], [tensor(None, f32, masked_shape)])
        elif self.mask in ("causal_top_left", "causal_bottom_right"):
            row = op("GenIndex", [score], [tensor(None, DataType.s32, score_shape)], axis=-2)
            col = op("GenIndex", [score], [tensor(None, DataType.s32, score_shape)], axis=-1)
            if self.mask == "causal_bottom_right":
                row = op("Add", [row, tensor("seq_kv", DataType.s32, (1,))], [tensor(None, DataType.s32, score_shape)])
                row = op("Subtract", [row, tensor("seq_q", DataType.s32, (1,))],
                         [tensor(None, DataType.s32, score_shape)])
            fill = tensor("fill", f32, (1,))
            cond_out = tensor(None, DataType.boolean, score_shape)
            if self.causal_form == "ge":
                cond = op("GreaterEqual", [row, col], [cond_out])
                score = op("Select", [cond, score, fill], [tensor(None, f32, score_shape)])
            else:
                cond = op("GreaterThan", [col, row], [cond_out])
                score = op("Select", [cond, fill, score], [tensor(None, f32, score_shape)])
        if self.window_left is not None:
            s32 = DataType.s32
            row = op("GenIndex", [score], [tensor(None, s32, masked_shape)], axis=-2)
            col = op("GenIndex", [score], [tensor(None, s32, masked_shape)], axis=-1)
            if self.alignment == "bottom_right":
                row = op("Add", [row, tensor("window_seq_kv", s32, (1,))], [tensor(None, s32, masked_shape)])
                row = op("Subtract", [row, tensor("window_seq_q", s32, (1,))], [tensor(None, s32, masked_shape)])
            first = op("Subtract", [row, tensor("window_left", s32, (1,))], [tensor(None, s32, masked_shape)])
            keep = op("GreaterEqual", [col, first], [tensor(None, DataType.boolean, masked_shape)])
            score = op("Select", [keep, score, tensor("window_fill", f32, (1,))], [tensor(None, f32, masked_shape)])
        return q, k, v, score, masked_shape

    @property
    def alignment(self) -> str:
        """The rows' alignment to the keys: the causal mask's, else window_alignment."""
        if self.mask in ("causal_top_left", "causal_bottom_right"):
            return self.mask[len("causal_"):]
        return self.window_alignment

    def build(self) -> Graph:
        """Builds the graph; self.ids maps role names (query, key, ..., output, stats) to tensor ids."""
        dt = as_data_type(self.dtype)
        f32 = DataType.f32
        b = GraphBuilder()
        tensor, op, reshape = b.tensor, b.op, b.reshape
        n, hq, sq, dv = self.batch, self.heads_q, self.seq_q, self.dv
        q, k, v, score, masked_shape = self._scores(b)
        softmax_outputs = [tensor(None, dt, masked_shape)]
        if self.stats:
            softmax_outputs.append(tensor("stats", f32, masked_shape[:-1] + (1,)))
        op("SoftMax", [score], softmax_outputs, axis=-1, mode=self.softmax_mode)
        probabilities = softmax_outputs[0]
        if self.dropout:
            s64 = DataType.s64
            probabilities = op("Dropout", [probabilities, tensor("seed", s64, (1,)), tensor("offset", s64, (1,))],
                               [tensor(None, dt, masked_shape)], p=self.dropout)
        out_shape = masked_shape[:-2] + (sq, dv)
        out = op("MatMul", [probabilities, v], [tensor(None, dt, out_shape)])
        if self.gqa == "4d":
            out = reshape(out, (n, hq, sq, dv))
        if self.reorder:
            out = op("StaticTranspose", [out], [tensor(None, dt, (n, sq, hq, dv))], order=[0, 2, 1, 3])
            if self.reorder == "transpose_reshape":
                out = reshape(out, (n, sq, hq * dv))
        self.ids.clear()
        self.ids.update(b.roles, output=out.id)
        return b.graph()

    def backward_case(self, rng: np.random.Generator, grad_mask: bool = False) -> tuple[Graph, dict]:
        """(backward graph, its input data by tensor id): random forward inputs, the stats the forward graph
        computes from them on the CPU, and a random grad_output.  self.ids then names the backward's tensors."""
        from .run import run_graph

        forward = self.build()
        inputs = self.random_inputs(rng)
        results = run_graph(forward, inputs)
        forward_ids = dict(self.ids)
        backward = self.build_backward(grad_mask=grad_mask)
        data = {tid: inputs[forward_ids[role]] for role, tid in self.ids.items()
                if role in forward_ids and forward_ids[role] in inputs}
        data[self.ids["stats"]] = results[forward_ids["stats"]]
        data[self.ids["grad_output"]] = random_array(results[forward_ids["output"]].shape, self.dtype, rng)
        return backward, data

    def build_backward(self, grad_mask: bool = False) -> Graph:
        """The spec's training-backward graph for the same variant: inputs Q, K, V, [mask], stats,
        grad_output (and scale, fill, seed, offset as the forward); outputs grad_query, grad_key,
        grad_value and, with grad_mask, dS marked by End.  self.ids maps those roles to tensor ids."""
        if self.softcap is not None:
            raise ValueError("build_backward: the training graph of a softcap (its Tanh's derivative) is not built")
        dt = as_data_type(self.dtype)
        f32 = DataType.f32
        b = GraphBuilder()
        tensor, op, reshape = b.tensor, b.op, b.reshape
        n, hq, hkv, sq, skv, d, dv = self.batch, self.heads_q, self.hkv, self.seq_q, self.skv, self.head_dim, self.dv
        q, k, v, score, masked_shape = self._scores(b)
        batch = masked_shape[:-2]
        stats = tensor("stats", f32, masked_shape[:-1] + (1,))
        p = op("Exp", [op("Subtract", [score, stats], [tensor(None, f32, masked_shape)])],
               [tensor(None, f32, masked_shape)])
        seed_offset = []
        if self.dropout:
            seed_offset = [tensor("seed", DataType.s64, (1,)), tensor("offset", DataType.s64, (1,))]
        p_used = p
        if self.dropout:
            p_used = op("Dropout", [p] + seed_offset, [tensor(None, f32, masked_shape)], p=self.dropout)
        if dt != f32:
            p_used = op("TypeCast", [p_used], [tensor(None, dt, masked_shape)])
        grad_out = tensor("grad_output", dt, (n, hq, sq, dv) if self.gqa == "4d" else batch + (sq, dv))
        if self.gqa == "4d":
            grad_out = reshape(grad_out, batch + (sq, dv))
        grad_v = op("MatMul", [p_used, grad_out], [tensor(None, dt, batch + (skv, dv))], transpose_a=True)
        grad_p = op("MatMul", [grad_out, v], [tensor(None, f32, masked_shape)], transpose_b=True)
        if self.dropout:
            grad_p = op("Dropout", [grad_p] + seed_offset, [tensor(None, f32, masked_shape)], p=self.dropout)
        grad_s = op("SoftMaxBackward", [grad_p, p], [tensor(None, f32, masked_shape)], axis=-1)
        if grad_mask:
            op("End", [grad_s], [])
        grad_scores = grad_s
        if self.scale in ("multiply", "divide"):
            kind = "Multiply" if self.scale == "multiply" else "Divide"
            grad_scores = op(kind, [grad_s, b.by_role["scale"]], [tensor(None, f32, masked_shape)])
        if dt != f32:
            grad_scores = op("TypeCast", [grad_scores], [tensor(None, dt, masked_shape)])
        grad_q = op("MatMul", [grad_scores, k], [tensor(None, dt, batch + (sq, d))])
        grad_k = op("MatMul", [grad_scores, q], [tensor(None, dt, batch + (skv, d))], transpose_a=True)
        if self.gqa != "none":
            grad_k = op("ReduceSum", [grad_k], [tensor(None, dt, batch[:-1] + (1, skv, d))], axes=[-3], keep_dims=True)
            grad_v = op("ReduceSum", [grad_v], [tensor(None, dt, batch[:-1] + (1, skv, dv))], axes=[-3],
                        keep_dims=True)
        if self.gqa == "4d":
            grad_q = reshape(grad_q, (n, hq, sq, d))
            grad_k = reshape(grad_k, (n, hkv, skv, d))
            grad_v = reshape(grad_v, (n, hkv, skv, dv))
        self.ids.clear()
        self.ids.update(b.roles, grad_query=grad_q.id, grad_key=grad_k.id, grad_value=grad_v.id)
        if grad_mask:
            self.ids["grad_mask"] = grad_s.id
        return b.graph()

    def random_inputs(self, rng: np.random.Generator) -> dict[int, np.ndarray]:
        """Random Q/K/V/mask data plus the scalar inputs, keyed by tensor id (call build() first)."""
        ids, shapes, dt = self.ids, self.input_shapes(), as_data_type(self.dtype)
        data = {}
        for role in ("query", "key", "value"):
            shape = shapes[role]
            if self.layout == "bshd" and len(shape) == 4:
                n, h, s, d = shape
                data[ids[role]] = random_array((n, s, h, d), dt, rng).transpose(0, 2, 1, 3)
            else:
                data[ids[role]] = random_array(shape, dt, rng)
        if "scale" in ids:
            value = default_scale(self.head_dim) if self.scale == "multiply" else 1 / default_scale(self.head_dim)
            data[ids["scale"]] = np.array([value], numpy_dtype(dt))
        if "mask" in ids and self.mask == "add":
            mask = random_array(shapes["mask"], dt, rng)
            mask[rng.random(mask.shape) < 0.2] = -np.inf
            data[ids["mask"]] = mask
        if "mask" in ids and self.mask == "select":
            data[ids["mask"]] = rng.random(shapes["mask"]) < 0.7
        if "fill" in ids:
            data[ids["fill"]] = np.array([-np.inf], np.float32)
        if "softcap" in ids:
            data[ids["softcap_divisor"]] = data[ids["softcap"]] = np.array([self.softcap], np.float32)
        if "seq_kv" in ids:
            data[ids["seq_kv"]] = np.array([self.skv], np.int32)
            data[ids["seq_q"]] = np.array([self.seq_q], np.int32)
        if "window_left" in ids:
            data[ids["window_left"]] = np.array([self.window_left], np.int32)
            data[ids["window_fill"]] = np.array([-np.inf], np.float32)
            if "window_seq_kv" in ids:
                data[ids["window_seq_kv"]] = np.array([self.skv], np.int32)
                data[ids["window_seq_q"]] = np.array([self.seq_q], np.int32)
        if "seed" in ids:
            data[ids["seed"]] = np.array([int(rng.integers(-2**62, 2**62))], np.int64)
            data[ids["offset"]] = np.array([int(rng.integers(0, 2**40))], np.int64)
        return data


def _broadcast(a: tuple, b: tuple) -> tuple:
    """NumPy's broadcast of two declared shapes, where -1 (unknown) is a size that may be anything: with 1 or
    -1 it stays unknown, with a known size it is that size."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    known = tuple(np.broadcast_shapes(tuple(1 if d == -1 else d for d in a), tuple(1 if d == -1 else d for d in b)))
    return tuple(-1 if k == 1 and -1 in (x, y) else k for k, x, y in zip(known, a, b))


def dropout_multipliers(shape: tuple, dropout_p: float, seed: int, offset: int, first_element: int = 0) -> np.ndarray:
    """1 / (1 - p) where the Philox keep-mask keeps an element of the (..., L, S) probabilities, else 0; their
    element e is the stream's first_element + e (a packed call's sequence starts past the ones before it)."""
    from .ops.philox import dropout_keep_mask
    if not dropout_p:
        return np.ones(shape)
    size = int(np.prod(shape, dtype=np.int64))
    keep = dropout_keep_mask((first_element + size,), dropout_p, seed, offset)[first_element:].reshape(shape)
    return np.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


def _per_head(values) -> np.ndarray:
    """A per-head float64 array ((H,) or (N, H)) broadcastable against scores (..., H, L, S)."""
    return np.asarray(values, np.float64)[..., None, None]


def _modified_scores(raw: np.ndarray, softcap, alibi_slopes, causal_alignment: str):
    """score_mods.hpp's modifiers on float64 scores (..., H, L, S): (scores, softcap's tanh or None)."""
    tanh = None
    scores = raw
    if softcap is not None:
        tanh = np.tanh(raw / softcap)
        scores = softcap * tanh
    if alibi_slopes is not None:
        seq_q, seq_kv = raw.shape[-2:]
        shift = key_window.row_shift(causal_alignment, seq_q, seq_kv)
        distance = np.abs(np.arange(seq_q)[:, None] + shift - np.arange(seq_kv)[None, :])
        scores = scores - _per_head(alibi_slopes) * distance
    return scores, tanh


def _softmax_with_sinks(scores: np.ndarray, sinks):
    """(P, stats, rows with no weight at all) of masked float64 scores, the sinks' exp(sigma) in each row's sum."""
    with np.errstate(invalid="ignore", divide="ignore"):
        row_max = scores.max(-1, keepdims=True)
        if sinks is not None:
            row_max = np.maximum(row_max, _per_head(sinks))
        masked = np.isneginf(row_max)
        base = np.where(masked, 0.0, row_max)
        e = np.exp(scores - base)
        total = e.sum(-1, keepdims=True)
        if sinks is not None:
            total = total + np.exp(_per_head(sinks) - base)
        p = np.where(masked, 0.0, e / np.where(masked, 1.0, total))
        stats = np.where(masked, -np.inf, row_max + np.log(total))
    return p, stats, masked


def sdpa_reference(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                   causal_alignment="top_left", return_stats=False, dropout_p=0.0, dropout_seed=0,
                   dropout_offset=0, window=None, softcap=None, alibi_slopes=None, sinks=None,
                   dropout_first_element=0):
    """Plain float64 NumPy SDPA with the functional API's semantics (fully masked rows give 0), score modifiers
    included (softcap, ALiBi slopes, sinks: score_mods.py)."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (query, key, value))
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    raw = q @ np.swapaxes(k, -1, -2) * (default_scale(q.shape[-1]) if scale is None else scale)
    scores, _ = _modified_scores(raw, softcap, alibi_slopes, causal_alignment)
    seq_q, seq_kv = scores.shape[-2:]
    left, right = key_window.effective_window(window, is_causal)
    if key_window.is_limited(left, right):
        scores = np.where(key_window.visible(seq_q, seq_kv, left, right, causal_alignment), scores, -np.inf)
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask.astype(np.float64)
    p, stats, masked = _softmax_with_sinks(scores, sinks)
    p = p * dropout_multipliers(scores.shape, dropout_p, dropout_seed, dropout_offset, dropout_first_element)
    out = np.where(masked, 0.0, p @ v)
    return (out, stats) if return_stats else out


def assert_grad_close(actual: np.ndarray, expected: np.ndarray, dtype, what: str = "gradient",
                      magnitude: float | None = None) -> None:
    """assert_close with GRAD_TOLERANCES, the absolute part scaled by the largest expected magnitude (at least 1),
    or by `magnitude` where given: the largest of the call's gradients, for one whose own exact value is 0 but
    whose rounding is that of the others' terms (dQ and dK with a single key)."""
    rtol, atol = GRAD_TOLERANCES[as_data_type(dtype)]
    finite = np.asarray(expected, np.float64)[np.isfinite(expected)]
    scale = float(np.abs(finite).max()) if finite.size else 1.0
    if magnitude is not None:
        scale = max(scale, magnitude)
    assert_close(actual, expected, dtype, what, (rtol, atol * max(scale, 1.0)))


def sdpa_reference_backward(grad_out, query, key, value, attn_mask=None, is_causal=False, scale=None,
                            enable_gqa=False, causal_alignment="top_left", dropout_p=0.0, dropout_seed=0,
                            dropout_offset=0, window=None, softcap=None, alibi_slopes=None, sinks=None,
                            dropout_first_element=0):
    """Float64 gradients (dq, dk, dv, dmask), and dsinks where sinks are given, of sdpa_reference by the textbook
    formulas.

    P = softmax(S), Z the dropout multipliers, dV = (P Z)^T dO, dP = (dO V^T) Z,
    dS = P * (dP - rowsum(dP * P)),
    dQ = scale * dS K, dK = scale * dS^T Q; dmask = dS summed to the mask's
    shape (None for a bool mask or no mask).  GQA sums dK/dV over the group.
    A softcap multiplies dS by 1 - tanh^2 before dQ and dK; dsinks =
    -sum over batch and rows of p_sink * rowsum(dP * P), p_sink the sink's weight.
    """
    q, k, v, do = (np.asarray(x).astype(np.float64) for x in (query, key, value, grad_out))
    rep = 1
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    factor = default_scale(q.shape[-1]) if scale is None else scale
    raw = q @ np.swapaxes(k, -1, -2) * factor
    scores, tanh = _modified_scores(raw, softcap, alibi_slopes, causal_alignment)
    seq_q, seq_kv = scores.shape[-2:]
    keep = np.ones(scores.shape, bool)
    keep &= key_window.visible(seq_q, seq_kv, *key_window.effective_window(window, is_causal), causal_alignment)
    mask = None if attn_mask is None else np.asarray(attn_mask)
    if mask is not None and mask.dtype == np.bool_:
        keep &= mask
    elif mask is not None:
        scores = scores + mask.astype(np.float64)
    scores = np.where(keep, scores, -np.inf)
    p, stats, _ = _softmax_with_sinks(scores, sinks)
    z = dropout_multipliers(scores.shape, dropout_p, dropout_seed, dropout_offset, dropout_first_element)
    dv = np.swapaxes(p * z, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2) * z
    delta = (dp * p).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    ds_raw = ds if tanh is None else ds * (1.0 - tanh * tanh)
    dq = ds_raw @ k * factor
    dk = np.swapaxes(ds_raw, -1, -2) @ q * factor
    if rep > 1:
        dk = dk.reshape(dk.shape[:-3] + (dk.shape[-3] // rep, rep) + dk.shape[-2:]).sum(-3)
        dv = dv.reshape(dv.shape[:-3] + (dv.shape[-3] // rep, rep) + dv.shape[-2:]).sum(-3)
    dk = _sum_to(dk, np.shape(key))
    dv = _sum_to(dv, np.shape(value))
    dq = _sum_to(dq, np.shape(query))
    dmask = None if mask is None or mask.dtype == np.bool_ else _sum_to(ds, mask.shape)
    if sinks is None:
        return dq, dk, dv, dmask
    with np.errstate(invalid="ignore"):
        sink_weight = np.where(np.isneginf(stats), 0.0, np.exp(_per_head(sinks) - stats))
    dsinks = _sum_to(-(sink_weight * delta).sum(-1, keepdims=True), np.shape(sinks) + (1, 1)).reshape(np.shape(sinks))
    return dq, dk, dv, dmask, dsinks


def _sum_to(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sums a broadcast gradient back to `shape`."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape) if axes else grad


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cu_q, cu_k = (np.asarray(c, np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    return [(int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _sequence_options(options: dict, b: int, heads: int, rows_before: int) -> dict:
    """A packed call's options for sequence b as a dense reference call takes them: its row of (B, H) slopes and
    its first Philox element."""
    opts = dict(options)
    slopes = opts.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 2:
        opts["alibi_slopes"] = np.asarray(slopes)[b]
    opts["dropout_first_element"] = rows_before
    opts.setdefault("causal_alignment", "bottom_right")
    return opts


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Float64 (out (T_q, H_q, Dv), stats (H_q, T_q)) of packed sequences (graphattn.varlen's rules), each
    sequence by sdpa_reference: its own keys, bottom-right by default."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    heads = q.shape[1]
    out = np.zeros((q.shape[0], heads, v.shape[2]))
    stats = np.full((heads, q.shape[0]), -np.inf)
    first = 0
    for b, (q0, q1, k0, k1) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if q1 > q0 and k1 == k0 and options.get("sinks") is not None:  # no keys: the sink's weight is the sum
            stats[:, q0:q1] = np.asarray(options["sinks"], np.float64)[:, None]
        if q1 > q0 and k1 > k0:
            o, st = sdpa_reference(q[q0:q1].swapaxes(0, 1), k[k0:k1].swapaxes(0, 1), v[k0:k1].swapaxes(0, 1),
                                   enable_gqa=True, return_stats=True,
                                   **_sequence_options(options, b, heads, first))
            out[q0:q1] = o.swapaxes(0, 1)
            stats[:, q0:q1] = st[..., 0]
        first += heads * (q1 - q0) * (k1 - k0)
    return out, stats


def varlen_reference_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Float64 (dq, dk, dv), and dsinks where sinks are given, of varlen_reference, each sequence by
    sdpa_reference_backward."""
    q, k, v, do = (np.asarray(x).astype(np.float64) for x in (q, k, v, grad_out))
    heads = q.shape[1]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    sinks = options.get("sinks")
    dsinks = None if sinks is None else np.zeros(np.shape(sinks))
    first = 0
    for b, (q0, q1, k0, k1) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if q1 > q0 and k1 > k0:
            grads = sdpa_reference_backward(do[q0:q1].swapaxes(0, 1), q[q0:q1].swapaxes(0, 1),
                                            k[k0:k1].swapaxes(0, 1), v[k0:k1].swapaxes(0, 1), enable_gqa=True,
                                            **_sequence_options(options, b, heads, first))
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g.swapaxes(0, 1) for g in grads[:3])
            if dsinks is not None:
                dsinks += grads[4]
        first += heads * (q1 - q0) * (k1 - k0)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
