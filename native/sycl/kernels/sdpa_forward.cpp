// SDPA forward, sub-group variant (any SYCL device): one sub-group per query
// row.  Lane l holds elements l, l + 16, ... of the row's Q and of its output
// accumulator; keys come in chunks of 16, lane c owning key j0 + c of the
// chunk for the online softmax (base 2, running max and sum per row).
#include "sdpa_device.hpp"

using namespace graphattn_sycl;

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_forward(ForwardParams p) {
    const auto [sg, lane, row, fb, i] = row_item(p.seq_q);
    if (row >= batch_count(p) * p.seq_q) return;  // uniform over the sub-group
    const int D = p.head_dim_qk, Dv = p.head_dim_v;

    const int64_t q_off = batch_offset(p.query, p.batch, fb) + i * p.query.strides[3];
    const int64_t k_base = batch_offset(p.key, p.batch, fb);
    const int64_t v_base = batch_offset(p.value, p.batch, fb);
    const int64_t m_off = p.mask_kind ? batch_offset(p.mask, p.batch, fb) + i * p.mask.strides[3] : 0;
    const uint64_t drop_base = p.dropout_first_element + uint64_t((fb * p.seq_q + i) * p.seq_kv);
    const float slope = graphattn::alibi_slope_log2(per_index(p.alibi_slopes, p.batch, fb), kLog2e);

    float q[GA_QK_CHUNKS], acc[GA_V_CHUNKS];
    const float q_scale = p.score_scale * kLog2e;
    load_row_chunks(p.query, q_off, D, lane, q_scale, q);
    for (int t = 0; t < GA_V_CHUNKS; ++t) acc[t] = 0.0f;
    float row_max = -kInf, row_sum = 0.0f;

    const int64_t end = key_end(p, i);
    for (int64_t j0 = key_begin(p, i); j0 < end; j0 += kSubGroup) {
        const int count = int(sycl::min<int64_t>(kSubGroup, end - j0));
        float score = -kInf;  // lane c: key j0 + c
        for (int c = 0; c < count; ++c) {
            float partial = 0.0f;
            for (int t = 0; t < GA_QK_CHUNKS; ++t) {
                const int d = lane + t * kSubGroup;
                if (d < D) partial += q[t] * kv_as_f32(p.key, k_base, j0 + c, d);
            }
            const float s = sycl::reduce_over_group(sg, partial, sycl::plus<float>());
            if (lane == c) score = s;
        }
        const int64_t j = j0 + lane;
        float cap_tanh;
        if (lane < count)
            score = masked_score_log2(p, modified_score_log2(p, score, slope, i, j, cap_tanh), mask_element(p, m_off, j),
                                      i, j);
        // NaN scores stay out of the max (they still poison the sum, as they should).
        const float chunk_max = sycl::reduce_over_group(sg, sycl::isnan(score) ? -kInf : score, sycl::maximum<float>());
        const float new_max = sycl::fmax(row_max, chunk_max);
        const float subtract = new_max == -kInf ? 0.0f : new_max;  // no -inf - -inf
        const float prob = sycl::exp2(score - subtract);
        const float rescale = sycl::exp2(row_max - subtract);
        row_sum = row_sum * rescale + sycl::reduce_over_group(sg, lane < count ? prob : 0.0f, sycl::plus<float>());
        row_max = new_max;
        const float dropped = lane < count ? prob * dropout_multiplier(p, drop_base + uint64_t(j)) : 0.0f;
        for (int t = 0; t < GA_V_CHUNKS; ++t) acc[t] *= rescale;
        for (int c = 0; c < count; ++c) {
            const float pc = sycl::select_from_group(sg, dropped, c);
            for (int t = 0; t < GA_V_CHUNKS; ++t) {
                const int d = lane + t * kSubGroup;
                if (d < Dv) acc[t] += pc * kv_as_f32(p.value, v_base, j0 + c, d);
            }
        }
    }

    const RowFinish finish = finish_row(p, fb, row_max, row_sum);
    const int64_t o_off = batch_offset(p.output, p.batch, fb) + i * p.output.strides[3];
    for (int t = 0; t < GA_V_CHUNKS; ++t) {
        const int d = lane + t * kSubGroup;
        if (d < Dv) store_f32_as(p.output, o_off + d * p.output.strides[4], acc[t] * finish.factor);
    }
    if (p.stats.data != nullptr && lane == 0) {
        float* stats = static_cast<float*>(const_cast<void*>(p.stats.data));
        stats[batch_offset(p.stats, p.batch, fb) + i * p.stats.strides[3]] = finish.lse;
    }
}
