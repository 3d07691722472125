// FlashAttention-2 forward with query rows as vector lanes.
//
// Each work item (one batch index, one block of kBlockQ query rows) keeps
// Q^T, the score block S^T and the output accumulator O^T in the transposed
// layout of lane_gemm.hpp, so the online softmax (max, exp, sum, rescale)
// runs on whole vectors of rows with no horizontal reductions.  Scores are
// kept in base-2 units (log2(e) folded into the scale), so each probability
// costs one exp2.  K and V rows
// are read in place when they are f32 with unit column stride; other dtypes
// or strides are converted block by block into f32 scratch.  The scale is
// folded into Q^T once per work item.
//
// Work is split over batch x query blocks with OpenMP (dynamic schedule,
// longest causal items first); memory is O(block * head_dim) per thread.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "block_io.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "lane_gemm.hpp"
#include "mask.hpp"
#include "scratch.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// RV vectors of query rows per work item; NT broadcast operands per tile.
template <int RV, int NT>
struct LaneForward {
    static constexpr int kBlockQ = RV * kLanes;
    static constexpr int kBlockKV = 192;

    // Scratch of one thread, allocated once per parallel region.
    struct Scratch {
        AlignedFloats q_t, k_rows, v_rows, s_t, mask_t, o_t, row_max, row_sum, out_row;
        Scratch(int D, int Dv)
            : q_t(size_t(D) * kBlockQ),
              k_rows(size_t(kBlockKV) * D),
              v_rows(size_t(kBlockKV) * Dv),
              s_t(size_t(kBlockKV) * kBlockQ),
              mask_t(size_t(kBlockKV) * kBlockQ),
              o_t(size_t(Dv) * kBlockQ),
              row_max(kBlockQ),
              row_sum(kBlockQ),
              out_row(size_t(Dv)) {}
    };

    // Rows of a K or V block as f32 with unit column stride: in place when
    // the tensor already is, else converted into `scratch`.
    static const float* block_rows(const TensorView& t, int64_t base, int64_t j0, int rows, int cols, float* scratch,
                                   int64_t& row_stride) {
        if (t.dtype == DType::f32 && t.strides[4] == 1) {
            row_stride = t.strides[3];
            return static_cast<const float*>(t.data) + base + j0 * t.strides[3];
        }
        load_block(element_ptr(t.data, t.dtype, base + j0 * t.strides[3]), t.dtype, t.strides[3], t.strides[4], rows,
                   cols, scratch, cols, 1);
        row_stride = cols;
        return scratch;
    }

    // Explicit and causal masks applied, in base-2 units, to S^T[j][lanes]
    // for keys j0 .. j0 + kv_rows and query rows i0 .. i0 + kBlockQ.
    static void mask_scores(const SdpaForwardArgs& a, float* s_t, const float* mask_t, int kv_rows, int64_t i0,
                            int64_t j0) {
        if (a.mask_kind == MaskKind::additive) {
            for (int j = 0; j < kv_rows; ++j)
                for (int v = 0; v < RV; ++v) {
                    float* s = s_t + j * kBlockQ + v * kLanes;
                    store(s, load(s) + to_log2_units(load(mask_t + j * kBlockQ + v * kLanes)));
                }
        } else if (a.mask_kind == MaskKind::select) {
            const VecF keep = splat(a.select_keep_value ? 1.0f : 0.0f), fill = splat(to_log2_units(a.select_fill));
            for (int j = 0; j < kv_rows; ++j)
                for (int v = 0; v < RV; ++v) {
                    float* s = s_t + j * kBlockQ + v * kLanes;
                    store(s, load(mask_t + j * kBlockQ + v * kLanes) == keep ? load(s) : fill);
                }
        }
        if (a.causal) {
            // Row i keeps key j iff j - i <= offset, so key j masks rows r < j - offset - i0.
            const VecF fill = splat(to_log2_units(a.causal_fill)), lanes = lane_index();
            for (int j = 0; j < kv_rows; ++j) {
                const int64_t first_kept = j0 + j - a.causal_offset - i0;
                if (first_kept <= 0) continue;
                const VecF limit = splat(float(std::min<int64_t>(first_kept, kBlockQ)));
                for (int v = 0; v < RV; ++v) {
                    float* s = s_t + j * kBlockQ + v * kLanes;
                    store(s, lanes + float(v * kLanes) < limit ? fill : load(s));
                }
            }
        }
    }

    // Online softmax over one key block: S^T becomes P^T relative to the new
    // running max; O^T is rescaled where the max grew.
    static void online_softmax(float* s_t, int kv_rows, float* row_max, float* row_sum, float* o_t, int Dv) {
        const VecF neg_inf = splat(-__builtin_inff());
        VecF correction[RV];
        bool rescale = false;
        for (int v = 0; v < RV; ++v) {
            const VecF old_max = load(row_max + v * kLanes);
            VecF m = old_max;
            for (int j = 0; j < kv_rows; ++j) m = max_ignoring_nan(load(s_t + j * kBlockQ + v * kLanes), m);
            // A row with no finite score yet subtracts 0, so 2^-inf = 0 and no NaN appears.
            const VecF base = m == neg_inf ? VecF{} : m;
            VecF sum{};
            for (int j = 0; j < kv_rows; ++j) {
                float* s = s_t + j * kBlockQ + v * kLanes;
                const VecF p = vexp2(load(s) - base);
                store(s, p);
                sum += p;
            }
            correction[v] = vexp2(old_max - base);
            store(row_sum + v * kLanes, load(row_sum + v * kLanes) * correction[v] + sum);
            store(row_max + v * kLanes, m);
            for (int i = 0; i < kLanes; ++i) rescale |= correction[v][i] != 1.0f;
        }
        if (!rescale) return;
        for (int c = 0; c < Dv; ++c)
            for (int v = 0; v < RV; ++v) {
                float* o = o_t + c * kBlockQ + v * kLanes;
                store(o, load(o) * correction[v]);
            }
    }

    // O = O^T / row_sum, transposed back into the output rows; stats = logsumexp.
    static void write_rows(const SdpaForwardArgs& a, Scratch& sc, const int64_t b[kBatchDims], int64_t i0, int rows,
                           int Dv) {
        const TensorView& o = a.output;
        const TensorView& st = a.stats;
        const float fully_masked = a.inf_as_zero ? 0.0f : std::nanf("");
        for (int r = 0; r < rows; ++r) {
            const float sum = sc.row_sum.get()[r];
            // sum > 0: normal row; sum == 0: every score was masked; NaN: a NaN score.
            const float factor = sum > 0.0f ? 1.0f / sum : (sum == 0.0f ? fully_masked : std::nanf(""));
            float* out = sc.out_row.get();
            const float* o_col = sc.o_t.get() + r;
            for (int c = 0; c < Dv; ++c) out[c] = o_col[c * kBlockQ] * factor;
            const int64_t i = i0 + r;
            store_row(out, Dv, const_cast<char*>(element_ptr(o.data, o.dtype, view_batch_offset(o, b) + i * o.strides[3])),
                      o.dtype, o.strides[4]);
            if (st.data) {
                const float lse = sum > 0.0f ? sc.row_max.get()[r] * kLn2 + std::log(sum)
                                             : (sum == 0.0f && a.inf_as_zero ? -__builtin_inff() : std::nanf(""));
                float* stats = static_cast<float*>(const_cast<void*>(st.data));
                stats[view_batch_offset(st, b) + i * st.strides[3]] = lse;
            }
        }
    }

    static void run_item(const SdpaForwardArgs& a, Scratch& sc, const int64_t b[kBatchDims], int64_t i0, int rows,
                         bool skip_causal_blocks) {
        const int D = int(a.head_dim_qk), Dv = int(a.head_dim_v);
        const int64_t Skv = a.seq_kv;
        const TensorView &q = a.query, &k = a.key, &v = a.value, &m = a.mask;

        // Q^T with the scale and log2(e) folded in; lanes past the last row stay 0.
        float* q_t = sc.q_t.get();
        load_block(element_ptr(q.data, q.dtype, view_batch_offset(q, b) + i0 * q.strides[3]), q.dtype, q.strides[3],
                   q.strides[4], rows, D, q_t, 1, kBlockQ);
        if (rows < kBlockQ)
            for (int d = 0; d < D; ++d) std::fill(q_t + d * kBlockQ + rows, q_t + (d + 1) * kBlockQ, 0.0f);
        const float scale = a.has_scale ? (a.scale_is_divisor ? 1.0f / a.scale : a.scale) : 1.0f;
        for (int x = 0; x < D * kBlockQ; x += kLanes) store(q_t + x, load(q_t + x) * (scale * kLog2e));
        std::fill(sc.o_t.get(), sc.o_t.get() + size_t(Dv) * kBlockQ, 0.0f);
        std::fill(sc.row_max.get(), sc.row_max.get() + kBlockQ, -__builtin_inff());
        std::fill(sc.row_sum.get(), sc.row_sum.get() + kBlockQ, 0.0f);

        const int64_t kv_end = skip_causal_blocks ? causal_key_end(i0 + rows - 1, a.causal_offset, Skv) : Skv;
        const int64_t k_base = view_batch_offset(k, b), v_base = view_batch_offset(v, b);
        for (int64_t j0 = 0; j0 < kv_end; j0 += kBlockKV) {
            const int kv_rows = int(std::min<int64_t>(kBlockKV, kv_end - j0));
            int64_t k_stride, v_stride;
            const float* k_rows = block_rows(k, k_base, j0, kv_rows, D, sc.k_rows.get(), k_stride);
            const float* v_rows = block_rows(v, v_base, j0, kv_rows, Dv, sc.v_rows.get(), v_stride);

            lane_gemm<RV, NT, false>(q_t, D, k_rows, k_stride, 1, kv_rows, sc.s_t.get());
            if (a.mask_kind != MaskKind::none)
                load_block(element_ptr(m.data, m.dtype, view_batch_offset(m, b) + i0 * m.strides[3] + j0 * m.strides[4]),
                           m.dtype, m.strides[3], m.strides[4], rows, kv_rows, sc.mask_t.get(), 1, kBlockQ);
            mask_scores(a, sc.s_t.get(), sc.mask_t.get(), kv_rows, i0, j0);
            online_softmax(sc.s_t.get(), kv_rows, sc.row_max.get(), sc.row_sum.get(), sc.o_t.get(), Dv);
            lane_gemm<RV, NT, true>(sc.s_t.get(), kv_rows, v_rows, 1, v_stride, Dv, sc.o_t.get());
        }
        write_rows(a, sc, b, i0, rows, Dv);
    }

    static Status run(const SdpaForwardArgs& a) {
        const int D = int(a.head_dim_qk), Dv = int(a.head_dim_v);
        const int64_t q_blocks = (a.seq_q + kBlockQ - 1) / kBlockQ;
        const int64_t work_items = a.batch[0] * a.batch[1] * a.batch[2] * q_blocks;
        // Causal key blocks can only be skipped when masked scores are -inf;
        // any other fill value still takes part in the softmax.
        const bool skip_causal_blocks = a.causal && std::isinf(a.causal_fill) && a.causal_fill < 0;

#pragma omp parallel
        {
            Scratch scratch(D, Dv);
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < work_items; ++w) {
                int64_t rest = w;
                int64_t qb = rest % q_blocks;
                if (skip_causal_blocks) qb = q_blocks - 1 - qb;  // the longest items first
                rest /= q_blocks;
                int64_t b[kBatchDims];
                b[2] = rest % a.batch[2];
                rest /= a.batch[2];
                b[1] = rest % a.batch[1];
                b[0] = rest / a.batch[1];
                const int64_t i0 = qb * kBlockQ;
                run_item(a, scratch, b, i0, int(std::min<int64_t>(kBlockQ, a.seq_q - i0)), skip_causal_blocks);
            }
        }
        return Status::success();
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
