// Turning a block of raw Q K^T products into masked, scaled scores: the
// scale, the explicit mask (additive or boolean select), the implicit causal
// mask, and -inf for the padding columns past the last key.
#pragma once

#include <cstdint>

#include "block_io.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

constexpr float kNegInf = -__builtin_inff();

// First key column that the causal mask drops for query row i (keys j with
// j - i > offset are masked), clamped to [0, seq_kv].
inline int64_t causal_key_end(int64_t i, int64_t offset, int64_t seq_kv) {
    const int64_t end = i + offset + 1;
    return end < 0 ? 0 : (end > seq_kv ? seq_kv : end);
}

// One row of `width` scores for query row i and keys [j0, j0 + kv_rows).
// mask_row holds the explicit mask values (or 0/1 flags) for those keys.
inline void mask_score_row(const SdpaForwardArgs& a, float* __restrict row, int width, int kv_rows,
                           const float* __restrict mask_row, int64_t i, int64_t j0) {
    if (a.has_scale) {
        const float s = a.scale;
        if (a.scale_is_divisor) {
            for (int j = 0; j < kv_rows; ++j) row[j] = row[j] / s;
        } else {
            for (int j = 0; j < kv_rows; ++j) row[j] = row[j] * s;
        }
    }
    if (a.mask_kind == MaskKind::additive) {
        for (int j = 0; j < kv_rows; ++j) row[j] += mask_row[j];
    } else if (a.mask_kind == MaskKind::select) {
        const float keep = a.select_keep_value ? 1.0f : 0.0f;
        const float fill = a.select_fill;
        for (int j = 0; j < kv_rows; ++j) row[j] = mask_row[j] == keep ? row[j] : fill;
    }
    if (a.causal) {
        const int64_t end = causal_key_end(i, a.causal_offset, j0 + kv_rows) - j0;
        for (int64_t j = end < 0 ? 0 : end; j < kv_rows; ++j) row[j] = a.causal_fill;
    }
    for (int j = kv_rows; j < width; ++j) row[j] = kNegInf;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
