// Host side of the SYCL SDPA kernels: argument checks, kernel parameters,
// variant choice and launches.
#include <sycl/sycl.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "../kernels/sdpa_params.hpp"
#include "graphattn/packed_sequences.hpp"
#include "graphattn/philox.hpp"
#include "graphattn/sycl/sdpa_sycl.hpp"
#include "kernel_cache.hpp"

namespace graphattn {
namespace sycl_plugin {

namespace {

constexpr int kSubGroup = 16;      // the kernels' sub-group size (one row per sub-group)
constexpr int kRowsPerGroup = 4;   // sub-groups per work-group
constexpr int kXmxTileRows = 8;    // query rows per XMX work-group (one sub-group)

std::atomic<int> g_matrix_kernels{int(MatrixKernels::Auto)};

sycl::queue& as_queue(void* queue) { return *static_cast<sycl::queue*>(queue); }

graphattn_sycl::KernelView kernel_view(const TensorView& v) {
    graphattn_sycl::KernelView k{};
    k.data = v.data;
    k.dtype = int32_t(v.dtype);
    for (int d = 0; d < graphattn_sycl::kViewDims; ++d) k.strides[d] = v.strides[d];
    return k;
}

graphattn_sycl::KvRows kv_rows(const TensorView& v) {
    graphattn_sycl::KvRows k{};
    k.data = v.data;
    k.dtype = int32_t(v.dtype);
    k.layout = kv_row_layout(v);
    return k;
}

graphattn_sycl::ForwardParams forward_params(const SdpaForwardArgs& a) {
    graphattn_sycl::ForwardParams p{};
    for (int d = 0; d < kBatchDims; ++d) p.batch[d] = a.batch[d];
    p.seq_q = a.seq_q;
    p.seq_kv = a.seq_kv;
    p.head_dim_qk = int32_t(a.head_dim_qk);
    p.head_dim_v = int32_t(a.head_dim_v);
    p.query = kernel_view(a.query);
    p.key = kv_rows(a.key);
    p.value = kv_rows(a.value);
    p.mask = kernel_view(a.mask);
    p.output = kernel_view(a.output);
    p.stats = kernel_view(a.stats);
    p.score_scale = score_scale(a);
    p.mask_kind = int32_t(a.mask_kind);
    p.select_keep_value = a.select_keep_value;
    p.select_fill = a.select_fill;
    p.inf_as_zero = a.inf_as_zero;
    p.window = a.window;
    p.dropout_active = a.dropout_p > 0.0f;
    p.dropout_threshold = dropout_threshold(a.dropout_p);
    p.dropout_seed = a.dropout_seed;
    p.dropout_offset = a.dropout_offset;
    p.dropout_first_element = a.dropout_first_element;
    p.dropout_scale = a.dropout_p > 0.0f ? 1.0f / (1.0f - a.dropout_p) : 1.0f;
    p.softcap_log2 = a.softcap * graphattn_sycl::kLog2e;
    p.alibi_row_shift = a.alibi.row_shift(a.seq_q, a.seq_kv);
    p.alibi_slopes = kernel_view(a.alibi.slopes);
    p.sinks = kernel_view(a.sinks);
    return p;
}

int chunks(int64_t head_dim) { return int((head_dim + kSubGroup - 1) / kSubGroup); }

KernelVariant subgroup_variant(const char* source, DType input, int64_t head_dim_qk, int64_t head_dim_v) {
    return {source,
            {"-DGA_INPUT_DTYPE=" + std::to_string(int(input)), "-DGA_QK_CHUNKS=" + std::to_string(chunks(head_dim_qk)),
             "-DGA_V_CHUNKS=" + std::to_string(chunks(head_dim_v))}};
}

int round_up_16(int64_t n) { return int((n + 15) / 16 * 16); }

KernelVariant xmx_variant(DType input, int64_t head_dim_qk, int64_t head_dim_v) {
    return {"sdpa_forward_xmx.cpp",
            {"-DGA_INPUT_DTYPE=" + std::to_string(int(input)), "-DGA_QK_DIM=" + std::to_string(round_up_16(head_dim_qk)),
             "-DGA_V_DIM=" + std::to_string(round_up_16(head_dim_v))}};
}

// Which forward kernel runs, and why not the XMX one when it does not.  Under
// Auto the device's aspect decides before anything is built; the build then
// decides for the devices that drop joint_matrix kernels.
struct ForwardChoice {
    std::optional<sycl::kernel> xmx;  // set when the XMX kernel runs
    std::string name;                 // "xmx", or "subgroup (reason)"
};

ForwardChoice choose_forward(sycl::queue& q, const SdpaForwardArgs& a) {
    const auto policy = MatrixKernels(g_matrix_kernels.load());
    if (policy == MatrixKernels::Off) return {std::nullopt, "subgroup (matrix kernels are off)"};
    if (a.query.dtype != DType::bf16 && a.query.dtype != DType::f16)
        return {std::nullopt, "subgroup (the XMX kernel takes bf16 and f16 inputs)"};
    if (a.seq_q < kXmxTileRows)
        return {std::nullopt, "subgroup (fewer than " + std::to_string(kXmxTileRows) + " query rows fill no XMX tile)"};
    if (policy == MatrixKernels::Auto && !q.get_device().has(sycl::aspect::ext_intel_matrix))
        return {std::nullopt, "subgroup (the device has no ext_intel_matrix)"};
    try {
        auto& bundle = kernel_bundle_for(q, xmx_variant(a.query.dtype, a.head_dim_qk, a.head_dim_v));
        if (!bundle_has_kernel(bundle, "graphattn_sdpa_forward_xmx"))
            return {std::nullopt, "subgroup (the device dropped the joint_matrix kernel)"};
        return {bundle.ext_oneapi_get_kernel("graphattn_sdpa_forward_xmx"), "xmx"};
    } catch (const sycl::exception& e) {  // a compiler that rejects it leaves the sub-group kernel, which works
        return {std::nullopt, std::string("subgroup (the XMX kernel failed to build: ") + e.what() + ")"};
    }
}

// The SYCL rules on top of the common checks: head sizes the lanes hold, one
// input dtype for Q, K, V (and dO), which selects the compiled variant.
Status check_sycl_args(const SdpaForwardArgs& a) {
    if (a.key.pages.paged() || a.value.pages.paged())
        return Status::error("block_table: paged K/V caches are not taken on SYCL devices yet");
    Status s = check_forward_args(a);
    if (!s.ok) return s;
    if (a.head_dim_qk > kMaxHeadDim || a.head_dim_v > kMaxHeadDim)
        return Status::error("head sizes above " + std::to_string(kMaxHeadDim) + " are not supported by the SYCL kernels");
    if (a.key.dtype != a.query.dtype || a.value.dtype != a.query.dtype)
        return Status::error("query, key and value must share one dtype on the SYCL kernels");
    return Status::success();
}

sycl::nd_range<1> rows_range(int64_t rows) {
    const int64_t groups = (rows + kRowsPerGroup - 1) / kRowsPerGroup;
    return {size_t(groups * kRowsPerGroup * kSubGroup), size_t(kRowsPerGroup * kSubGroup)};
}

// Work already on an out-of-order queue is waited for by a barrier; the
// barrier after the launches makes later work wait for them.
sycl::event queue_barrier(sycl::queue& q) { return q.ext_oneapi_submit_barrier(); }

template <typename Params>
sycl::event launch(sycl::queue& q, const sycl::kernel& kernel, int64_t rows, const Params& params,
                   const std::vector<sycl::event>& deps) {
    return q.submit([&](sycl::handler& h) {
        h.depends_on(deps);
        h.set_args(params);
        h.parallel_for(rows_range(rows), kernel);
    });
}

template <typename Params, typename Extra1, typename Extra2>
sycl::event launch(sycl::queue& q, const sycl::kernel& kernel, int64_t rows, const Params& params, Extra1 e1,
                   Extra2 e2, const std::vector<sycl::event>& deps) {
    return q.submit([&](sycl::handler& h) {
        h.depends_on(deps);
        h.set_args(params, e1, e2);
        h.parallel_for(rows_range(rows), kernel);
    });
}

Status from_exception(const sycl::exception& e) { return Status::error(std::string("SYCL: ") + e.what()); }

}  // namespace

namespace {

// A dense call (its alignment resolved) on the queue, after check_sycl_args.
Status run_dense_forward(const SdpaForwardArgs& args, void* queue) {
    Status s;
    const int64_t batch = args.batch[0] * args.batch[1] * args.batch[2];
    const int64_t rows = batch * args.seq_q;
    if (rows == 0) return s;
    try {
        sycl::queue& q = as_queue(queue);
        std::vector<sycl::event> deps;
        if (!q.is_in_order()) deps.push_back(queue_barrier(q));
        const graphattn_sycl::ForwardParams params = forward_params(args);
        const ForwardChoice choice = choose_forward(q, args);
        if (choice.xmx) {
            const sycl::kernel& kernel = *choice.xmx;
            const int64_t groups = batch * ((args.seq_q + kXmxTileRows - 1) / kXmxTileRows);
            q.submit([&](sycl::handler& h) {
                h.depends_on(deps);
                h.set_args(params);
                h.parallel_for(sycl::nd_range<1>{size_t(groups * kSubGroup), size_t(kSubGroup)}, kernel);
            });
        } else {
            auto& bundle = kernel_bundle_for(q, subgroup_variant("sdpa_forward.cpp", args.query.dtype,
                                                                       args.head_dim_qk, args.head_dim_v));
            launch(q, bundle.ext_oneapi_get_kernel("graphattn_sdpa_forward"), rows, params, deps);
        }
        if (!q.is_in_order()) queue_barrier(q);
    } catch (const sycl::exception& e) {
        return from_exception(e);
    }
    return s;
}

Status admit_dense_forward(const SdpaForwardArgs& args, void*) { return check_sycl_args(args); }

std::string dense_forward_kernel(const SdpaForwardArgs& args, void* queue) {
    return "kernel=" + choose_forward(as_queue(queue), args).name;
}

}  // namespace

// Packed sequences go to one dense launch per run of equal-length sequences, in order on the queue (the
// device's own work items keep it busy), rows without keys included: the kernels write them, as device
// memory the host does not write.
Status sdpa_forward(void* queue, const SdpaForwardArgs& args) {
    if (args.sequences.packed())
        return run_packed_forward(args, {admit_dense_forward, run_dense_forward, dense_forward_kernel, queue,
                                         /*pooled=*/false, /*host_fills=*/false});
    const SdpaForwardArgs a = with_alignment_resolved(args);
    Status s = check_sycl_args(a);
    return s.ok ? run_dense_forward(a, queue) : s;
}

Status sdpa_backward(void* queue, const SdpaBackwardArgs& given) {
    if (given.forward.sequences.packed())
        return Status::error("sequences: the SYCL backward does not take packed sequences yet");
    SdpaBackwardArgs args = given;
    args.forward = with_alignment_resolved(given.forward);
    Status s = check_backward_args(args);
    if (!s.ok) return s;
    if (!(s = check_sycl_args(args.forward)).ok) return s;
    const SdpaForwardArgs& a = args.forward;
    if (args.grad_output.dtype != a.query.dtype)
        return Status::error("grad_output must have the query's dtype on the SYCL kernels");
    const int64_t batch = a.batch[0] * a.batch[1] * a.batch[2];
    if (batch * a.seq_kv == 0) return s;
    try {
        sycl::queue& q = as_queue(queue);
        auto& bundle =
            kernel_bundle_for(q, subgroup_variant("sdpa_backward.cpp", a.query.dtype, a.head_dim_qk, a.head_dim_v));
        graphattn_sycl::BackwardParams p{};
        p.forward = forward_params(a);
        p.grad_output = kernel_view(args.grad_output);
        p.grad_query = kernel_view(args.grad_query);
        p.grad_key = kernel_view(args.grad_key);
        p.grad_value = kernel_view(args.grad_value);
        p.grad_mask = kernel_view(args.grad_mask);
        p.grad_sinks = kernel_view(args.grad_sinks);
        const int64_t query_rows = batch * a.seq_q;
        p.row_delta = sycl::malloc_device<float>(size_t(std::max<int64_t>(query_rows, 1)), q);
        if (p.row_delta == nullptr) return Status::error("SYCL: out of device memory for the row deltas");
        // K/V batch dims with stride 0 are shared by the batch entries an item sums over.
        int32_t shared = 0;
        int64_t outer_items = 1;
        for (int d = 0; d < kBatchDims; ++d) {
            if (a.batch[d] > 1 && kv_row_layout(a.key).shared_over(d)) shared |= 1 << d;
            else outer_items *= a.batch[d];
        }
        std::vector<sycl::event> deps;
        if (!q.is_in_order()) deps.push_back(queue_barrier(q));
        sycl::event delta = launch(q, bundle.ext_oneapi_get_kernel("graphattn_sdpa_row_delta"), query_rows, p, deps);
        sycl::event kv = launch(q, bundle.ext_oneapi_get_kernel("graphattn_sdpa_backward_kv"), outer_items * a.seq_kv, p,
                                outer_items, shared, {delta});
        sycl::event dq = launch(q, bundle.ext_oneapi_get_kernel("graphattn_sdpa_backward_q"), query_rows, p, {delta});
        sycl::event sinks = args.grad_sinks.data
                                ? launch(q, bundle.ext_oneapi_get_kernel("graphattn_sdpa_sink_grad"), 1, p, {delta})
                                : delta;
        float* scratch = p.row_delta;
        const sycl::context context = q.get_context();
        q.submit([&](sycl::handler& h) {
            h.depends_on({kv, dq, sinks});
            h.host_task([scratch, context] { sycl::free(scratch, context); });
        });
        if (!q.is_in_order()) queue_barrier(q);
    } catch (const sycl::exception& e) {
        return from_exception(e);
    }
    return s;
}

std::string sdpa_forward_kernel(void* queue, const SdpaForwardArgs& args) {
    if (args.sequences.packed()) return "packed";
    return choose_forward(as_queue(queue), with_alignment_resolved(args)).name;
}

void set_matrix_kernels(MatrixKernels policy) { g_matrix_kernels.store(int(policy)); }
MatrixKernels matrix_kernels() { return MatrixKernels(g_matrix_kernels.load()); }

Status prebuild(void* queue, DType input_dtype, int head_dim_qk, int head_dim_v, bool backward, double* seconds) {
    const auto start = std::chrono::steady_clock::now();
    try {
        sycl::queue& q = as_queue(queue);
        kernel_bundle_for(q, subgroup_variant("sdpa_forward.cpp", input_dtype, head_dim_qk, head_dim_v));
        if (backward) kernel_bundle_for(q, subgroup_variant("sdpa_backward.cpp", input_dtype, head_dim_qk, head_dim_v));
    } catch (const sycl::exception& e) {
        return from_exception(e);
    }
    if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return Status::success();
}

Status build_xmx_sources(void* queue, bool* has_kernel) {
    try {
        sycl::queue& q = as_queue(queue);
        auto& bundle = kernel_bundle_for(q, xmx_variant(DType::bf16, 64, 64));
        if (has_kernel) *has_kernel = bundle_has_kernel(bundle, "graphattn_sdpa_forward_xmx");
    } catch (const sycl::exception& e) {
        return from_exception(e);
    }
    return Status::success();
}

int64_t builds_done() { return build_count(); }
double build_seconds_total() { return build_seconds(); }

}  // namespace sycl_plugin
}  // namespace graphattn
