// FlashAttention-2 forward with query rows as matrix rows, for short query
// sequences (decode) where the lane layout of sdpa_forward_lanes.hpp would
// leave most vector lanes idle.
//
// Work is split over batch x query blocks with OpenMP, so even one head fills
// every core.  Each work item streams over key blocks keeping a running max
// and sum per query row (online softmax), so memory is O(block * head_dim)
// per thread whatever the sequence length.  Key blocks that the implicit
// causal mask removes entirely are never visited.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "block_io.hpp"
#include "fast_exp.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "mask.hpp"
#include "scratch.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

inline int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }

// Online softmax update of one query row with a block of masked scores:
// scores become probabilities (relative to the new running max), and the
// accumulator row is rescaled when the max grows.
inline void online_softmax_row(float* __restrict row, int width, float& running_max, float& running_sum,
                               float* __restrict acc_row, int dv_pad) {
    float block_max = kNegInf;
    for (int j = 0; j < width; ++j) block_max = row[j] > block_max ? row[j] : block_max;
    const float new_max = block_max > running_max ? block_max : running_max;
    if (new_max == kNegInf) {  // every score so far is -inf or NaN
        bool has_nan = false;
        for (int j = 0; j < width; ++j) has_nan |= row[j] != row[j];
        if (has_nan) running_sum = __builtin_nanf("");  // a NaN row must stay NaN, never turn into 0
        for (int j = 0; j < width; ++j) row[j] = 0.0f;
        return;
    }
    float sum = 0.0f;
    for (int j = 0; j < width; ++j) {
        const float p = fast_exp(row[j] - new_max);
        row[j] = p;
        sum += p;
    }
    if (new_max != running_max) {
        const float correction = fast_exp(running_max - new_max);
        for (int c = 0; c < dv_pad; ++c) acc_row[c] *= correction;
        running_sum *= correction;
    }
    running_sum += sum;
    running_max = new_max;
}

template <class MK>
Status sdpa_forward_rows(const SdpaForwardArgs& a) {
    constexpr int BQ = MK::kBlockQ;
    constexpr int BK = MK::kBlockKV;
    const int D = int(a.head_dim_qk);
    const int Dv = int(a.head_dim_v);
    const int dv_pad = round_up(Dv, MK::kColumnChunk);
    const int64_t Sq = a.seq_q, Skv = a.seq_kv;
    const int64_t q_blocks = (Sq + BQ - 1) / BQ;
    const int64_t work_items = a.batch[0] * a.batch[1] * a.batch[2] * q_blocks;
    // Causal key blocks can only be skipped when masked scores are -inf;
    // any other fill value still takes part in the softmax.
    const bool skip_causal_blocks = a.causal && std::isinf(a.causal_fill) && a.causal_fill < 0;

#pragma omp parallel
    {
        AlignedFloats q_buf(size_t(BQ) * D);
        AlignedFloats kt_buf(size_t(D) * BK);
        AlignedFloats v_buf(size_t(BK) * dv_pad);
        AlignedFloats s_buf(size_t(BQ) * BK);
        AlignedFloats mask_buf(size_t(BQ) * BK);
        AlignedFloats acc_buf(size_t(BQ) * dv_pad);
        AlignedFloats out_row{size_t(dv_pad)};
        float row_max[BQ];
        float row_sum[BQ];

#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work_items; ++w) {
            int64_t rest = w;
            const int64_t qb = rest % q_blocks;
            rest /= q_blocks;
            int64_t b[kBatchDims];
            b[2] = rest % a.batch[2];
            rest /= a.batch[2];
            b[1] = rest % a.batch[1];
            b[0] = rest / a.batch[1];

            const int64_t i0 = qb * BQ;
            const int rows = int(std::min<int64_t>(BQ, Sq - i0));
            const int rows_padded = round_up(rows, MK::kRowGroup);

            const TensorView& q = a.query;
            load_block(element_ptr(q.data, q.dtype, view_batch_offset(q, b) + i0 * q.strides[3]), q.dtype, q.strides[3],
                       q.strides[4], rows, D, q_buf.get(), D, 1);
            std::fill(q_buf.get() + size_t(rows) * D, q_buf.get() + size_t(rows_padded) * D, 0.0f);
            std::fill(acc_buf.get(), acc_buf.get() + size_t(rows_padded) * dv_pad, 0.0f);
            std::fill(row_max, row_max + BQ, kNegInf);
            std::fill(row_sum, row_sum + BQ, 0.0f);

            int64_t kv_end = Skv;
            if (skip_causal_blocks) kv_end = causal_key_end(i0 + rows - 1, a.causal_offset, Skv);

            const TensorView& k = a.key;
            const TensorView& v = a.value;
            const TensorView& m = a.mask;
            const int64_t k_base = view_batch_offset(k, b), v_base = view_batch_offset(v, b);
            for (int64_t j0 = 0; j0 < kv_end; j0 += BK) {
                const int kv_rows = int(std::min<int64_t>(BK, Skv - j0));
                // K^T block: kt[d][j] = K[j0 + j][d]; columns past kv_rows stay 0.
                load_block(element_ptr(k.data, k.dtype, k_base + j0 * k.strides[3]), k.dtype, k.strides[3],
                           k.strides[4], kv_rows, D, kt_buf.get(), 1, BK);
                if (kv_rows < BK)
                    for (int d = 0; d < D; ++d) std::fill(kt_buf.get() + d * BK + kv_rows, kt_buf.get() + (d + 1) * BK, 0.0f);
                load_block(element_ptr(v.data, v.dtype, v_base + j0 * v.strides[3]), v.dtype, v.strides[3],
                           v.strides[4], kv_rows, Dv, v_buf.get(), dv_pad, 1);

                MK::qk(q_buf.get(), rows_padded, D, kt_buf.get(), s_buf.get());

                if (a.mask_kind != MaskKind::none)
                    load_block(element_ptr(m.data, m.dtype, view_batch_offset(m, b) + i0 * m.strides[3] + j0 * m.strides[4]),
                               m.dtype, m.strides[3], m.strides[4], rows, kv_rows, mask_buf.get(), BK, 1);
                for (int r = 0; r < rows; ++r) {
                    float* row = s_buf.get() + size_t(r) * BK;
                    mask_score_row(a, row, BK, kv_rows, mask_buf.get() + size_t(r) * BK, i0 + r, j0);
                    online_softmax_row(row, BK, row_max[r], row_sum[r], acc_buf.get() + size_t(r) * dv_pad, dv_pad);
                }
                for (int r = rows; r < rows_padded; ++r) std::fill(s_buf.get() + size_t(r) * BK, s_buf.get() + size_t(r + 1) * BK, 0.0f);

                MK::pv(s_buf.get(), rows_padded, kv_rows, v_buf.get(), dv_pad, acc_buf.get());
            }

            // Normalise and store; a row whose every score was -inf has sum 0.
            const TensorView& o = a.output;
            const TensorView& st = a.stats;
            const int64_t o_base = view_batch_offset(o, b);
            for (int r = 0; r < rows; ++r) {
                const float sum = row_sum[r];
                const float* acc_row = acc_buf.get() + size_t(r) * dv_pad;
                float* out = out_row.get();
                float lse;
                if (sum > 0.0f) {
                    const float inv = 1.0f / sum;
                    for (int c = 0; c < Dv; ++c) out[c] = acc_row[c] * inv;
                    lse = row_max[r] + std::log(sum);
                } else if (sum == 0.0f) {
                    const float fill = a.inf_as_zero ? 0.0f : std::nanf("");
                    for (int c = 0; c < Dv; ++c) out[c] = fill;
                    lse = a.inf_as_zero ? kNegInf : std::nanf("");
                } else {  // NaN reached the sum: the whole row is NaN
                    for (int c = 0; c < Dv; ++c) out[c] = std::nanf("");
                    lse = std::nanf("");
                }
                const int64_t i = i0 + r;
                store_row(out, Dv, const_cast<char*>(element_ptr(o.data, o.dtype, o_base + i * o.strides[3])), o.dtype,
                          o.strides[4]);
                if (st.data) {
                    float* stats = static_cast<float*>(const_cast<void*>(st.data));
                    stats[view_batch_offset(st, b) + i * st.strides[3]] = lse;
                }
            }
        }
    }
    return Status::success();
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
