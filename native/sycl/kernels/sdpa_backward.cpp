// SDPA backward, sub-group variant (any SYCL device), FlashAttention-2 style:
// P is recomputed from the forward's log-sum-exp, nothing of size Sq x Skv is
// stored.  Three kernels, one sub-group per row each:
//   graphattn_sdpa_row_delta: D_i = rowsum(dO_i * O_i);
//   graphattn_sdpa_backward_kv: one key row j of one K/V batch entry, walking
//     every query row of every batch entry that shares it (the heads of a GQA
//     group), so dK_j and dV_j are summed without atomics;
//   graphattn_sdpa_backward_q: one query row i, walking its keys, for dQ_i.
//   graphattn_sdpa_sink_grad: d(sinks) from the stats and D (score_mods.hpp).
// dS = P (dP - D), with dP = dO V^T through the dropout multipliers; a Select
// or window fill takes no gradient; grad_mask (if asked) receives dS itself.
#include "sdpa_device.hpp"

using namespace graphattn_sycl;

namespace {

// One score's probability, dropout multiplier and dS, recomputed.
struct ScoreGrad {
    float prob;      // P (before dropout)
    float dropped;   // P * Z
    float grad;      // dS for the mask gradient
    float grad_qk;   // dS for Q and K (0 where a fill replaced the score)
};

inline float lse_log2(const ForwardParams& p, int64_t fb, int64_t i) {
    const float lse = static_cast<const float*>(p.stats.data)[batch_offset(p.stats, p.batch, fb) + i * p.stats.strides[3]];
    return lse == -kInf ? kInf : lse * kLog2e;  // a fully masked row: P = 0
}

// slope_log2: the batch entry's ALiBi slope; a softcap's 1 - tanh^2 carries dS to Q K^T.
inline ScoreGrad score_grad(const ForwardParams& p, float score_log2, float slope_log2, float dp, float lse2,
                            float delta, int64_t m_off, uint64_t drop_base, int64_t i, int64_t j) {
    const float mask_value = mask_element(p, m_off, j);
    float cap_tanh;
    const float modified = modified_score_log2(p, score_log2, slope_log2, i, j, cap_tanh);
    const float prob = sycl::exp2(masked_score_log2(p, modified, mask_value, i, j) - lse2);
    const float z = dropout_multiplier(p, drop_base + uint64_t(j));
    const float ds = prob * (dp * z - delta);
    const float cap_slope = p.softcap_log2 > 0.0f ? graphattn::softcap_derivative(score_log2, cap_tanh, p.softcap_log2)
                                                  : 1.0f;
    return {prob, prob * z, ds, score_replaced(p, mask_value, i, j) ? 0.0f : ds * cap_slope};
}

inline float* grad_mask_ptr(const BackwardParams& b) { return static_cast<float*>(const_cast<void*>(b.grad_mask.data)); }

}  // namespace

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_row_delta(BackwardParams b) {
    const ForwardParams& p = b.forward;
    const auto [sg, lane, row, fb, i] = row_item(p.seq_q);
    if (row >= batch_count(p) * p.seq_q) return;
    const int64_t o_off = batch_offset(p.output, p.batch, fb) + i * p.output.strides[3];
    const int64_t g_off = batch_offset(b.grad_output, p.batch, fb) + i * b.grad_output.strides[3];
    float partial = 0.0f;
    for (int d = lane; d < p.head_dim_v; d += kSubGroup)
        partial += element_as_f32(p.output.data, p.output.dtype, o_off + d * p.output.strides[4]) *
                   input_as_f32(b.grad_output, g_off + d * b.grad_output.strides[4]);
    const float delta = sycl::reduce_over_group(sg, partial, sycl::plus<float>());
    if (lane == 0) b.row_delta[row] = delta;
}

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_backward_kv(BackwardParams b, int64_t outer_items, int32_t shared_mask) {
    const ForwardParams& p = b.forward;
    const auto [sg, lane, row, outer, j] = row_item(p.seq_kv);
    if (row >= outer_items * p.seq_kv) return;
    const int D = p.head_dim_qk, Dv = p.head_dim_v;
    // Batch dims in shared_mask (bit d) are those K/V are broadcast over: this
    // item sums over them.  The others come from the outer index.
    int64_t outer_sizes[3], shared_sizes[3], group = 1;
    for (int d = 0; d < 3; ++d) {
        const bool shared = (shared_mask >> d) & 1;
        outer_sizes[d] = shared ? 1 : p.batch[d];
        shared_sizes[d] = shared ? p.batch[d] : 1;
        group *= shared_sizes[d];
    }
    const int64_t o2 = outer % outer_sizes[2], o1 = (outer / outer_sizes[2]) % outer_sizes[1],
                  o0 = outer / (outer_sizes[2] * outer_sizes[1]);

    float k[GA_QK_CHUNKS], v[GA_V_CHUNKS], dk[GA_QK_CHUNKS], dv[GA_V_CHUNKS];
    const int64_t fb_outer = (o0 * p.batch[1] + o1) * p.batch[2] + o2;  // shared dims at 0
    load_kv_row_chunks(p.key, batch_offset(p.key, p.batch, fb_outer), j, D, lane, p.score_scale * kLog2e, k);
    load_kv_row_chunks(p.value, batch_offset(p.value, p.batch, fb_outer), j, Dv, lane, 1.0f, v);
    for (int t = 0; t < GA_QK_CHUNKS; ++t) dk[t] = 0.0f;
    for (int t = 0; t < GA_V_CHUNKS; ++t) dv[t] = 0.0f;
    // Rows outside [first_row, row_end) cannot see key j through a -inf window
    // fill (their dS is 0); they are visited anyway when the mask gradient is written.
    const bool skip = b.grad_mask.data == nullptr && p.window.skips_blocks();
    const int64_t first_row = skip ? p.window.row_begin(j, p.seq_q) : 0;
    const int64_t row_end = skip ? p.window.row_end(j, p.seq_q) : p.seq_q;
    for (int64_t g = 0; g < group; ++g) {
        const int64_t s2 = g % shared_sizes[2], s1 = (g / shared_sizes[2]) % shared_sizes[1],
                      s0 = g / (shared_sizes[2] * shared_sizes[1]);
        const int64_t fb = ((o0 + s0) * p.batch[1] + (o1 + s1)) * p.batch[2] + (o2 + s2);
        const int64_t q_base = batch_offset(p.query, p.batch, fb), g_base = batch_offset(b.grad_output, p.batch, fb);
        const int64_t m_base = p.mask_kind ? batch_offset(p.mask, p.batch, fb) : 0;
        const int64_t dm_base = b.grad_mask.data ? batch_offset(b.grad_mask, p.batch, fb) : 0;
        for (int64_t i = first_row; i < row_end; ++i) {
            const int64_t q_off = q_base + i * p.query.strides[3], g_off = g_base + i * b.grad_output.strides[3];
            float q[GA_QK_CHUNKS], go[GA_V_CHUNKS], s_part = 0.0f, dp_part = 0.0f;
            for (int t = 0; t < GA_QK_CHUNKS; ++t) {
                const int d = lane + t * kSubGroup;
                q[t] = d < D ? input_as_f32(p.query, q_off + d * p.query.strides[4]) : 0.0f;
                s_part += q[t] * k[t];
            }
            for (int t = 0; t < GA_V_CHUNKS; ++t) {
                const int d = lane + t * kSubGroup;
                go[t] = d < Dv ? input_as_f32(b.grad_output, g_off + d * b.grad_output.strides[4]) : 0.0f;
                dp_part += go[t] * v[t];
            }
            const float s = sycl::reduce_over_group(sg, s_part, sycl::plus<float>());
            const float dp = sycl::reduce_over_group(sg, dp_part, sycl::plus<float>());
            const ScoreGrad sgrad = score_grad(p, s, graphattn::alibi_slope_log2(per_index(p.alibi_slopes, p.batch, fb), kLog2e), dp,
                                               lse_log2(p, fb, i), b.row_delta[fb * p.seq_q + i],
                                               m_base + i * p.mask.strides[3], p.dropout_first_element + uint64_t((fb * p.seq_q + i) * p.seq_kv),
                                               i, j);
            if (b.grad_mask.data && lane == 0)
                grad_mask_ptr(b)[dm_base + i * b.grad_mask.strides[3] + j * b.grad_mask.strides[4]] = sgrad.grad;
            for (int t = 0; t < GA_QK_CHUNKS; ++t) dk[t] += sgrad.grad_qk * q[t];
            for (int t = 0; t < GA_V_CHUNKS; ++t) dv[t] += sgrad.dropped * go[t];
        }
    }
    const int64_t dk_off = batch_offset(b.grad_key, p.batch, fb_outer) + j * b.grad_key.strides[3];
    const int64_t dv_off = batch_offset(b.grad_value, p.batch, fb_outer) + j * b.grad_value.strides[3];
    for (int t = 0; t < GA_QK_CHUNKS; ++t) {
        const int d = lane + t * kSubGroup;
        if (d < D) store_f32_as(b.grad_key, dk_off + d * b.grad_key.strides[4], dk[t] * p.score_scale);
    }
    for (int t = 0; t < GA_V_CHUNKS; ++t) {
        const int d = lane + t * kSubGroup;
        if (d < Dv) store_f32_as(b.grad_value, dv_off + d * b.grad_value.strides[4], dv[t]);
    }
}

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_backward_q(BackwardParams b) {
    const ForwardParams& p = b.forward;
    const auto [sg, lane, row, fb, i] = row_item(p.seq_q);
    if (row >= batch_count(p) * p.seq_q) return;
    const int D = p.head_dim_qk, Dv = p.head_dim_v;
    const int64_t q_off = batch_offset(p.query, p.batch, fb) + i * p.query.strides[3];
    const int64_t g_off = batch_offset(b.grad_output, p.batch, fb) + i * b.grad_output.strides[3];
    const int64_t k_base = batch_offset(p.key, p.batch, fb), v_base = batch_offset(p.value, p.batch, fb);
    const int64_t m_off = p.mask_kind ? batch_offset(p.mask, p.batch, fb) + i * p.mask.strides[3] : 0;
    float q[GA_QK_CHUNKS], go[GA_V_CHUNKS], dq[GA_QK_CHUNKS];
    load_row_chunks(p.query, q_off, D, lane, p.score_scale * kLog2e, q);
    load_row_chunks(b.grad_output, g_off, Dv, lane, 1.0f, go);
    for (int t = 0; t < GA_QK_CHUNKS; ++t) dq[t] = 0.0f;
    const float lse2 = lse_log2(p, fb, i), delta = b.row_delta[row];
    const float slope = graphattn::alibi_slope_log2(per_index(p.alibi_slopes, p.batch, fb), kLog2e);
    const uint64_t drop_base = p.dropout_first_element + uint64_t((fb * p.seq_q + i) * p.seq_kv);
    const int64_t end = key_end(p, i);
    for (int64_t j = key_begin(p, i); j < end; ++j) {
        float k[GA_QK_CHUNKS], s_part = 0.0f, dp_part = 0.0f;
        for (int t = 0; t < GA_QK_CHUNKS; ++t) {
            const int d = lane + t * kSubGroup;
            k[t] = d < D ? kv_as_f32(p.key, k_base, j, d) : 0.0f;
            s_part += q[t] * k[t];
        }
        for (int t = 0; t < GA_V_CHUNKS; ++t) {
            const int d = lane + t * kSubGroup;
            if (d < Dv) dp_part += go[t] * kv_as_f32(p.value, v_base, j, d);
        }
        const float s = sycl::reduce_over_group(sg, s_part, sycl::plus<float>());
        const float dp = sycl::reduce_over_group(sg, dp_part, sycl::plus<float>());
        const ScoreGrad sgrad = score_grad(p, s, slope, dp, lse2, delta, m_off, drop_base, i, j);
        for (int t = 0; t < GA_QK_CHUNKS; ++t) dq[t] += sgrad.grad_qk * k[t];
    }
    const int64_t dq_off = batch_offset(b.grad_query, p.batch, fb) + i * b.grad_query.strides[3];
    for (int t = 0; t < GA_QK_CHUNKS; ++t) {
        const int d = lane + t * kSubGroup;
        if (d < D) store_f32_as(b.grad_query, dq_off + d * b.grad_query.strides[4], dq[t] * p.score_scale);
    }
}

// d sigma = -sum over rows of exp(sigma - stats_i) D_i per batch entry, summed into grad_sinks where entries share
// an element (stride 0).  One sub-group walks the entries in order: no atomics, the same sum on every run.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_sink_grad(BackwardParams b) {
    const ForwardParams& p = b.forward;
    const auto [sg, lane, row, outer, inner] = row_item(1);
    if (row >= 1) return;
    float* out = static_cast<float*>(const_cast<void*>(b.grad_sinks.data));
    const int64_t batch = batch_count(p);
    if (lane == 0)
        for (int64_t fb = 0; fb < batch; ++fb) out[batch_offset(b.grad_sinks, p.batch, fb)] = 0.0f;
    const float* stats = static_cast<const float*>(p.stats.data);
    for (int64_t fb = 0; fb < batch; ++fb) {
        const float sink = per_index(p.sinks, p.batch, fb);
        float partial = 0.0f;
        for (int64_t i = lane; i < p.seq_q; i += kSubGroup) {
            const float lse = stats[batch_offset(p.stats, p.batch, fb) + i * p.stats.strides[3]];
            partial += graphattn::sink_weight(sink, lse, [](float x) { return sycl::exp(x); }) * b.row_delta[fb * p.seq_q + i];
        }
        const float total = sycl::reduce_over_group(sg, partial, sycl::plus<float>());
        if (lane == 0) out[batch_offset(b.grad_sinks, p.batch, fb)] -= total;
    }
}
