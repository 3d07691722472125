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

}  // namespace

Status sdpa_forward(const SdpaForwardArgs& args) {
    Status status = check_forward_args(args);
    if (!status.ok) return status;
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return status;
    const bool all_bf16 =
        args.query.dtype == DType::bf16 && args.key.dtype == DType::bf16 && args.value.dtype == DType::bf16;
    // The AMX kernel has no fused dropout yet: dropout runs on the vector build.
    const bool amx_candidate = all_bf16 && args.dropout_p == 0.0f;
    return forward_kernel_for(amx_candidate ? DType::bf16 : DType::f32, args.seq_q).run(args);
}

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
