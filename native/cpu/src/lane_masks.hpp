// The score modifiers (graphattn/score_mods.hpp: softcap, then ALiBi), the
// explicit mask and the key window (graphattn/key_window.hpp), in that order,
// on score blocks in base-2 units,
// for both layouts of a score block:
//   query lanes: block[j][lanes], one lane per query row (forward, dQ pass);
//   key lanes:   block[r][lanes], one lane per key (dK/dV pass, and the
//                row-major score blocks of the AMX kernels).
// And the matching "zero where not kept" for gradient blocks: a score that a
// Select or the key window replaced by a fill value does not depend on Q K^T,
// so its gradient must not reach dQ or dK even when the fill is finite.
#pragma once

#include <algorithm>
#include <cstdint>

#include "block_io.hpp"
#include "graphattn/score_mods.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

inline bool fill_is_neg_inf(float fill) { return fill == -__builtin_inff(); }

// A call's softcap and ALiBi in base-2 units (score_mods.hpp's rules hold in any
// units, c and the slopes scaled as the scores).
struct ScoreMods {
    bool capped, alibi;
    Softcap softcap;    // c log2(e), on scores in base-2 units (simd.hpp)
    int64_t row_shift;  // ALiBi's i' = i + row_shift
    explicit ScoreMods(const SdpaForwardArgs& a)
        : capped(a.softcap > 0.0f),
          alibi(a.alibi.slopes.data != nullptr),
          softcap(capped ? Softcap(a.softcap * kLog2e) : Softcap()),
          row_shift(a.alibi.row_shift(a.seq_q, a.seq_kv)) {}
};

// Whether scores need a pass of their own between the product and the
// softmax: an explicit mask or ALiBi (the key window alone is cut by block
// bounds).  A softcap alone needs none in the forwards, whose fast paths take
// it (TileSoftmax, the AMX softmax_rows); the backward's tiles do not.
inline bool needs_score_pass(const SdpaForwardArgs& a) {
    return a.mask_kind != MaskKind::none || a.alibi.slopes.data != nullptr;
}

// A per-batch-index f32 operand (the ALiBi slopes, the sinks) of batch index b; 0 where the call has none.
inline float per_index(const TensorView& t, const int64_t b[kBatchDims]) {
    return t.data ? static_cast<const float*>(t.data)[view_batch_offset(t, b)] : 0.0f;
}

// Batch index b's ALiBi slope and sink logit in base-2 units (score_mods.hpp: the slope saturated, the sink
// overflowing to +inf, which fold_sink takes).
inline float slope_log2(const SdpaForwardArgs& a, const int64_t b[kBatchDims]) {
    return alibi_slope_log2(per_index(a.alibi.slopes, b), kLog2e);
}
inline float sink_log2(const SdpaForwardArgs& a, const int64_t b[kBatchDims]) { return per_index(a.sinks, b) * kLog2e; }

// c tanh(s / c); with grad set, also 1 - tanh^2, the softcap's derivative (the backward's dS factor).
inline VecF softcapped(VecF s, const ScoreMods& m, VecF* grad = nullptr) {
    const VecF capped = m.softcap(s);
    if (grad) {
        *grad = softcap_derivative(s, capped * m.softcap.inv_cap, m.softcap.cap);
    }
    return capped;
}

// What mask_key_lanes takes of the modifiers for rows of one batch index.
struct KeyLaneMods {
    float slope = 0.0f;         // the ALiBi slope in base-2 units
    float* cap_grad = nullptr;  // a softcap's 1 - tanh^2 per score, laid out as the scores (backward)
};

// Key blocks that no row of a work item sees are skipped only where hidden
// keys score -inf; any other fill still takes part in the softmax.
inline bool skips_hidden_blocks(const SdpaForwardArgs& a) { return a.window.skips_blocks(); }

// Whether later query rows see more keys (a causal window with no left
// limit and skipped blocks): work is then uneven and goes longest first.
// Under a sliding window rows carry equal work and are scheduled as without one.
inline bool later_rows_see_more(const SdpaForwardArgs& a) {
    return skips_hidden_blocks(a) && a.window.limits_right() && !a.window.limits_left();
}

// The keys some query row sees: [first_visible_key_of, visible_keys_of)
// where hidden blocks are skipped, else all of them.
inline int64_t visible_keys_of(const SdpaForwardArgs& a) {
    return skips_hidden_blocks(a) ? a.window.key_end(a.seq_q - 1, a.seq_kv) : a.seq_kv;
}
inline int64_t first_visible_key_of(const SdpaForwardArgs& a) {
    return skips_hidden_blocks(a) ? a.window.key_begin(0, a.seq_kv) : 0;
}

// Does zeroing unkept positions change anything?  Not when every fill is -inf
// (their probabilities, hence their gradients, are 0 already).
inline bool needs_unkept_zeroing(const SdpaForwardArgs& a) {
    return (a.mask_kind == MaskKind::select && !fill_is_neg_inf(a.select_fill)) ||
           (a.window.limited() && !fill_is_neg_inf(a.window.fill));
}

// Lanes l of keys j0 + l that row i sees: [first, end) clamped to [0, lanes].
struct VisibleLanes {
    float first, end;
    VisibleLanes(const KeyWindow& w, int64_t i, int64_t j0, int lanes)
        : first(float(KeyWindow::clamp(i + w.lowest_diagonal() - j0, 0, lanes))),
          end(float(KeyWindow::clamp(i + w.highest_diagonal() + 1 - j0, 0, lanes))) {}
};

// Query lanes.  mask_t[j][lanes] receives the explicit mask (rows < rows);
// lane r reads its mask row at element m_off[r] and has query index qi[r] and
// ALiBi slope slopes[r] (base 2; read only with ALiBi).
template <int RV>
void mask_query_lanes(const SdpaForwardArgs& a, float* s_t, float* mask_t, const int64_t* m_off,
                      const float* query_index, const float* slopes, int rows, int kv_rows, int64_t j0) {
    constexpr int kRow = RV * kLanes;
    const ScoreMods mods(a);
    if (mods.capped)
        for (int x = 0; x < kv_rows * kRow; x += kLanes) store(s_t + x, softcapped(load(s_t + x), mods));
    if (mods.alibi)
        for (int j = 0; j < kv_rows; ++j)
            for (int v = 0; v < RV; ++v) {
                float* s = s_t + j * kRow + v * kLanes;
                const VecF d = load(query_index + v * kLanes) + float(mods.row_shift - (j0 + j));
                store(s, load(s) - load(slopes + v * kLanes) * (d < 0.0f ? -d : d));
            }
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
    if (a.window.limited()) {
        // Lane with query index i sees key j iff lowest <= j - i <= highest (KeyWindow).
        const VecF fill = splat(to_log2_units(a.window.fill));
        const float lowest = float(KeyWindow::clamp(a.window.lowest_diagonal(), -kNoKeyLimit, kNoKeyLimit));
        const float highest = float(KeyWindow::clamp(a.window.highest_diagonal(), -kNoKeyLimit, kNoKeyLimit));
        for (int j = 0; j < kv_rows; ++j) {
            // Visible lanes: j0 + j - highest <= i <= j0 + j - lowest.
            const VecF first_row = splat(float(j0 + j) - highest), last_row = splat(float(j0 + j) - lowest);
            for (int v = 0; v < RV; ++v) {
                float* s = s_t + j * kRow + v * kLanes;
                const VecF i = load(query_index + v * kLanes);
                store(s, (i < first_row) | (i > last_row) ? fill : load(s));
            }
        }
    }
}

// The rule on the key lanes of one query row i, keys j0 + lane: the
// modifiers, the mask, the window; lanes past kv_rows -inf.  Built once per
// row and block, applied one vector at a time (mask_key_lanes, and the row
// layout's softmax step, which keeps the scores in registers).
struct KeyLaneRule {
    const SdpaForwardArgs& a;
    ScoreMods mods;
    VecF keep, select_fill, window_fill, first, end, valid, distance, slope;

    KeyLaneRule(const SdpaForwardArgs& args, const ScoreMods& m, int64_t i, int64_t j0, int lanes, int kv_rows,
                float slope_log2)
        : a(args),
          mods(m),
          keep(splat(args.select_keep_value ? 1.0f : 0.0f)),
          select_fill(splat(to_log2_units(args.select_fill))),
          window_fill(splat(to_log2_units(args.window.fill))),
          valid(splat(float(kv_rows))),
          distance(splat(float(i + m.row_shift - j0))),  // i' - j0: ALiBi's distance is |that - lane|
          slope(splat(slope_log2)) {
        const VisibleLanes seen(args.window, i, j0, lanes);
        first = splat(seen.first);
        end = splat(seen.end);
    }

    // Vector v's scores x (scaled), its mask values where there is a mask; cap_grad (or null) receives the
    // softcap's derivative.
    __attribute__((always_inline)) VecF apply(VecF x, int v, const float* mask, float* cap_grad) const {
        const VecF l = lane_index() + float(v * kLanes);
        if (mods.capped) {
            VecF grad;
            x = softcapped(x, mods, cap_grad ? &grad : nullptr);
            if (cap_grad) store(cap_grad, grad);
        }
        if (mods.alibi) {
            const VecF d = distance - l;
            x -= slope * (d < 0.0f ? -d : d);
        }
        if (a.mask_kind == MaskKind::additive) x += to_log2_units(load(mask));
        if (a.mask_kind == MaskKind::select) x = load(mask) == keep ? x : select_fill;
        if (a.window.limited()) x = (l >= first) & (l < end) ? x : window_fill;
        return l < valid ? x : splat(-__builtin_inff());
    }
};

// Key lanes.  s[r][lanes] for keys j0 + lane, first multiplied by
// score_scale; row r reads its mask at m_off[r] and has query index qi[r];
// every row has the modifiers `row_mods` (one batch index).  Lanes past
// kv_rows become -inf.  Only the first `vecs` vectors of each row are touched
// (rows stay RV vectors apart).
template <int RV>
void mask_key_lanes(const SdpaForwardArgs& a, float* s, float* mask_rows, const int64_t* m_off, const int64_t* qi,
                    int rows, int kv_rows, int64_t j0, const KeyLaneMods& row_mods, int vecs = RV,
                    float score_scale = 1.0f) {
    constexpr int kRow = RV * kLanes;
    const ScoreMods mods(a);
    const TensorView& m = a.mask;
    for (int r = 0; r < rows; ++r) {
        float* row = s + r * kRow;
        float* mask_row = mask_rows + r * kRow;
        if (a.mask_kind != MaskKind::none)
            load_block(element_ptr(m.data, m.dtype, m_off[r] + j0 * m.strides[4]), m.dtype, 0, m.strides[4], 1, kv_rows,
                       mask_row, kRow, 1);
        const KeyLaneRule rule(a, mods, qi[r], j0, kRow, kv_rows, row_mods.slope);
        for (int v = 0; v < vecs; ++v)
            store(row + v * kLanes, rule.apply(load(row + v * kLanes) * score_scale, v, mask_row + v * kLanes,
                                               row_mods.cap_grad ? row_mods.cap_grad + r * kRow + v * kLanes : nullptr));
    }
}

// Key lanes: g[r][lanes] = 0 where a Select or the key window replaced the score.
template <int RV>
void zero_unkept_key_lanes(const SdpaForwardArgs& a, float* g, const float* mask_rows, const int64_t* qi, int rows,
                           int64_t j0) {
    constexpr int kRow = RV * kLanes;
    const VecF lanes = lane_index(), keep = splat(a.select_keep_value ? 1.0f : 0.0f);
    for (int r = 0; r < rows; ++r) {
        const VisibleLanes seen(a.window, qi[r], j0, kRow);
        for (int v = 0; v < RV; ++v) {
            float* p = g + r * kRow + v * kLanes;
            VecF x = load(p);
            if (a.mask_kind == MaskKind::select) x = load(mask_rows + r * kRow + v * kLanes) == keep ? x : VecF{};
            if (a.window.limited()) {
                const VecF l = lanes + float(v * kLanes);
                x = (l >= seen.first) & (l < seen.end) ? x : VecF{};
            }
            store(p, x);
        }
    }
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
