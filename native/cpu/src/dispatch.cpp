// Entry point of the C++ API: validates the arguments, then runs the best
// kernel build for this CPU.
#include <algorithm>
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

#if defined(GRAPHATTN_HAVE_X86_ISAS)
// The AMX forward, plain (bf16 inputs) or split (f16 among them), or the vector
// build where it declines (infinities in split inputs).
template <bool Split>
Status forward_amx_or_vector(const SdpaForwardArgs& args) {
    return sdpa_forward_amx(args, Split) ? Status::success() : vector_kernel().run(args);
}
#endif

// AMX tiles take bf16 Q, K and V, or f16 ones as pairs of bf16 parts (three
// bf16 products in place of one), in blocks of query rows; short query
// sequences (decode) stay on the vector build's row kernel.
constexpr int64_t kAmxMinQueryRows = 16;

// Whether a call of this dtype class and query length runs on AMX tiles
// (forward and backward alike).
bool runs_on_amx(DType dtype_class, int64_t seq_q) {
    return seq_q >= kAmxMinQueryRows && (dtype_class == DType::bf16 || dtype_class == DType::f16) && amx_allowed();
}

// The AMX backward computes whole 64-row chunks against 64-key blocks.
// Below these query rows or keys most of that work is padding and the vector
// build is faster (2-core Xeon with AMX, bf16 (64,16,17,64): 3.7x; f16 needs
// more, each of its products taking three tile passes).
int64_t amx_backward_min_length(DType dtype_class) { return dtype_class == DType::f16 ? 64 : 48; }

bool backward_runs_on_amx(DType dtype_class, int64_t seq_q, int64_t seq_kv) {
    return runs_on_amx(dtype_class, seq_q) && std::min(seq_q, seq_kv) >= amx_backward_min_length(dtype_class);
}

// The AMX build's name for a dtype class that runs on it.
const char* amx_build_name(DType dtype_class) { return dtype_class == DType::bf16 ? "amx_bf16" : "amx_bf16x3"; }

ForwardKernel forward_kernel_for(DType input_dtype, int64_t seq_q) {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    if (runs_on_amx(input_dtype, seq_q)) {
        const bool split = input_dtype == DType::f16;
        return {amx_build_name(input_dtype), split ? forward_amx_or_vector<true> : forward_amx_or_vector<false>,
                nullptr};
    }
#endif
    return vector_kernel();
}

// Q, K and V's class; the AMX forward has no fused dropout yet, so dropout
// counts as f32 (the vector build).
DType forward_dtype_class(const SdpaForwardArgs& args) {
    if (args.dropout_p != 0.0f) return DType::f32;
    const DType dtypes[] = {args.query.dtype, args.key.dtype, args.value.dtype};
    return sdpa_dtype_class(dtypes, 3);
}

// Q, K, V and dO's class (the AMX backward fuses dropout).
DType backward_dtype_class(const SdpaBackwardArgs& args) {
    const SdpaForwardArgs& a = args.forward;
    const DType dtypes[] = {a.query.dtype, a.key.dtype, a.value.dtype, args.grad_output.dtype};
    return sdpa_dtype_class(dtypes, 4);
}

}  // namespace

DType sdpa_dtype_class(const DType* dtypes, int count) {
    bool all_bf16 = true, all_half = true;
    for (int i = 0; i < count; ++i) {
        all_bf16 = all_bf16 && dtypes[i] == DType::bf16;
        all_half = all_half && (dtypes[i] == DType::bf16 || dtypes[i] == DType::f16);
    }
    if (!all_half) return DType::f32;
    return all_bf16 ? DType::bf16 : DType::f16;
}

Status sdpa_forward(const SdpaForwardArgs& args) {
    Status status = check_forward_args(args);
    if (!status.ok) return status;
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return status;
    return forward_kernel_for(forward_dtype_class(args), args.seq_q).run(args);
}

Status sdpa_backward(const SdpaBackwardArgs& args) {
    Status status = check_backward_args(args);
    if (!status.ok) return status;
    const SdpaForwardArgs& a = args.forward;
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return status;
    const DType dtype = backward_dtype_class(args);
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    // The split build declines inputs holding an infinity; the vector build then runs.
    if (backward_runs_on_amx(dtype, a.seq_q, a.seq_kv) && sdpa_backward_amx(args, dtype == DType::f16)) return status;
#endif
    (void)dtype;
    return vector_kernel().run_backward(args);
}

const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv) {
    if (backward_runs_on_amx(input_dtype, seq_q, seq_kv)) return amx_build_name(input_dtype);
    return vector_kernel().isa;
}

const char* sdpa_forward_isa(DType input_dtype, int64_t seq_q) { return forward_kernel_for(input_dtype, seq_q).isa; }

const char* sdpa_forward_isa_for(const SdpaForwardArgs& args) {
    return forward_kernel_for(forward_dtype_class(args), args.seq_q).isa;
}

}  // namespace graphattn
