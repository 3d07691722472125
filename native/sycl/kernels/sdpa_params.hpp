// Parameters of the SYCL SDPA kernels, passed by value to each launch.  This
// header is compiled twice: by the host C++ compiler (native/sycl/src fills
// it from graphattn::SdpaForwardArgs) and by the runtime SYCL compiler (the
// kernels read it), so it holds plain data only and must keep one layout.
#pragma once

#include <cstdint>

#include "graphattn/key_window.hpp"
#include "graphattn/kv_rows.hpp"

namespace graphattn_sycl {

constexpr int kViewDims = 5;  // 3 batch dims, row, column
constexpr float kLog2e = 1.4426950408889634f;  // the kernels' scores are in base 2

struct KernelView {
    const void* data;
    int32_t dtype;  // graphattn::DType: 0 f32, 1 bf16, 2 f16, 3 boolean
    int32_t unused;
    int64_t strides[kViewDims];  // in elements
};

// K or V: its data and how its rows are found (graphattn/kv_rows.hpp), the
// only way the kernels reach a key or value row.
struct KvRows {
    const void* data;
    int32_t dtype;  // as KernelView's
    int32_t unused;
    graphattn::KvRowLayout layout;
};

struct ForwardParams {
    int64_t batch[3];
    int64_t seq_q, seq_kv;
    int32_t head_dim_qk, head_dim_v;
    KernelView query;
    KvRows key, value;
    KernelView mask, output, stats;  // stats.data may be null
    float score_scale;       // multiplier of Q K^T (a divisor is inverted on the host)
    int32_t mask_kind;       // 0 none, 1 additive, 2 select
    int32_t select_keep_value;
    float select_fill;
    int32_t inf_as_zero;
    graphattn::KeyWindow window;  // the keys each row sees; the others score window.fill
    uint32_t dropout_threshold;  // keep when the Philox word >= this
    uint64_t dropout_seed, dropout_offset;
    uint64_t dropout_first_element;  // Philox element of (batch 0, row 0, key 0) (SdpaForwardArgs' rule)
    float dropout_scale;     // 1 / (1 - p)
    int32_t dropout_active;
    // Score modifiers (graphattn/score_mods.hpp): the softcap in log2 units (0: none), ALiBi's row shift, and
    // the ALiBi slopes and sinks, one f32 per batch index (data null: none).
    float softcap_log2;
    int64_t alibi_row_shift;
    KernelView alibi_slopes, sinks;
};

struct BackwardParams {
    ForwardParams forward;   // output and stats are read
    KernelView grad_output, grad_query, grad_key, grad_value, grad_mask;  // grad_mask.data may be null
    KernelView grad_sinks;   // data may be null; summed over the batch dims where its stride is 0
    float* row_delta;        // (flat batch, Sq): rowsum(dO * O), written by the first kernel
};

}  // namespace graphattn_sycl
