// Device-side helpers shared by the SYCL SDPA kernels: element access by
// dtype, strided offsets, the score mask and the dropout multiplier.
// Compiled at run time; build options pick the input dtype
// (GA_INPUT_DTYPE) and the per-lane head-size chunks (GA_QK_CHUNKS,
// GA_V_CHUNKS: ceil(head size / sub-group size)).
#pragma once

#include <sycl/sycl.hpp>

#include "graphattn/philox.hpp"
#include "graphattn/score_mods.hpp"
#include "sdpa_params.hpp"

namespace graphattn_sycl {

namespace syclex = sycl::ext::oneapi::experimental;

constexpr int kSubGroup = 16;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = __builtin_inff();
constexpr float kNaN = __builtin_nanf("");

// bf16 <-> f32 by bit operations: the runtime's bfloat16 conversions link a
// device library that makes its persistent kernel cache crash (2026.2).
inline float bf16_bits_to_f32(uint16_t bits) { return sycl::bit_cast<float>(uint32_t(bits) << 16); }

inline uint16_t f32_to_bf16_bits(float x) {
    const uint32_t u = sycl::bit_cast<uint32_t>(x);
    if (sycl::isnan(x)) return uint16_t((u >> 16) | 0x40);          // stays a NaN
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);       // round to nearest even
}

inline float to_f32(float x) { return x; }
inline float to_f32(sycl::half x) { return float(x); }
inline float to_f32(uint16_t bf16_bits) { return bf16_bits_to_f32(bf16_bits); }

#if GA_INPUT_DTYPE == 0
using InputT = float;
#elif GA_INPUT_DTYPE == 1
using InputT = uint16_t;  // bf16 bits
#else
using InputT = sycl::half;
#endif

inline float element_as_f32(const void* base, int32_t dtype, int64_t index) {
    switch (dtype) {
        case 0: return static_cast<const float*>(base)[index];
        case 1: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[index]);
        case 2: return float(static_cast<const sycl::half*>(base)[index]);
        default: return static_cast<const uint8_t*>(base)[index] ? 1.0f : 0.0f;
    }
}

inline void store_f32_as(const KernelView& v, int64_t index, float x) {
    void* base = const_cast<void*>(v.data);
    switch (v.dtype) {
        case 0: static_cast<float*>(base)[index] = x; break;
        case 1: static_cast<uint16_t*>(base)[index] = f32_to_bf16_bits(x); break;
        default: static_cast<sycl::half*>(base)[index] = sycl::half(x); break;
    }
}

inline float input_as_f32(const KernelView& v, int64_t index) {
    return to_f32(static_cast<const InputT*>(v.data)[index]);
}

// Row-major flat batch index -> the view's element offset of that batch entry.
inline int64_t batch_offset(const KernelView& v, const int64_t batch[3], int64_t flat) {
    const int64_t b2 = flat % batch[2], b1 = (flat / batch[2]) % batch[1], b0 = flat / (batch[2] * batch[1]);
    return b0 * v.strides[0] + b1 * v.strides[1] + b2 * v.strides[2];
}

// The same for K or V: the base its row offsets start from.
inline int64_t batch_offset(const KvRows& kv, const int64_t batch[3], int64_t flat) {
    const int64_t b2 = flat % batch[2], b1 = (flat / batch[2]) % batch[1], b0 = flat / (batch[2] * batch[1]);
    return kv.layout.batch_offset(b0, b1, b2);
}

// Element c of K/V row j of the batch entry at `base`, as f32.
inline float kv_as_f32(const KvRows& kv, int64_t base, int64_t j, int64_t c) {
    return to_f32(static_cast<const InputT*>(kv.data)[kv.layout.element_offset(base, j, c)]);
}

// The keys query row i visits, [key_begin, key_end): those its window shows
// where hidden keys weigh 0, else all of them (a finite fill keeps hidden
// keys in the softmax).
inline int64_t key_begin(const ForwardParams& p, int64_t i) {
    return p.window.skips_blocks() ? p.window.key_begin(i, p.seq_kv) : 0;
}
inline int64_t key_end(const ForwardParams& p, int64_t i) {
    return p.window.skips_blocks() ? p.window.key_end(i, p.seq_kv) : p.seq_kv;
}

// Did a Select or the key window replace score (i, j)?  mask_value is the
// mask element already read for (i, j) (unused without a Select).
inline bool score_replaced(const ForwardParams& p, float mask_value, int64_t i, int64_t j) {
    if (p.mask_kind == 2 && (mask_value != 0.0f) != (p.select_keep_value != 0)) return true;
    return !p.window.sees(i, j);
}

// x * log2(e), a finite x kept finite (clamped to +-FLT_MAX): a mask of
// -3e38 stays a low score and one of 3e38 the largest, never an infinity
// whose max would give inf - inf = NaN (the CPU kernels' rule too).
inline float to_log2_units(float x) {
    const float y = x * kLog2e;
    return sycl::isfinite(x) ? sycl::clamp(y, -3.40282347e+38f, 3.40282347e+38f) : y;
}

// The masked score of (i, j) in log2 units, given the scaled score in log2 units.
inline float masked_score_log2(const ForwardParams& p, float score_log2, float mask_value, int64_t i, int64_t j) {
    if (p.mask_kind == 1) score_log2 += to_log2_units(mask_value);
    if (p.mask_kind == 2 && (mask_value != 0.0f) != (p.select_keep_value != 0)) score_log2 = to_log2_units(p.select_fill);
    if (!p.window.sees(i, j)) score_log2 = to_log2_units(p.window.fill);
    return score_log2;
}

// A per-batch-index f32 operand (the ALiBi slopes, the sinks) of batch entry fb, times `units`; 0 without one.
inline float per_index(const KernelView& v, const int64_t batch[3], int64_t fb, float units = 1.0f) {
    return v.data ? static_cast<const float*>(v.data)[batch_offset(v, batch, fb)] * units : 0.0f;
}

// The score modifiers (graphattn/score_mods.hpp) on the scaled score of (i, j) in log2 units, before the mask:
// softcap, then ALiBi with the batch entry's slope (log2 units).  cap_tanh receives the softcap's tanh, whose
// 1 - tanh^2 the backward's dS takes (0 without a softcap).
inline float modified_score_log2(const ForwardParams& p, float score_log2, float slope_log2, int64_t i, int64_t j,
                                 float& cap_tanh) {
    cap_tanh = 0.0f;
    if (p.softcap_log2 > 0.0f) {
        cap_tanh = sycl::tanh(score_log2 / p.softcap_log2);
        score_log2 = p.softcap_log2 * cap_tanh;
    }
    if (p.alibi_slopes.data) score_log2 -= slope_log2 * graphattn::alibi_distance(i, j, p.alibi_row_shift);
    return score_log2;
}

// A finished row: the factor of its unnormalised output and its stats (natural log), from its running max
// and sum (base 2) with batch entry fb's sink folded in.  sum > 0: a normal row; 0: every score masked (0 and
// -inf in SoftMax mode inf_as_zero, else NaN); NaN: a NaN score.
struct RowFinish {
    float factor, lse;
};
inline RowFinish finish_row(const ForwardParams& p, int64_t fb, float row_max, float row_sum) {
    float out_scale = 1.0f;
    if (p.sinks.data) {
        const graphattn::SinkFold f = graphattn::fold_sink(row_max, row_sum, per_index(p.sinks, p.batch, fb, kLog2e),
                                                           [](float x) { return sycl::exp2(x); });
        row_max = f.max;
        row_sum = f.sum;
        out_scale = f.output_factor;
    }
    if (row_sum > 0.0f) return {out_scale / row_sum, row_max * kLn2 + sycl::log(row_sum)};
    if (row_sum == 0.0f && p.inf_as_zero) return {0.0f, -kInf};
    return {kNaN, kNaN};
}

inline float mask_element(const ForwardParams& p, int64_t mask_row_offset, int64_t j) {
    if (p.mask_kind == 0) return 0.0f;
    return element_as_f32(p.mask.data, p.mask.dtype, mask_row_offset + j * p.mask.strides[4]);
}

// Dropout multiplier (0 or 1 / (1 - p)) of element e of (batch..., Sq, Skv).
inline float dropout_multiplier(const ForwardParams& p, uint64_t e) {
    if (!p.dropout_active) return 1.0f;
    const uint64_t block = e >> 2;
    const graphattn::PhiloxWords r = graphattn::philox4x32_10(
        uint32_t(block), uint32_t(block >> 32), uint32_t(p.dropout_offset), uint32_t(p.dropout_offset >> 32),
        uint32_t(p.dropout_seed), uint32_t(p.dropout_seed >> 32));
    return r.w[e & 3] >= p.dropout_threshold ? p.dropout_scale : 0.0f;
}

inline int64_t batch_count(const ForwardParams& p) { return p.batch[0] * p.batch[1] * p.batch[2]; }

// The sub-group kernels give each sub-group one row (of queries or keys):
// the calling work-item's lane in it, the row's index, and that index split
// into an outer index and the row within it (rows_per_outer of them).
struct RowItem {
    sycl::sub_group sg;
    int lane;
    int64_t row, outer, inner;
};

inline RowItem row_item(int64_t rows_per_outer) {
    const sycl::nd_item<1> item = sycl::ext::oneapi::this_work_item::get_nd_item<1>();
    const sycl::sub_group sg = item.get_sub_group();
    const int64_t row = int64_t(item.get_global_id(0) / kSubGroup);
    const int64_t per = rows_per_outer > 0 ? rows_per_outer : 1;  // no rows: every item leaves at its bounds check
    return {sg, int(sg.get_local_linear_id()), row, row / per, row % per};
}

// Lane's share of one input row of `size` elements starting at `offset`:
// chunk t holds element lane + 16 t times `scale` (0 past the row's end).
template <int Chunks>
inline void load_row_chunks(const KernelView& v, int64_t offset, int size, int lane, float scale, float (&chunks)[Chunks]) {
    for (int t = 0; t < Chunks; ++t) {
        const int d = lane + t * kSubGroup;
        chunks[t] = d < size ? input_as_f32(v, offset + d * v.strides[4]) * scale : 0.0f;
    }
}

// The same for K/V row j of the batch entry at `base`.
template <int Chunks>
inline void load_kv_row_chunks(const KvRows& kv, int64_t base, int64_t j, int size, int lane, float scale,
                               float (&chunks)[Chunks]) {
    for (int t = 0; t < Chunks; ++t) {
        const int d = lane + t * kSubGroup;
        chunks[t] = d < size ? kv_as_f32(kv, base, j, d) * scale : 0.0f;
    }
}

}  // namespace graphattn_sycl
