// The explicit and implicit causal masks on score blocks in base-2 units,
// for both layouts of a score block:
//   query lanes: block[j][lanes], one lane per query row (forward, dQ pass);
//   key lanes:   block[r][lanes], one lane per key (dK/dV pass, and the
//                row-major score blocks of the AMX kernels).
// And the matching "zero where not kept" for gradient blocks: a score that a
// Select or the causal mask replaced by a fill value does not depend on Q K^T,
// so its gradient must not reach dQ or dK even when the fill is finite.
#pragma once

#include <algorithm>
#include <cstdint>

#include "block_io.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// First key that the causal mask drops for query row i (keys j with
// j - i > offset are masked), clamped to [0, seq_kv]: the end of the keys a
// block of rows ending at row i has to visit.
inline int64_t causal_key_end(int64_t i, int64_t offset, int64_t seq_kv) {
    const int64_t end = i + offset + 1;
    return end < 0 ? 0 : (end > seq_kv ? seq_kv : end);
}

inline bool fill_is_neg_inf(float fill) { return fill == -__builtin_inff(); }

// Causal key blocks can be skipped only when masked scores are -inf; any
// other fill value still takes part in the softmax.
inline bool skips_causal_blocks(const SdpaForwardArgs& a) { return a.causal && fill_is_neg_inf(a.causal_fill); }

// The keys some query row sees: those before the last row's causal cut where
// causal blocks are skipped, else all of them.
inline int64_t visible_keys_of(const SdpaForwardArgs& a) {
    return skips_causal_blocks(a) ? causal_key_end(a.seq_q - 1, a.causal_offset, a.seq_kv) : a.seq_kv;
}

// Does zeroing unkept positions change anything?  Not when every fill is -inf
// (their probabilities, hence their gradients, are 0 already).
inline bool needs_unkept_zeroing(const SdpaForwardArgs& a) {
    return (a.mask_kind == MaskKind::select && !fill_is_neg_inf(a.select_fill)) ||
           (a.causal && !fill_is_neg_inf(a.causal_fill));
}

// Query lanes.  mask_t[j][lanes] receives the explicit mask (rows < rows);
// lane r reads its mask row at element m_off[r] and has query index qi[r].
template <int RV>
void mask_query_lanes(const SdpaForwardArgs& a, float* s_t, float* mask_t, const int64_t* m_off,
                      const float* query_index, int rows, int kv_rows, int64_t j0) {
    constexpr int kRow = RV * kLanes;
    if (a.mask_kind != MaskKind::none) {
        const TensorView& m = a.mask;
        for (int r = 0; r < rows; ++r)
            load_block(element_ptr(m.data, m.dtype, m_off[r] + j0 * m.strides[4]), m.dtype, 0, m.strides[4], 1, kv_rows,
                       mask_t + r, 1, kRow);
    }
    if (a.mask_kind == MaskKind::additive) {
        for (int j = 0; j < kv_rows; ++j)
            for (int v = 0; v < RV; ++v) {
                float* s = s_t + j * kRow + v * kLanes;
                store(s, load(s) + to_log2_units(load(mask_t + j * kRow + v * kLanes)));
            }
    } else if (a.mask_kind == MaskKind::select) {
        const VecF keep = splat(a.select_keep_value ? 1.0f : 0.0f), fill = splat(to_log2_units(a.select_fill));
        for (int j = 0; j < kv_rows; ++j)
            for (int v = 0; v < RV; ++v) {
                float* s = s_t + j * kRow + v * kLanes;
                store(s, load(mask_t + j * kRow + v * kLanes) == keep ? load(s) : fill);
            }
    }
    if (a.causal) {
        // Lane with query index i keeps key j iff j - i <= offset.
        const VecF fill = splat(to_log2_units(a.causal_fill));
        for (int j = 0; j < kv_rows; ++j) {
            const VecF first_masked_query = splat(float(j0 + j - a.causal_offset));
            for (int v = 0; v < RV; ++v) {
                float* s = s_t + j * kRow + v * kLanes;
                store(s, load(query_index + v * kLanes) < first_masked_query ? fill : load(s));
            }
        }
    }
}

// Key lanes.  s[r][lanes] for keys j0 + lane, first multiplied by
// score_scale; row r reads its mask at m_off[r] and has query index qi[r].
// Lanes past kv_rows become -inf.  Only the first `vecs` vectors of each row
// are touched (rows stay RV vectors apart).
template <int RV>
void mask_key_lanes(const SdpaForwardArgs& a, float* s, float* mask_rows, const int64_t* m_off, const int64_t* qi,
                    int rows, int kv_rows, int64_t j0, int vecs = RV, float score_scale = 1.0f) {
    constexpr int kRow = RV * kLanes;
    const TensorView& m = a.mask;
    const VecF lanes = lane_index(), keep = splat(a.select_keep_value ? 1.0f : 0.0f);
    const VecF select_fill = splat(to_log2_units(a.select_fill)), causal_fill = splat(to_log2_units(a.causal_fill));
    const VecF neg_inf = splat(-__builtin_inff());
    for (int r = 0; r < rows; ++r) {
        float* row = s + r * kRow;
        float* mask_row = mask_rows + r * kRow;
        if (a.mask_kind != MaskKind::none)
            load_block(element_ptr(m.data, m.dtype, m_off[r] + j0 * m.strides[4]), m.dtype, 0, m.strides[4], 1, kv_rows,
                       mask_row, kRow, 1);
        // Keys j0 + l with l >= first_masked are cut by the causal mask.
        const float first_masked = a.causal ? float(std::clamp<int64_t>(qi[r] + a.causal_offset + 1 - j0, 0, kRow))
                                            : float(kRow);
        for (int v = 0; v < vecs; ++v) {
            const VecF l = lanes + float(v * kLanes);
            VecF x = load(row + v * kLanes) * score_scale;
            if (a.mask_kind == MaskKind::additive) x += to_log2_units(load(mask_row + v * kLanes));
            if (a.mask_kind == MaskKind::select) x = load(mask_row + v * kLanes) == keep ? x : select_fill;
            if (a.causal) x = l < first_masked ? x : causal_fill;
            store(row + v * kLanes, l < float(kv_rows) ? x : neg_inf);
        }
    }
}

// Key lanes: g[r][lanes] = 0 where a Select or the causal mask replaced the score.
template <int RV>
void zero_unkept_key_lanes(const SdpaForwardArgs& a, float* g, const float* mask_rows, const int64_t* qi, int rows,
                           int64_t j0) {
    constexpr int kRow = RV * kLanes;
    const VecF lanes = lane_index(), keep = splat(a.select_keep_value ? 1.0f : 0.0f);
    for (int r = 0; r < rows; ++r) {
        const float first_masked = a.causal ? float(std::clamp<int64_t>(qi[r] + a.causal_offset + 1 - j0, 0, kRow))
                                            : float(kRow);
        for (int v = 0; v < RV; ++v) {
            float* p = g + r * kRow + v * kLanes;
            VecF x = load(p);
            if (a.mask_kind == MaskKind::select) x = load(mask_rows + r * kRow + v * kLanes) == keep ? x : VecF{};
            if (a.causal) x = lanes + float(v * kLanes) < first_masked ? x : VecF{};
            store(p, x);
        }
    }
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
