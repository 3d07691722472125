// Entry point of the C++ API: validates the arguments, then runs the best
// kernel build for this CPU.
#include <cstdlib>
#include <cstring>
#include <string>

#include "graphattn/cpu_features.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
namespace {

using ForwardFn = Status (*)(const SdpaForwardArgs&);
using BackwardFn = Status (*)(const SdpaBackwardArgs&);

struct ForwardKernel {
    const char* isa;
    ForwardFn run;
    BackwardFn run_backward;
};

// GRAPHATTN_ISA=portable|avx2|avx512|amx caps the choice (for testing each build).
std::string isa_cap() {
    const char* cap = std::getenv("GRAPHATTN_ISA");
    return cap ? cap : "";
}

// The best vector build for this CPU; it runs every dtype.
ForwardKernel choose_vector_kernel() {
    const std::string limit = isa_cap();
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const CpuFeatures& f = cpu_features();
    const bool allow_avx512 = limit.empty() || limit == "amx" || limit == "avx512";
    const bool allow_avx2 = allow_avx512 || limit == "avx2";
    if (allow_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c)
        return {"avx512", sdpa_forward_avx512, sdpa_backward_avx512};
    if (allow_avx2 && f.avx2 && f.fma && f.f16c) return {"avx2", sdpa_forward_avx2, sdpa_backward_avx2};
#endif
    return {"portable", sdpa_forward_portable, sdpa_backward_portable};
}

const ForwardKernel& vector_kernel() {
    static const ForwardKernel chosen = choose_vector_kernel();
    return chosen;
}

bool amx_allowed() {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    static const bool allowed = [] {
        const std::string limit = isa_cap();
        return (limit.empty() || limit == "amx") && amx_bf16_usable();
    }();
    return allowed;
#else
    return false;
#endif
}

// AMX tiles take bf16 Q, K and V in blocks of query rows; short query
// sequences (decode) stay on the vector build's row kernel.
constexpr int64_t kAmxMinQueryRows = 16;

ForwardKernel forward_kernel_for(DType input_dtype, int64_t seq_q) {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    if (input_dtype == DType::bf16 && seq_q >= kAmxMinQueryRows && amx_allowed()) return {"amx_bf16", sdpa_forward_amx, nullptr};
#endif
    (void)input_dtype;
    (void)seq_q;
    return vector_kernel();
}

bool is_float(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

Status check_view(const TensorView& t, const char* name, bool float_only) {
    if (t.data == nullptr) return Status::error(std::string(name) + ": data pointer is null");
    if (float_only && !is_float(t.dtype)) return Status::error(std::string(name) + ": dtype must be f32, bf16 or f16");
    return Status::success();
}

Status check_args(const SdpaForwardArgs& a) {
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

}  // namespace

Status sdpa_forward(const SdpaForwardArgs& args) {
    Status status = check_args(args);
    if (!status.ok) return status;
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return status;
    const bool all_bf16 =
        args.query.dtype == DType::bf16 && args.key.dtype == DType::bf16 && args.value.dtype == DType::bf16;
    // The AMX kernel has no fused dropout yet: dropout runs on the vector build.
    const bool amx_candidate = all_bf16 && args.dropout_p == 0.0f;
    return forward_kernel_for(amx_candidate ? DType::bf16 : DType::f32, args.seq_q).run(args);
}

namespace {

// The gradient views must be writable without races: dQ has no broadcast
// batch dim, and dK/dV are broadcast exactly where K and V are (their sums
// over those dims happen inside one work item).
Status check_backward_args(const SdpaBackwardArgs& b) {
    const SdpaForwardArgs& a = b.forward;
    Status s;
    if (!(s = check_args(a)).ok) return s;
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

}  // namespace

Status sdpa_backward(const SdpaBackwardArgs& args) {
    Status status = check_backward_args(args);
    if (!status.ok) return status;
    const SdpaForwardArgs& a = args.forward;
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return status;
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    if (amx_allowed() && sdpa_backward_amx_applies(args)) return sdpa_backward_amx(args);
#endif
    return vector_kernel().run_backward(args);
}

const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q) {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    if (input_dtype == DType::bf16 && seq_q >= 16 && amx_allowed()) return "amx_bf16";
#endif
    (void)input_dtype;
    (void)seq_q;
    return vector_kernel().isa;
}

const char* sdpa_forward_isa(DType input_dtype, int64_t seq_q) { return forward_kernel_for(input_dtype, seq_q).isa; }

}  // namespace graphattn
