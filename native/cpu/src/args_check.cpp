// Argument checks of the SDPA calls, shared by every kernel family (the CPU
// builds and the SYCL plugin): each failure names the argument and the rule.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "graphattn/score_mods.hpp"
#include "graphattn/sdpa.hpp"

namespace graphattn {

namespace {

bool is_float(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

// A view's logical shape: the call's batch dims, then its rows and columns.
struct ViewShape {
    int64_t dims[kBatchDims + 2];
    bool empty() const {
        for (int64_t d : dims)
            if (d == 0) return true;
        return false;
    }
};

ViewShape view_shape(const int64_t batch[kBatchDims], int64_t rows, int64_t cols) {
    return {{batch[0], batch[1], batch[2], rows, cols}};
}

// The logical shapes of a call's views (SdpaForwardArgs' comment); the
// backward's gradients take those of the operands they belong to.
struct CallShapes {
    ViewShape q, k, v, o, m, st, per_index;  // per_index: one value per batch index (slopes, sinks)
    explicit CallShapes(const SdpaForwardArgs& a)
        : q(view_shape(a.batch, a.seq_q, a.head_dim_qk)),
          k(view_shape(a.batch, a.seq_kv, a.head_dim_qk)),
          v(view_shape(a.batch, a.seq_kv, a.head_dim_v)),
          o(view_shape(a.batch, a.seq_q, a.head_dim_v)),
          m(view_shape(a.batch, a.seq_q, a.seq_kv)),
          st(view_shape(a.batch, a.seq_q, 1)),
          per_index(view_shape(a.batch, 1, 1)) {}
};

std::string strides_text(const TensorView& t) {
    std::string text = "(";
    for (int i = 0; i < kBatchDims + 2; ++i) text += (i ? ", " : "") + std::to_string(t.strides[i]);
    return text + ")";
}

Status check_view(const TensorView& t, const char* name, bool float_only) {
    if (t.data == nullptr) return Status::error(std::string(name) + ": data pointer is null");
    if (float_only && !is_float(t.dtype)) return Status::error(std::string(name) + ": dtype must be f32, bf16 or f16");
    return Status::success();
}

// The bytes the view reaches, [lowest, highest], lie in its buffer (where its
// extent is known): a view of the wrong dtype, shape or strides for the
// buffer it was given is refused before any element is read or written.
Status check_reach(const TensorView& t, const char* name, const ViewShape& shape) {
    if (!t.buffer.known() || shape.empty()) return Status::success();
    const int64_t size = dtype_size(t.dtype);
    int64_t lowest = 0, highest = 0;
    for (int i = 0; i < kBatchDims + 2; ++i) {
        const int64_t step = t.strides[i] * (shape.dims[i] - 1) * size;
        (step < 0 ? lowest : highest) += step;
    }
    if (lowest < t.buffer.begin || highest + size > t.buffer.end)
        return Status::error(std::string(name) + ": its strides " + strides_text(t) + " reach bytes [" +
                             std::to_string(lowest) + ", " + std::to_string(highest + size) +
                             ") of its data, outside its buffer's [" + std::to_string(t.buffer.begin) + ", " +
                             std::to_string(t.buffer.end) + ")");
    return Status::success();
}

// A written view must give each index a location of its own: taken in
// increasing |stride|, each dim of two or more must step over all that the
// dims before it reach (dense, transposed, sliced and reversed layouts do; a
// stride 0 does not).  Threads write distinct indices at once, so a shared
// location is a race.  Dims flagged in `summed` are left out: the kernel sums
// over them inside one work item (dK and dV over K's and V's broadcast dims).
Status check_no_self_overlap(const TensorView& t, const char* name, const ViewShape& shape,
                             const bool summed[kBatchDims + 2] = nullptr) {
    if (shape.empty()) return Status::success();
    int order[kBatchDims + 2];
    int n = 0;
    for (int i = 0; i < kBatchDims + 2; ++i)
        if (shape.dims[i] > 1 && !(summed && summed[i])) order[n++] = i;
    for (int a = 1; a < n; ++a)  // insertion sort by |stride|: five dims at most
        for (int b = a; b > 0 && std::abs(t.strides[order[b]]) < std::abs(t.strides[order[b - 1]]); --b)
            std::swap(order[b], order[b - 1]);
    int64_t reach = 0;
    for (int a = 0; a < n; ++a) {
        const int64_t stride = std::abs(t.strides[order[a]]);
        if (stride <= reach)
            return Status::error(std::string(name) + " is written, but its strides " + strides_text(t) +
                                 " put several of its elements in one place (dim " + std::to_string(order[a]) +
                                 "); give each element a location of its own");
        reach += stride * (shape.dims[order[a]] - 1);
    }
    return Status::success();
}

// A K or V view's reach: a paged cache's over all its blocks (num_blocks x
// heads x block_rows rows; which blocks a sequence uses is checked with its
// lengths, packed_sequences.cpp), with its heads' offsets where a paged base
// holds them (graphattn/kv_rows.hpp).
Status check_kv_reach(const TensorView& t, const char* name, const int64_t batch[kBatchDims], const ViewShape& shape) {
    const KvPages& p = t.pages;
    if (!p.paged()) return check_reach(t, name, shape);
    if (p.block_rows < 1 || p.num_blocks < 0 || p.table_stride < 0)
        return Status::error(std::string(name) + ": a paged cache needs block_rows >= 1, num_blocks >= 0 and a "
                             "table stride >= 0");
    const int64_t heads_reach = (batch[1] - 1) * t.strides[1] + (batch[2] - 1) * t.strides[2];
    if (t.strides[1] < 0 || t.strides[2] < 0 || heads_reach >= KvRowLayout::kSequenceUnit)
        return Status::error(std::string(name) + ": a paged cache's head strides must be >= 0 and reach less than "
                             "2^40 elements");
    return check_reach(t, name, {{p.num_blocks, batch[1], batch[2], p.block_rows, shape.dims[4]}});
}

// A quantized K or V view (KvQuant): its bytes, group size, scales and zero
// points.  `cols` is the row's values (D or Dv).
Status check_kv_quant(const TensorView& t, const char* name, const int64_t batch[kBatchDims], const ViewShape& shape) {
    const KvQuant& q = t.quant;
    const std::string n(name);
    const int64_t cols = shape.dims[4];
    if (t.data == nullptr) return Status::error(n + ": data pointer is null");
    if (t.dtype != DType::u8) return Status::error(n + ": a quantized view holds bytes (dtype u8)");
    if (q.format < KvFormat::u8 || q.format > KvFormat::s4_in_byte) return Status::error(n + ": unknown K/V format");
    if (!is_float(q.decoded)) return Status::error(n + ": quantized rows decode to f32, bf16 or f16");
    for (int d = 1; d < kBatchDims; ++d)
        if (batch[d] >= (int64_t(1) << 20)) return Status::error(n + ": a quantized view takes below 2^20 heads");
    if (batch[0] >= (int64_t(1) << 23)) return Status::error(n + ": a quantized view takes below 2^23 sequences");
    if (kv_four_bit(q.format) && (cols % 2 || t.strides[4] != 1))
        return Status::error(n + ": 4-bit rows need an even head size (" + std::to_string(cols) +
                             ") and adjacent bytes (column stride 1)");
    if (!q.scales.data) return Status::error(n + "_scales: data pointer is null");
    if (!is_float(q.scales.dtype)) return Status::error(n + "_scales: dtype must be f32, bf16 or f16");
    ViewShape bytes = shape;
    bytes.dims[4] = kv_row_bytes(q.format, cols);
    Status s;
    if (!(s = check_kv_reach(t, name, batch, bytes)).ok) return s;
    auto params_view = [&](const KvQuantParams& p) {
        TensorView v;
        v.data = p.data;
        v.dtype = p.dtype;
        for (int i = 0; i < kBatchDims + 2; ++i) v.strides[i] = p.strides[i];
        v.buffer = p.buffer;
        return v;
    };
    if (kv_fp8(q.format)) {
        if (q.zero_points.data) return Status::error(n + "_zero_points: fp8 rows take none");
        // One scale per batch element: the sequences of a paged cache, not its blocks.
        return check_reach(params_view(q.scales), (n + "_scales").c_str(), {{batch[0], batch[1], batch[2], 1, 1}});
    }
    if (q.group < 1 || cols % q.group)
        return Status::error(n + ": the group size " + std::to_string(q.group) + " must divide the head size " +
                             std::to_string(cols));
    ViewShape groups = shape;
    groups.dims[4] = cols / q.group;
    for (const KvQuantParams* p : {&q.scales, &q.zero_points}) {
        if (!p->data) continue;
        const std::string what = n + (p == &q.scales ? "_scales" : "_zero_points");
        if (p == &q.zero_points && p->dtype != DType::u8) return Status::error(what + ": dtype must be u8 or s8 bytes");
        TensorView v = params_view(*p);
        v.pages = t.pages;
        if (!(s = check_kv_reach(v, what.c_str(), batch, groups)).ok) return s;
    }
    return Status::success();
}

// K's or V's view: plain, or quantized.
Status check_kv_view(const TensorView& t, const char* name, const int64_t batch[kBatchDims], const ViewShape& shape) {
    if (t.quant.quantized()) return check_kv_quant(t, name, batch, shape);
    Status s = check_view(t, name, true);
    return s.ok ? check_kv_reach(t, name, batch, shape) : s;
}

// The checks of a forward call's arguments that the backward shares: there
// the forward's output and stats are read, not written.
Status check_call(const SdpaForwardArgs& a) {
    for (int i = 0; i < kBatchDims; ++i)
        if (a.batch[i] < 0) return Status::error("batch: dimensions must be >= 0");
    if (a.seq_q < 0 || a.seq_kv < 0) return Status::error("sequence lengths must be >= 0");
    if (a.head_dim_qk < 1 || a.head_dim_v < 1) return Status::error("head sizes must be >= 1");
    if (a.head_dim_qk > 4096 || a.head_dim_v > 4096) return Status::error("head sizes above 4096 are not supported");
    Status s;
    if (!(s = check_view(a.query, "query", true)).ok) return s;
    if (!(s = check_view(a.output, "output", true)).ok) return s;
    if (a.mask_kind == MaskKind::additive && !(s = check_view(a.mask, "mask", true)).ok) return s;
    if (a.mask_kind == MaskKind::select && !(s = check_view(a.mask, "mask", false)).ok) return s;
    if (a.stats.data && a.stats.dtype != DType::f32) return Status::error("stats: dtype must be f32");
    if (!(a.dropout_p >= 0.0f && a.dropout_p < 1.0f)) return Status::error("dropout_p must be in [0, 1)");
    if (!softcap_in_range(a.softcap)) {
        char text[160];
        std::snprintf(text, sizeof text, "softcap must be 0 (none) or within [%.9g, %.9g], got %.9g",
                      double(kSoftcapMin), double(kSoftcapMax), double(a.softcap));
        return Status::error(text);
    }
    if (a.alibi.slopes.data && a.alibi.slopes.dtype != DType::f32)
        return Status::error("alibi_slopes: dtype must be f32");
    if (a.sinks.data && a.sinks.dtype != DType::f32) return Status::error("sinks: dtype must be f32");
    const CallShapes sh(a);
    if (a.alibi.slopes.data && !(s = check_reach(a.alibi.slopes, "alibi_slopes", sh.per_index)).ok) return s;
    if (a.sinks.data && !(s = check_reach(a.sinks, "sinks", sh.per_index)).ok) return s;
    if (!(s = check_kv_view(a.key, "key", a.batch, sh.k)).ok || !(s = check_kv_view(a.value, "value", a.batch, sh.v)).ok)
        return s;
    if (!(s = check_reach(a.query, "query", sh.q)).ok || !(s = check_reach(a.output, "output", sh.o)).ok)
        return s;
    if (a.mask_kind != MaskKind::none && !(s = check_reach(a.mask, "mask", sh.m)).ok) return s;
    if (a.stats.data && !(s = check_reach(a.stats, "stats", sh.st)).ok) return s;
    return Status::success();
}

}  // namespace

Status check_forward_args(const SdpaForwardArgs& a) {
    Status s;
    if (!(s = check_call(a)).ok) return s;
    const CallShapes sh(a);
    if (!(s = check_no_self_overlap(a.output, "output", sh.o)).ok) return s;
    if (a.stats.data && !(s = check_no_self_overlap(a.stats, "stats", sh.st)).ok) return s;
    return Status::success();
}


// The gradient views must be writable without races: dQ has no broadcast
// batch dim, and dK/dV are broadcast exactly where K and V are (their sums
// over those dims happen inside one work item).
Status check_backward_args(const SdpaBackwardArgs& b) {
    const SdpaForwardArgs& a = b.forward;
    Status s;
    if (!(s = check_call(a)).ok) return s;
    if (!a.stats.data) return Status::error("stats: the forward's log-sum-exp is required");
    if (a.key.quant.quantized() || a.value.quant.quantized())
        return Status::error("key, value: a quantized K/V cache has no backward (as flash-attn's kvcache call)");
    if (!(s = check_view(b.grad_output, "grad_output", true)).ok) return s;
    if (!(s = check_view(b.grad_query, "grad_query", true)).ok) return s;
    if (!(s = check_view(b.grad_key, "grad_key", true)).ok) return s;
    if (!(s = check_view(b.grad_value, "grad_value", true)).ok) return s;
    if (b.grad_mask.data && b.grad_mask.dtype != DType::f32) return Status::error("grad_mask: dtype must be f32");
    for (int d = 0; d < kBatchDims; ++d) {
        if (a.batch[d] < 2) continue;
        const std::string dim = "batch dim " + std::to_string(d);
        if (a.query.strides[d] == 0 || b.grad_query.strides[d] == 0)
            return Status::error("query: broadcast over " + dim + "; its gradient would need a reduction");
        const bool k0 = a.key.strides[d] == 0;
        if (k0 != (a.value.strides[d] == 0) || k0 != (b.grad_key.strides[d] == 0) || k0 != (b.grad_value.strides[d] == 0))
            return Status::error("key, value, grad_key and grad_value must all be broadcast (stride 0) over " + dim +
                                 ", or none of them");
    }
    const CallShapes sh(a);
    if (!(s = check_reach(b.grad_output, "grad_output", sh.o)).ok ||
        !(s = check_reach(b.grad_query, "grad_query", sh.q)).ok || !(s = check_reach(b.grad_key, "grad_key", sh.k)).ok ||
        !(s = check_reach(b.grad_value, "grad_value", sh.v)).ok)
        return s;
    if (b.grad_mask.data && !(s = check_reach(b.grad_mask, "grad_mask", sh.m)).ok) return s;
    // dK and dV sum over the batch dims where K and V are broadcast (checked above to match theirs).
    bool kv_summed[kBatchDims + 2] = {};
    for (int d = 0; d < kBatchDims; ++d) kv_summed[d] = a.key.strides[d] == 0;
    if (!(s = check_no_self_overlap(b.grad_query, "grad_query", sh.q)).ok ||
        !(s = check_no_self_overlap(b.grad_key, "grad_key", sh.k, kv_summed)).ok ||
        !(s = check_no_self_overlap(b.grad_value, "grad_value", sh.v, kv_summed)).ok)
        return s;
    if (b.grad_mask.data && !(s = check_no_self_overlap(b.grad_mask, "grad_mask", sh.m)).ok) return s;
    if (b.grad_sinks.data) {
        if (!a.sinks.data) return Status::error("grad_sinks: given without sinks");
        if (b.grad_sinks.dtype != DType::f32) return Status::error("grad_sinks: dtype must be f32");
        // Summed over the batch dims it broadcasts (stride 0), as the sinks are shared there.
        bool summed[kBatchDims + 2] = {};
        for (int d = 0; d < kBatchDims; ++d) summed[d] = b.grad_sinks.strides[d] == 0;
        if (!(s = check_reach(b.grad_sinks, "grad_sinks", sh.per_index)).ok ||
            !(s = check_no_self_overlap(b.grad_sinks, "grad_sinks", sh.per_index, summed)).ok)
            return s;
    }
    return Status::success();
}

}  // namespace graphattn
