// Entry point of the C++ API: validates the arguments, then runs the first
// kernel candidate of the pass's table that accepts the call.
//
// Forward:  amx_bf16 -> amx_bf16x3 -> amx_bf16x6 -> avx512 -> avx2 -> portable
// Backward: amx_bf16 -> amx_bf16x3 -> avx512 -> avx2 -> portable
//
// AMX candidates take one dtype class each (bf16 inputs as they are, f16 and
// f32 split into 2 or 3 bf16 parts, amx_split.hpp) and decline calls a
// measured rule gives to the vector builds (docs/performance-history.md, "Kernel
// choice"); each vector build runs every call its CPU runs, choosing its own
// row or lane layout (sdpa_forward_select.hpp).  One table drives execution,
// the verbose log (sdpa_forward_plan) and `python -m graphattn info`.
#include <algorithm>
#include <atomic>
#include <string>

#include "graphattn/cpu_features.hpp"
#include "graphattn/kernel_table.hpp"
#include "graphattn/packed_sequences.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
namespace {

// The rules the AMX candidates decline calls by.  bf16 tiles hold 16 query
// rows; under kAmxBf16MinQueryRows most of a tile is padding and the row
// layout's dot products win.  f16 takes three tile products per product and
// f32 six, so they need more rows (and f32 more scores and longer work items,
// each item packing its K/V once for its rows) before tiles beat FMAs.
constexpr int64_t kAmxBf16MinQueryRows = 6;
constexpr int64_t kAmxF16MinQueryRows = 32;
constexpr int64_t kAmxF32MinScoreSide = 192;
constexpr int64_t kAmxF32MinItemRows = 256;
// The AMX backward computes 64-row chunks against 64-key blocks; below these
// lengths most of them is padding.  f16 needs more, each product taking
// three tile passes.
constexpr int64_t kAmxBackwardBf16MinLength = 48;
constexpr int64_t kAmxBackwardF16MinLength = 64;

std::string str(int64_t value) { return std::to_string(value); }

// The dtype class a call's kernel choice goes by: Q, K and V's (dtype_class
// is computed once per choice and handed to every candidate).
DType dtype_class(const SdpaForwardArgs& args) {
    const DType dtypes[] = {args.query.dtype, read_dtype(args.key), read_dtype(args.value)};
    return sdpa_dtype_class(dtypes, 3);
}

// Q, K, V and dO's.
DType dtype_class(const SdpaBackwardArgs& args) {
    const SdpaForwardArgs& a = args.forward;
    const DType dtypes[] = {a.query.dtype, read_dtype(a.key), read_dtype(a.value), args.grad_output.dtype};
    return sdpa_dtype_class(dtypes, 4);
}

const char* dtype_class_name(DType dtype_class) {
    return dtype_class == DType::bf16 ? "bf16" : (dtype_class == DType::f16 ? "f16" : "f32");
}

// bf16 parts per value of a dtype class on AMX tiles.
int amx_parts(DType dtype_class) { return dtype_class == DType::bf16 ? 1 : (dtype_class == DType::f16 ? 2 : 3); }

// ---- What each candidate needs of the CPU ------------------------------------------------------------------

const char* amx_unavailable() {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    return amx_bf16_usable() ? "" : "no usable AMX-BF16 on this CPU";
#else
    return "no x86 builds in this library";
#endif
}

const char* avx512_unavailable() {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const CpuFeatures& f = cpu_features();
    return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.f16c ? "" : "no AVX-512 F/BW/VL/DQ with F16C";
#else
    return "no x86 builds in this library";
#endif
}

const char* avx2_unavailable() {
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const CpuFeatures& f = cpu_features();
    return f.avx2 && f.fma && f.f16c ? "" : "no AVX2 with FMA and F16C";
#else
    return "no x86 builds in this library";
#endif
}

const char* portable_unavailable() { return ""; }

// The rules' texts, built once from the constants they describe.
struct RuleTexts {
    std::string bf16_slower, bf16_accepts, f16_slower, f16_accepts, f32_scores_slower, f32_items_slower,
        f32_accepts, backward_bf16_slower, backward_bf16_accepts, backward_f16_slower, backward_f16_accepts;
};

const RuleTexts& rule_texts() {
    static const RuleTexts texts = [] {
        const std::string side = str(kAmxF32MinScoreSide), bf16 = str(kAmxBackwardBf16MinLength),
                          f16 = str(kAmxBackwardF16MinLength);
        RuleTexts t;
        t.bf16_slower = "bf16 under " + str(kAmxBf16MinQueryRows) + " query rows: mostly padding on tiles";
        t.bf16_accepts = "bf16 from " + str(kAmxBf16MinQueryRows) + " query rows on tiles";
        t.f16_slower = "f16 under " + str(kAmxF16MinQueryRows) + " query rows: three tile products each";
        t.f16_accepts = "f16 from " + str(kAmxF16MinQueryRows) + " query rows on tiles";
        t.f32_scores_slower = "f32 under " + side + " x " + side + " scores: FMAs beat six tile products per product";
        t.f32_items_slower =
            "f32 work items under " + str(kAmxF32MinItemRows) + " query rows: FMAs beat six tile products per product";
        t.f32_accepts = "f32 work items of " + str(kAmxF32MinItemRows) + " query rows or more on tiles";
        t.backward_bf16_slower = "bf16 with a sequence under " + bf16 + ": mostly padding on tiles";
        t.backward_bf16_accepts = "bf16 with both sequences from " + bf16 + " on tiles";
        t.backward_f16_slower = "f16 with a sequence under " + f16 + ": mostly padding on tiles";
        t.backward_f16_accepts = "f16 with both sequences from " + f16 + " on tiles";
        return t;
    }();
    return texts;
}

// What an AMX candidate built for `parts` bf16 parts takes.
const char* amx_dtype_text(int parts) {
    return parts == 1 ? "takes bf16 inputs" : (parts == 2 ? "takes 16-bit inputs with f16 among them"
                                                          : "takes inputs with f32 among them");
}

// ---- Candidates ---------------------------------------------------------------------------------------------

// One row of a pass's table; Args is SdpaForwardArgs or SdpaBackwardArgs.
template <class Args>
struct Candidate {
    const char* name;
    const char* (*unavailable)();              // "" where this CPU runs it
    Verdict (*verdict)(const Args& args, DType dtype);  // its answer to a call of that dtype class
    bool (*run)(const Args& args);             // false: declined at run time; the next candidate runs
    std::string (*plan)(const Args& args);     // its work layout, for the log
};
using ForwardCandidate = Candidate<SdpaForwardArgs>;
using BackwardCandidate = Candidate<SdpaBackwardArgs>;

// A vector build: every dtype, every feature, where its CPU runs it.
template <class Args, const char* (*Unavailable)()>
Verdict vector_verdict(const Args&, DType) {
    const char* missing = Unavailable();
    if (*missing) return {Fit::cannot, missing};
    return {Fit::accepts, "a vector build runs every call"};
}

template <class Args, Status (*Run)(const Args&)>
bool run_vector(const Args& args) {
    return Run(args).ok;
}

template <class Args, const char* (*Unavailable)(), Status (*Run)(const Args&), std::string (*Plan)(const Args&)>
constexpr Candidate<Args> vector_candidate(const char* name) {
    return {name, Unavailable, vector_verdict<Args, Unavailable>, run_vector<Args, Run>, Plan};
}

using FA = SdpaForwardArgs;
using BA = SdpaBackwardArgs;
constexpr ForwardCandidate kPortableForward =
    vector_candidate<FA, portable_unavailable, sdpa_forward_portable, sdpa_forward_plan_portable>("portable");
constexpr BackwardCandidate kPortableBackward =
    vector_candidate<BA, portable_unavailable, sdpa_backward_portable, sdpa_backward_plan_portable>("portable");
#if defined(GRAPHATTN_HAVE_X86_ISAS)
constexpr ForwardCandidate kAvx512Forward =
    vector_candidate<FA, avx512_unavailable, sdpa_forward_avx512, sdpa_forward_plan_avx512>("avx512");
constexpr BackwardCandidate kAvx512Backward =
    vector_candidate<BA, avx512_unavailable, sdpa_backward_avx512, sdpa_backward_plan_avx512>("avx512");
constexpr ForwardCandidate kAvx2Forward =
    vector_candidate<FA, avx2_unavailable, sdpa_forward_avx2, sdpa_forward_plan_avx2>("avx2");
constexpr BackwardCandidate kAvx2Backward =
    vector_candidate<BA, avx2_unavailable, sdpa_backward_avx2, sdpa_backward_plan_avx2>("avx2");
#endif

// ---- Forward candidates ------------------------------------------------------------------------------------

// The AMX forward on `Parts` bf16 parts per value.
template <int Parts>
Verdict amx_forward_verdict(const SdpaForwardArgs& args, DType dtype) {
    if (amx_parts(dtype) != Parts) return {Fit::other_dtype, amx_dtype_text(Parts)};
    const char* missing = amx_unavailable();
    if (*missing) return {Fit::cannot, missing};
    if (args.dropout_p != 0.0f) return {Fit::cannot, "dropout: the tile kernel does not fuse it"};
#if defined(GRAPHATTN_HAVE_X86_ISAS)
    const RuleTexts& t = rule_texts();
    if (Parts == 1) {
        if (args.seq_q < kAmxBf16MinQueryRows) return {Fit::slower, t.bf16_slower.c_str()};
        return {Fit::accepts, t.bf16_accepts.c_str()};
    }
    if (Parts == 2) {
        if (args.seq_q < kAmxF16MinQueryRows) return {Fit::slower, t.f16_slower.c_str()};
        return {Fit::accepts, t.f16_accepts.c_str()};
    }
    if (args.seq_q * args.seq_kv < kAmxF32MinScoreSide * kAmxF32MinScoreSide)
        return {Fit::slower, t.f32_scores_slower.c_str()};
    if (sdpa_forward_amx_item_rows(args) < kAmxF32MinItemRows) return {Fit::slower, t.f32_items_slower.c_str()};
    return {Fit::accepts, t.f32_accepts.c_str()};
#else
    return {Fit::cannot, "no x86 builds in this library"};
#endif
}

#if defined(GRAPHATTN_HAVE_X86_ISAS)
template <int Parts>
bool run_amx_forward(const SdpaForwardArgs& args) {
    return sdpa_forward_amx(args, Parts);
}

template <int Parts>
std::string plan_amx_forward(const SdpaForwardArgs& args) {
    return sdpa_forward_plan_amx(args, Parts);
}
#endif

#if defined(GRAPHATTN_HAVE_X86_ISAS)
const ForwardCandidate kForwardCandidates[] = {
    {"amx_bf16", amx_unavailable, amx_forward_verdict<1>, run_amx_forward<1>, plan_amx_forward<1>},
    {"amx_bf16x3", amx_unavailable, amx_forward_verdict<2>, run_amx_forward<2>, plan_amx_forward<2>},
    {"amx_bf16x6", amx_unavailable, amx_forward_verdict<3>, run_amx_forward<3>, plan_amx_forward<3>},
    kAvx512Forward,
    kAvx2Forward,
    kPortableForward,
};
#else
const ForwardCandidate kForwardCandidates[] = {kPortableForward};
#endif

// ---- Backward candidates -----------------------------------------------------------------------------------

// The AMX backward on `Parts` bf16 parts per value; f32 has none (its five
// products on split tiles ran slower than the FMAs).
template <int Parts>
Verdict amx_backward_verdict(const SdpaBackwardArgs& args, DType dtype) {
    if (amx_parts(dtype) != Parts) return {Fit::other_dtype, amx_dtype_text(Parts)};
    const char* missing = amx_unavailable();
    if (*missing) return {Fit::cannot, missing};
    const RuleTexts& t = rule_texts();
    const SdpaForwardArgs& a = args.forward;
    if (std::min(a.seq_q, a.seq_kv) < (Parts == 1 ? kAmxBackwardBf16MinLength : kAmxBackwardF16MinLength))
        return {Fit::slower, (Parts == 1 ? t.backward_bf16_slower : t.backward_f16_slower).c_str()};
    return {Fit::accepts, (Parts == 1 ? t.backward_bf16_accepts : t.backward_f16_accepts).c_str()};
}

#if defined(GRAPHATTN_HAVE_X86_ISAS)
template <int Parts>
bool run_amx_backward(const SdpaBackwardArgs& args) {
    return sdpa_backward_amx(args, Parts);
}
#endif

#if defined(GRAPHATTN_HAVE_X86_ISAS)
const BackwardCandidate kBackwardCandidates[] = {
    {"amx_bf16", amx_unavailable, amx_backward_verdict<1>, run_amx_backward<1>, sdpa_backward_plan_amx},
    {"amx_bf16x3", amx_unavailable, amx_backward_verdict<2>, run_amx_backward<2>, sdpa_backward_plan_amx},
    kAvx512Backward,
    kAvx2Backward,
    kPortableBackward,
};
#else
const BackwardCandidate kBackwardCandidates[] = {kPortableBackward};
#endif

template <class Table, size_t N>
constexpr int table_size(const Table (&)[N]) {
    return int(N);
}

constexpr int kForwardCount = table_size(kForwardCandidates);
constexpr int kBackwardCount = table_size(kBackwardCandidates);

int candidate_count(Pass pass) { return pass == Pass::forward ? kForwardCount : kBackwardCount; }

// The forced candidate of each pass, or -1 (force_kernel).
std::atomic<int> forced_index[2] = {{-1}, {-1}};

// ---- The choice --------------------------------------------------------------------------------------------

// The candidate that runs a call: the forced one (index < 0 where it cannot
// run the call), else the first from `first` on that accepts it.  `why`,
// where given, gets the rules that decided: every earlier candidate's
// decline (but those built for another dtype class), then the chosen one's
// own; the calls themselves pass none, so choosing builds no text.
template <class Candidate, class Args, int N>
int choose(const Candidate (&table)[N], Pass pass, const Args& args, int first = 0, std::string* why = nullptr) {
    const int forced = forced_index[int(pass)].load(std::memory_order_relaxed);
    if (forced >= 0 && first == 0) {
        const Verdict v = table[forced].verdict(args, dtype_class(args));
        if (why) *why = std::string("forced (") + v.reason + ")";
        return v.runs() ? forced : -1;
    }
    const DType dtype = dtype_class(args);
    for (int i = first; i < N; ++i) {
        const Verdict v = table[i].verdict(args, dtype);
        if (v.fit == Fit::accepts) {
            if (why) *why += v.reason;
            return i;
        }
        if (why && v.fit != Fit::other_dtype) *why += std::string(table[i].name) + " declines: " + v.reason + "; ";
    }
    return -1;  // unreachable: portable accepts every call
}

// The error of a call the forced candidate cannot run, with its rule.
template <class Candidate, class Args, int N>
Status forced_cannot_run(const Candidate (&table)[N], Pass pass, const Args& args) {
    std::string why;
    const int forced = forced_index[int(pass)].load();
    choose(table, pass, args, 0, &why);
    return Status::error(std::string(pass == Pass::forward ? "forward" : "backward") + " kernel " +
                         (forced >= 0 ? table[forced].name : "(none)") + " is forced but cannot run this call: " + why);
}

}  // namespace

std::atomic<bool> g_poison_scratch{false};

void set_scratch_poisoning(bool on) { g_poison_scratch.store(on); }

DType sdpa_dtype_class(const DType* dtypes, int count) {
    bool all_bf16 = true, all_half = true;
    for (int i = 0; i < count; ++i) {
        all_bf16 = all_bf16 && dtypes[i] == DType::bf16;
        all_half = all_half && (dtypes[i] == DType::bf16 || dtypes[i] == DType::f16);
    }
    if (!all_half) return DType::f32;
    return all_bf16 ? DType::bf16 : DType::f16;
}

int kernel_candidate_count(Pass pass) { return candidate_count(pass); }

const char* kernel_candidate_name(Pass pass, int index) {
    if (index < 0 || index >= candidate_count(pass)) return "";
    return pass == Pass::forward ? kForwardCandidates[index].name : kBackwardCandidates[index].name;
}

std::string kernel_candidate_unavailable(Pass pass, int index) {
    if (index < 0 || index >= candidate_count(pass)) return "no such candidate";
    return pass == Pass::forward ? kForwardCandidates[index].unavailable() : kBackwardCandidates[index].unavailable();
}

Verdict forward_candidate_verdict(int index, const SdpaForwardArgs& args) {
    if (index < 0 || index >= kForwardCount) return {Fit::cannot, "no such candidate"};
    return kForwardCandidates[index].verdict(args, dtype_class(args));
}

Verdict backward_candidate_verdict(int index, const SdpaBackwardArgs& args) {
    if (index < 0 || index >= kBackwardCount) return {Fit::cannot, "no such candidate"};
    return kBackwardCandidates[index].verdict(args, dtype_class(args));
}

Status force_kernel(Pass pass, const std::string& name) {
    if (name.empty()) {
        forced_index[int(pass)].store(-1);
        return Status::success();
    }
    std::string known;
    for (int i = 0; i < candidate_count(pass); ++i) {
        const char* candidate = kernel_candidate_name(pass, i);
        if (name == candidate) {
            const std::string missing = kernel_candidate_unavailable(pass, i);
            if (!missing.empty())
                return Status::error("kernel " + name + " cannot run on this CPU: " + missing);
            forced_index[int(pass)].store(i);
            return Status::success();
        }
        known += (i ? ", " : "") + std::string(candidate);
    }
    return Status::error("unknown " + std::string(pass == Pass::forward ? "forward" : "backward") + " kernel '" +
                         name + "': the candidates are " + known);
}

std::string forced_kernel(Pass pass) {
    const int index = forced_index[int(pass)].load();
    return index < 0 ? "" : kernel_candidate_name(pass, index);
}

namespace {

// A dense call, its alignment resolved: checked, and refused where the forced candidate cannot run it.
Status admit_forward(const SdpaForwardArgs& args) {
    Status status = check_forward_args(args);
    if (!status.ok) return status;
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return status;
    if (choose(kForwardCandidates, Pass::forward, args) < 0)
        return forced_cannot_run(kForwardCandidates, Pass::forward, args);
    return status;
}

// An admitted dense call on the first candidate that accepts it.
Status run_forward(const SdpaForwardArgs& args) {
    if (args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0) return Status::success();
    int index = choose(kForwardCandidates, Pass::forward, args);
    // A candidate that declines at run time (split inputs holding an infinity) leaves the call to the next.
    while (!kForwardCandidates[index].run(args)) index = choose(kForwardCandidates, Pass::forward, args, index + 1);
    return Status::success();
}

std::string dense_forward_plan(const SdpaForwardArgs& args);

Status admit_backward(const SdpaBackwardArgs& args) {
    Status status = check_backward_args(args);
    if (!status.ok) return status;
    const SdpaForwardArgs& a = args.forward;
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return status;
    if (choose(kBackwardCandidates, Pass::backward, args) < 0)
        return forced_cannot_run(kBackwardCandidates, Pass::backward, args);
    return status;
}

Status run_backward(const SdpaBackwardArgs& args) {
    const SdpaForwardArgs& a = args.forward;
    if (args.grad_sinks.data) sdpa_sink_gradients(args);
    if (a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return Status::success();
    int index = choose(kBackwardCandidates, Pass::backward, args);
    while (!kBackwardCandidates[index].run(args)) index = choose(kBackwardCandidates, Pass::backward, args, index + 1);
    return Status::success();
}

std::string dense_backward_plan(const SdpaBackwardArgs& args);

// The packed calls' dense entry points on the CPU (no context).
template <class Args, Status (*F)(const Args&)>
Status without_context(const Args& args, void*) {
    return F(args);
}
template <class Args, std::string (*F)(const Args&)>
std::string text_without_context(const Args& args, void*) {
    return F(args);
}
const DenseForwardRunner kDenseForward = {without_context<SdpaForwardArgs, admit_forward>,
                                          without_context<SdpaForwardArgs, run_forward>,
                                          text_without_context<SdpaForwardArgs, dense_forward_plan>};
const DenseBackwardRunner kDenseBackward = {without_context<SdpaBackwardArgs, admit_backward>,
                                            without_context<SdpaBackwardArgs, run_backward>,
                                            text_without_context<SdpaBackwardArgs, dense_backward_plan>};

SdpaBackwardArgs with_alignment_resolved(const SdpaBackwardArgs& args) {
    SdpaBackwardArgs b = args;
    b.forward = with_alignment_resolved(args.forward);
    return b;
}

}  // namespace

Status sdpa_forward(const SdpaForwardArgs& args) {
    if (args.sequences.packed()) return run_packed_forward(args, kDenseForward);
    if (args.key.pages.paged() || args.value.pages.paged())
        return Status::error("block_table: a paged K/V cache needs the sequences' lengths (packed sequences)");
    SdpaForwardArgs a = with_alignment_resolved(args);
    // The width the K/V readers put rows together at (a quantized view decodes them so; graphattn/kv_rows.hpp).
    a.key.pages.cols = a.head_dim_qk;
    a.value.pages.cols = a.head_dim_v;
    Status status = admit_forward(a);
    return status.ok ? run_forward(a) : status;
}

Status sdpa_backward(const SdpaBackwardArgs& args) {
    if (args.forward.sequences.packed()) return run_packed_backward(args, kDenseBackward);
    const SdpaBackwardArgs b = with_alignment_resolved(args);
    Status status = admit_backward(b);
    return status.ok ? run_backward(b) : status;
}

namespace {

// A call's shape for the kernel choice alone: `batch` batch indices, no mask
// but a top-left causal window if asked.
SdpaForwardArgs shape_only_args(DType dtype_class, int64_t batch, int64_t seq_q, int64_t seq_kv, bool causal,
                                int64_t head_dim) {
    SdpaForwardArgs args;
    args.batch[0] = batch;
    args.batch[1] = args.batch[2] = 1;
    args.seq_q = seq_q;
    args.seq_kv = seq_kv;
    args.head_dim_qk = args.head_dim_v = head_dim;
    args.query.dtype = args.key.dtype = args.value.dtype = dtype_class;
    if (causal) args.window.right = 0;
    return args;
}

const char* chosen_name(Pass pass, int index) {
    return index < 0 ? "none" : kernel_candidate_name(pass, index);
}

}  // namespace

const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv) {
    SdpaBackwardArgs args;
    args.forward = shape_only_args(input_dtype, 1, seq_q, seq_kv, false, 64);
    args.grad_output.dtype = input_dtype;
    return chosen_name(Pass::backward, choose(kBackwardCandidates, Pass::backward, args));
}

namespace {

std::string dense_backward_plan(const SdpaBackwardArgs& args) {
    std::string why;
    const int index = choose(kBackwardCandidates, Pass::backward, args, 0, &why);
    const std::string head = std::string("isa=") + chosen_name(Pass::backward, index) + ",why=" + why + ",";
    const SdpaForwardArgs& a = args.forward;
    if (index < 0 || a.batch[0] * a.batch[1] * a.batch[2] * a.seq_kv == 0) return head + "layout=none";
    return head + kBackwardCandidates[index].plan(args);
}

std::string dense_forward_plan(const SdpaForwardArgs& args) {
    std::string why;
    const int index = choose(kForwardCandidates, Pass::forward, args, 0, &why);
    const std::string head = std::string("isa=") + chosen_name(Pass::forward, index) + ",why=" + why + ",";
    if (index < 0 || args.batch[0] * args.batch[1] * args.batch[2] * args.seq_q == 0)
        return head + "layout=none";
    return head + kForwardCandidates[index].plan(args);
}

}  // namespace

std::string sdpa_backward_plan(const SdpaBackwardArgs& args) {
    if (args.forward.sequences.packed()) return packed_backward_plan(args, kDenseBackward);
    return dense_backward_plan(with_alignment_resolved(args));
}

const char* sdpa_forward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv, int64_t batch, bool causal,
                             int64_t head_dim) {
    const SdpaForwardArgs args = shape_only_args(input_dtype, batch, seq_q, seq_kv, causal, head_dim);
    return chosen_name(Pass::forward, choose(kForwardCandidates, Pass::forward, args));
}

const char* sdpa_forward_isa_for(const SdpaForwardArgs& args) {
    return chosen_name(Pass::forward, choose(kForwardCandidates, Pass::forward, with_alignment_resolved(args)));
}

std::string sdpa_forward_plan(const SdpaForwardArgs& args) {
    if (args.sequences.packed()) return packed_forward_plan(args, kDenseForward);
    return dense_forward_plan(with_alignment_resolved(args));
}

}  // namespace graphattn
