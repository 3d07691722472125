// The two block products of FlashAttention, written as fixed-size loops that
// the compiler register-blocks and vectorises for whichever ISA the
// translation unit targets.  ISA-specific micro-kernels (AMX, AVX-512 BF16)
// implement the same interface: the driver in sdpa_forward_impl.hpp is
// templated on it.
#pragma once

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

struct PortableMicroKernels {
    static constexpr int kBlockQ = 64;     // query rows per work item
    static constexpr int kBlockKV = 64;    // keys per inner step
    static constexpr int kRowGroup = 4;    // rows sharing each loaded K/V vector
    static constexpr int kColumnChunk = 16;

    // scores[r][j] = sum_d q[r][d] * kt[d][j] for r < rows (a multiple of
    // kRowGroup), j < kBlockKV.  q is rows x head_dim (leading dim head_dim),
    // kt is head_dim x kBlockKV, scores is rows x kBlockKV.
    static void qk(const float* __restrict q, int rows, int head_dim, const float* __restrict kt,
                   float* __restrict scores) {
        for (int r0 = 0; r0 < rows; r0 += kRowGroup) {
            float acc[kRowGroup][kBlockKV] = {};
            for (int d = 0; d < head_dim; ++d) {
                const float* krow = kt + d * kBlockKV;
                for (int rr = 0; rr < kRowGroup; ++rr) {
                    const float qv = q[(r0 + rr) * head_dim + d];
                    for (int j = 0; j < kBlockKV; ++j) acc[rr][j] += qv * krow[j];
                }
            }
            for (int rr = 0; rr < kRowGroup; ++rr)
                for (int j = 0; j < kBlockKV; ++j) scores[(r0 + rr) * kBlockKV + j] = acc[rr][j];
        }
    }

    // acc[r][c] += sum_{j < kv_rows} p[r][j] * v[j][c] for r < rows (a
    // multiple of kRowGroup), c < dv_pad (a multiple of kColumnChunk).
    // p is rows x kBlockKV; v and acc have leading dim dv_pad.
    static void pv(const float* __restrict p, int rows, int kv_rows, const float* __restrict v, int dv_pad,
                   float* __restrict acc) {
        for (int r0 = 0; r0 < rows; r0 += kRowGroup) {
            for (int c0 = 0; c0 < dv_pad; c0 += kColumnChunk) {
                float a[kRowGroup][kColumnChunk];
                for (int rr = 0; rr < kRowGroup; ++rr)
                    for (int c = 0; c < kColumnChunk; ++c) a[rr][c] = acc[(r0 + rr) * dv_pad + c0 + c];
                for (int j = 0; j < kv_rows; ++j) {
                    const float* vrow = v + j * dv_pad + c0;
                    for (int rr = 0; rr < kRowGroup; ++rr) {
                        const float pj = p[(r0 + rr) * kBlockKV + j];
                        for (int c = 0; c < kColumnChunk; ++c) a[rr][c] += pj * vrow[c];
                    }
                }
                for (int rr = 0; rr < kRowGroup; ++rr)
                    for (int c = 0; c < kColumnChunk; ++c) acc[(r0 + rr) * dv_pad + c0 + c] = a[rr][c];
            }
        }
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
