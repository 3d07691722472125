// Argument checks of the SDPA calls, shared by every kernel family (the CPU
// builds and the SYCL plugin): each failure names the argument and the rule.
#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {

namespace {

bool is_float(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

Status check_view(const TensorView& t, const char* name, bool float_only) {
    if (t.data == nullptr) return Status::error(std::string(name) + ": data pointer is null");
    if (float_only && !is_float(t.dtype)) return Status::error(std::string(name) + ": dtype must be f32, bf16 or f16");
    return Status::success();
}

}  // namespace

Status check_forward_args(const SdpaForwardArgs& a) {
    for (int i = 0; i < kBatchDims; ++i)
        if (a.batch[i] < 0) return Status::error("batch: dimensions must be >= 0");
    if (a.seq_q < 0 || a.seq_kv < 0) return Status::error("sequence lengths must be >= 0");
    if (a.head_dim_qk < 1 || a.head_dim_v < 1) return Status::error("head sizes must be >= 1");
    if (a.head_dim_qk > 4096 || a.head_dim_v > 4096) return Status::error("head sizes above 4096 are not supported");
    Status s;
    if (!(s = check_view(a.query, "query", true)).ok) return s;
    if (!(s = check_view(a.key, "key", true)).ok) return s;
    if (!(s = check_view(a.value, "value", true)).ok) return s;
    if (!(s = check_view(a.output, "output", true)).ok) return s;
    if (a.mask_kind == MaskKind::additive && !(s = check_view(a.mask, "mask", true)).ok) return s;
    if (a.mask_kind == MaskKind::select && !(s = check_view(a.mask, "mask", false)).ok) return s;
    if (a.stats.data && a.stats.dtype != DType::f32) return Status::error("stats: dtype must be f32");
    if (!(a.dropout_p >= 0.0f && a.dropout_p < 1.0f)) return Status::error("dropout_p must be in [0, 1)");
    return Status::success();
}


// The gradient views must be writable without races: dQ has no broadcast
// batch dim, and dK/dV are broadcast exactly where K and V are (their sums
// over those dims happen inside one work item).
Status check_backward_args(const SdpaBackwardArgs& b) {
    const SdpaForwardArgs& a = b.forward;
    Status s;
    if (!(s = check_forward_args(a)).ok) return s;
    if (!a.stats.data) return Status::error("stats: the forward's log-sum-exp is required");
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
    return Status::success();
}

}  // namespace graphattn
