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
using PlanFn = std::string (*)(const SdpaForwardArgs&);
using BackwardPlanFn = std::string (*)(const SdpaBackwardArgs&);

struct ForwardKernel {
    const char* isa;
    ForwardFn run;
    BackwardFn run_backward;
    PlanFn plan;                    // the forward's work layout (isa_entry_points.hpp)
    BackwardPlanFn plan_backward;   // the backward's
};

// GRAPHATTN_ISA=portable|avx2|avx512|amx caps the choice (for testing each build); read once, as the
// vector build is chosen once (every forward call on a CPU without AMX asks for the reason).
const std::string& isa_cap() {
    static const std::string cap = [] {
        const char* value = std::getenv("GRAPHATTN_ISA");
        return std::string(value ? value : "");
    }();
    return cap;
}

// The best vector build for this CPU; it runs every dtype.
ForwardKernel choose_vector_kernel() {
    const std::string& limit = isa_cap();
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const CpuFeatures& f = cpu_features();
    const bool allow_avx512 = limit.empty() || limit == "amx" || limit == "avx512";
    const bool allow_avx2 = allow_avx512 || limit == "avx2";
    if (allow_avx512 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c)
        return {"avx512", sdpa_forward_avx512, sdpa_backward_avx512, sdpa_forward_plan_avx512,
                sdpa_backward_plan_avx512};
    if (allow_avx2 && f.avx2 && f.fma && f.f16c)
        return {"avx2", sdpa_forward_avx2, sdpa_backward_avx2, sdpa_forward_plan_avx2, sdpa_backward_plan_avx2};
#endif
    return {"portable", sdpa_forward_portable, sdpa_backward_portable, sdpa_forward_plan_portable,
            sdpa_backward_plan_portable};
}

const ForwardKernel& vector_kernel() {
    static const ForwardKernel chosen = choose_vector_kernel();
    return chosen;
}

bool amx_allowed() {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    static const bool allowed = [] {
        const std::string& limit = isa_cap();
        return (limit.empty() || limit == "amx") && amx_bf16_usable();
    }();
    return allowed;
#else
    return false;
#endif
}

#if defined(GRAPHATTN_HAVE_X86_ISAS)
// The AMX forward on inputs split into `Parts` bf16 parts (1: bf16 inputs),
// or the vector build where it declines (infinities in split inputs).
template <int Parts>
Status forward_amx_or_vector(const SdpaForwardArgs& args) {
    return sdpa_forward_amx(args, Parts) ? Status::success() : vector_kernel().run(args);
}

template <int Parts>
std::string forward_amx_plan(const SdpaForwardArgs& args) {
    return sdpa_forward_plan_amx(args, Parts);
}
#endif

// Why a forward call runs where it does, for the verbose log (no commas).
const char* vector_build_reason() {
    if (!isa_cap().empty()) return "GRAPHATTN_ISA caps the choice";
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    return "no usable AMX-BF16 on this CPU";
#else
    return "no x86 builds in this library";
#endif
}

// AMX tiles take bf16 Q, K and V, or f16 and f32 ones split into two or three
// bf16 parts (three or six bf16 products in place of one; amx_split.hpp), in
// blocks of query rows; short query sequences (decode) stay on the vector
// build's row layout, each dtype from its own length on (below).
//
// bf16 tiles of 16 rows beat the row layout's AVX512-BF16 dot products from
// 6 query rows on, though most of each tile is padding (16-core Xeon,
// in-process A/B, (2,16,16,Sq,768,D): 6-8 rows 1.21-1.24x, 12-15 rows
// 1.99-2.21x, 4 rows 0.90x; GQA (1,Hq,Hkv,8..12,2048,D) 1.19-2.08x, but for
// (1,32,8,8,4096,128), whose 32 rows per K/V head fill the lanes, 0.93x).
constexpr int64_t kAmxBf16MinQueryRows = 6;

// bf16 parts per value of a dtype class on AMX tiles.
int amx_parts(DType dtype_class) { return dtype_class == DType::bf16 ? 1 : (dtype_class == DType::f16 ? 2 : 3); }

// f32 on tiles takes six products per product, and each work item splits
// the K/V blocks it reads into parts.  On short sequences the vector build's
// FMAs are faster (2-core Xeon with AMX, f32 (8,16,128,128,64): 0.83x on
// tiles; (16,16,64,64,64): 0.87x; (1,16,32,4096,128): 0.83x; from 64 query
// rows and 192 x 192 scores on, tiles win: 1.05-1.7x), and so they are where
// the items are small, each packing its K/V for few rows (16-core Xeon,
// 64-row items (1,2,2048,64): 0.81x, (1,8,1000,80): 0.72x; 256-row items
// (1,16,1024,64): 1.0x, causal (1,16,2048,128): 1.2x; 512-row items
// (1,16,2048,128): 1.22x).  Short query sequences that make whole items
// are no exception (16-core Xeon, in-process A/B, vector build against tiles:
// (1,H,64,768,D) for H = 1..32, D = 80 or 256: 1.20-1.51x; causal
// (4,16,80,512,64) 1.30x; only (1,1,64,4096,128), split keys, 0.89x).
constexpr int64_t kAmxF32MinScores = 192 * 192;
constexpr int64_t kAmxF32MinItemRows = 256;

// f16 on tiles takes three products per product, in tiles of 16 query rows;
// below 32 rows the vector build's row layout (no padding rows, f16 K and V
// widened as read) is the faster (16-core Xeon, separate processes, medians
// of three: (1,H,17,Skv,D) and GQA (1,32,8,17,768,80) 1.31-1.67x; 20 and 24
// rows 0.96-1.2x; 32 rows 0.8-1.27x; from 48 rows on, tiles 1.16-2.1x).
constexpr int64_t kAmxF16MinQueryRows = 32;

// Whether a forward call runs on AMX tiles; `args` gives its lengths, batch
// and mask (data is not read).  `why` gets the rule that decided.
bool forward_runs_on_amx(DType dtype_class, const SdpaForwardArgs& args, const char** why) {
    if (!amx_allowed()) {
        *why = vector_build_reason();
        return false;
    }
    if (dtype_class == DType::bf16) {
        const bool tiles = args.seq_q >= kAmxBf16MinQueryRows;
        *why = tiles ? "bf16 from 6 query rows on tiles" : "bf16 under 6 query rows: the vector build's row layout";
        return tiles;
    }
    if (dtype_class == DType::f16) {
        const bool tiles = args.seq_q >= kAmxF16MinQueryRows;
        *why = tiles ? "f16 from 32 query rows on tiles" : "f16 under 32 query rows: the vector build's row layout";
        return tiles;
    }
    if (args.seq_q * args.seq_kv < kAmxF32MinScores) {
        *why = "f32 under 192 x 192 scores: FMAs beat six tile products per product";
        return false;
    }
    if (sdpa_forward_amx_item_rows(args) < kAmxF32MinItemRows) {
        *why = "f32 work items under 256 query rows: FMAs beat six tile products per product";
        return false;
    }
    *why = "f32 work items of 256 query rows or more on tiles";
    return true;
}

// A call's shape for the kernel choice alone: `batch` batch indices, no mask
// but a top-left causal window if asked.
SdpaForwardArgs shape_only_args(int64_t batch, int64_t seq_q, int64_t seq_kv, bool causal, int64_t head_dim) {
    SdpaForwardArgs args;
    args.batch[0] = batch;
    args.batch[1] = args.batch[2] = 1;
    args.seq_q = seq_q;
    args.seq_kv = seq_kv;
    args.head_dim_qk = args.head_dim_v = head_dim;
    if (causal) args.window.right = 0;
    return args;
}

// The AMX backward computes whole 64-row chunks against 64-key blocks, from
// bf16 or f16 inputs.  f32 stays on the vector build: split into three bf16
// parts, all five products on tiles ran at 0.48-0.77x of it, and S and dP
// alone on tiles (the gradient products on FMAs) at 0.72-0.90x (2-core Xeon
// with AMX; the FMA products themselves slowed beside the tiles).  Below
// these query rows or keys most of that work is padding and the vector build
// is faster (2-core Xeon with AMX, bf16 (64,16,17,64): 3.7x; f16 needs more,
// each of its products taking three tile passes).
int64_t amx_backward_min_length(DType dtype_class) { return dtype_class == DType::f16 ? 64 : 48; }

// Whether a backward call runs on AMX tiles; `why` gets the rule that decided.
bool backward_runs_on_amx(DType dtype_class, int64_t seq_q, int64_t seq_kv, const char** why = nullptr) {
    const char* reason;
    bool tiles = false;
    if (!amx_allowed()) reason = vector_build_reason();
    else if (dtype_class == DType::f32) reason = "f32: FMAs beat five products on split tiles";
    else if (std::min(seq_q, seq_kv) < amx_backward_min_length(dtype_class))
        reason = dtype_class == DType::f16 ? "f16 with a sequence under 64: mostly padding on tiles"
                                           : "bf16 with a sequence under 48: mostly padding on tiles";
    else {
        tiles = true;
        reason = dtype_class == DType::f16 ? "f16 with both sequences from 64 on tiles"
                                           : "bf16 with both sequences from 48 on tiles";
    }
    if (why) *why = reason;
    return tiles;
}

// The AMX build's name for a dtype class: its bf16 products per product.
const char* amx_build_name(DType dtype_class) {
    const int parts = amx_parts(dtype_class);
    return parts == 1 ? "amx_bf16" : (parts == 2 ? "amx_bf16x3" : "amx_bf16x6");
}

struct ForwardChoice {
    ForwardKernel kernel;
    const char* why;  // the rule that chose it (forward_runs_on_amx)
};

// The AMX forward has no fused dropout yet: calls with dropout run on the vector build.
ForwardChoice choose_forward(DType input_dtype, const SdpaForwardArgs& args) {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const char* why = nullptr;
    const bool tiles = forward_runs_on_amx(input_dtype, args, &why);
    if (tiles && args.dropout_p == 0.0f) {
        static constexpr ForwardFn kByParts[] = {forward_amx_or_vector<1>, forward_amx_or_vector<2>,
                                                 forward_amx_or_vector<3>};
        static constexpr PlanFn kPlanByParts[] = {forward_amx_plan<1>, forward_amx_plan<2>, forward_amx_plan<3>};
        const int parts = amx_parts(input_dtype);
        return {{amx_build_name(input_dtype), kByParts[parts - 1], nullptr, kPlanByParts[parts - 1], nullptr}, why};
    }
    return {vector_kernel(), tiles ? "dropout: the tile kernel does not fuse it" : why};
#else
    (void)input_dtype;
    (void)args;
    return {vector_kernel(), vector_build_reason()};
#endif
}

ForwardKernel forward_kernel_for(DType input_dtype, const SdpaForwardArgs& args) {
    return choose_forward(input_dtype, args).kernel;
}

// Q, K and V's class.
DType forward_dtype_class(const SdpaForwardArgs& args) {
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
    return forward_kernel_for(forward_dtype_class(args), args).run(args);
}

Status sdpa_backward(const SdpaBackwardArgs& args) {
    Status status = check_backward_args(args);
    if (!status.ok) return status;
    const SdpaForwardArgs& a = args.forward;
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return status;
    const DType dtype = backward_dtype_class(args);
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    // The split build declines inputs holding an infinity; the vector build then runs.
    if (backward_runs_on_amx(dtype, a.seq_q, a.seq_kv) && sdpa_backward_amx(args, amx_parts(dtype))) return status;
#endif
    (void)dtype;
    return vector_kernel().run_backward(args);
}

const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv) {
    if (backward_runs_on_amx(input_dtype, seq_q, seq_kv)) return amx_build_name(input_dtype);
    return vector_kernel().isa;
}

std::string sdpa_backward_plan(const SdpaBackwardArgs& args) {
    const SdpaForwardArgs& a = args.forward;
    const DType dtype = backward_dtype_class(args);
    const char* why = nullptr;
    const bool tiles = backward_runs_on_amx(dtype, a.seq_q, a.seq_kv, &why);
    const std::string head =
        std::string("isa=") + (tiles ? amx_build_name(dtype) : vector_kernel().isa) + ",why=" + why + ",";
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return head + "layout=none";  // no keys
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    if (tiles) return head + sdpa_backward_plan_amx(args);
#endif
    return head + vector_kernel().plan_backward(args);
}

const char* sdpa_forward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv, int64_t batch, bool causal,
                             int64_t head_dim) {
    return forward_kernel_for(input_dtype, shape_only_args(batch, seq_q, seq_kv, causal, head_dim)).isa;
}

const char* sdpa_forward_isa_for(const SdpaForwardArgs& args) {
    return forward_kernel_for(forward_dtype_class(args), args).isa;
}

std::string sdpa_forward_plan(const SdpaForwardArgs& args) {
    const ForwardChoice choice = choose_forward(forward_dtype_class(args), args);
    const std::string head = std::string("isa=") + choice.kernel.isa + ",why=" + choice.why + ",";
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return head + "layout=none";  // no rows
    return head + choice.kernel.plan(args);
}

}  // namespace graphattn
