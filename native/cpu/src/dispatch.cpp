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

struct ForwardKernel {
    const char* isa;
    ForwardFn run;
};

// GRAPHATTN_ISA=portable|avx2|avx512 caps the choice (for testing each build).
ForwardKernel choose_forward_kernel() {
    const char* cap = std::getenv("GRAPHATTN_ISA");
    const std::string limit = cap ? cap : "";
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const CpuFeatures& f = cpu_features();
    const bool allow_avx512 = limit.empty() || limit == "avx512";
    const bool allow_avx2 = allow_avx512 || limit == "avx2";
    if (allow_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c)
        return {"avx512", sdpa_forward_avx512};
    if (allow_avx2 && f.avx2 && f.fma && f.f16c) return {"avx2", sdpa_forward_avx2};
#endif
    return {"portable", sdpa_forward_portable};
}

const ForwardKernel& forward_kernel() {
    static const ForwardKernel chosen = choose_forward_kernel();
    return chosen;
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
    return Status::success();
}

}  // namespace

Status sdpa_forward(const SdpaForwardArgs& args) {
    Status status = check_args(args);
    if (!status.ok) return status;
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return status;
    return forward_kernel().run(args);
}

const char* sdpa_forward_isa() { return forward_kernel().isa; }

}  // namespace graphattn
