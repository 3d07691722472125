// The online softmax step fused into the score product (lane layout, key
// blocks with no mask pass): each register tile of S^T becomes P^T before it
// is stored, so the block's max pass and its second read of S^T go away, and
// the out-of-order core overlaps a tile's exps with the next tile's products.
//
// A tile cannot wait for its block's max, so P is taken relative to the
// running max, which is raised only where a score exceeds it by more than
// kStaleRange: P stays below 2^kStaleRange (f32 keeps its relative precision
// at any scale), and the sum, the block's earlier P^T and O^T are rescaled
// only on such a raise (every row's first tile; later ones where the scores
// climb).  -inf, +inf and NaN scores follow online_softmax's rules: the max
// ignores NaN, a row with no finite score yet subtracts 0.  Capped: the
// softcap (graphattn/score_mods.hpp) is taken on each tile first, so that a
// softcap alone keeps this path.
#pragma once

#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// What the scores of lanes with running max m are taken relative to: m, or
// 0 where no score is finite yet (m = -inf), so that 2^-inf = 0 and no NaN
// appears.
inline VecF softmax_base(VecF m) { return m == splat(-__builtin_inff()) ? VecF{} : m; }

// O^T's Dv rows (RV vectors of lanes each) times each lane's factor: the
// running output where a row's max grew.
template <int RV>
void rescale_lane_rows(float* o_t, const VecF (&factor)[RV], int Dv) {
    for (int c = 0; c < Dv; ++c)
        for (int v = 0; v < RV; ++v) {
            float* o = o_t + (c * RV + v) * kLanes;
            store(o, load(o) * factor[v]);
        }
}

template <int RV, bool Capped = false>
struct TileSoftmax {
    static constexpr float kStaleRange = 8.0f;  // log2 units
    static constexpr int kRows = RV * kLanes;   // floats per row of P^T

    float* p_t;            // the block's P^T, [key][row]
    float* row_max;        // the statistics read at the start, written by finish
    float* row_sum;
    VecF max[RV];          // running max per lane
    VecF sum[RV];          // running sum, relative to max
    VecF correction[RV];   // factor for the O^T of earlier blocks
    bool raised = false;   // some lane's max moved in this block
    Softcap softcap;       // Capped: the softcap in base-2 units

    TileSoftmax(float* p_t_, float* row_max_, float* row_sum_, const Softcap& softcap_ = Softcap())
        : p_t(p_t_), row_max(row_max_), row_sum(row_sum_), softcap(softcap_) {
        for (int v = 0; v < RV; ++v) {
            max[v] = load(row_max + v * kLanes);
            sum[v] = load(row_sum + v * kLanes);
            correction[v] = splat(1.0f);
        }
    }

    // acc[t][v]: scores of key n + t, lanes of vector v.
    template <int NT>
    __attribute__((always_inline)) void tile(const VecF (&acc)[NT][RV], int n) {
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) {
            VecF s[NT];
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) s[t] = Capped ? softcap(acc[t][v]) : acc[t][v];
            VecF tile_max = max[v];
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) tile_max = max_ignoring_nan(s[t], tile_max);
            const VecF raise_above = max[v] + kStaleRange;
            if (__builtin_expect(any_greater(tile_max, raise_above), 0))
                raise(v, tile_max > raise_above ? tile_max : max[v], n);
            const VecF base = softmax_base(max[v]);
            VecF tile_sum{};
#pragma GCC unroll 16
            for (int t = 0; t < NT; ++t) {
                const VecF p = vexp2(s[t] - base);
                store(p_t + (n + t) * kRows + v * kLanes, p);
                tile_sum += p;
            }
            sum[v] += tile_sum;
        }
    }

    // New max for vector v: rescale its sum and the P^T of keys [0, n).
    __attribute__((noinline)) void raise(int v, VecF new_max, int n) {
        // An unmoved lane keeps factor 1 exactly (vexp2(0) is one ulp above 1).
        const VecF c = new_max != max[v] ? vexp2(max[v] - softmax_base(new_max)) : splat(1.0f);
        sum[v] *= c;
        correction[v] *= c;
        for (int j = 0; j < n; ++j) {
            float* p = p_t + j * kRows + v * kLanes;
            store(p, load(p) * c);
        }
        max[v] = new_max;
        raised = true;
    }

    // The block's statistics back to row_max / row_sum, and O^T (null: no
    // earlier block) rescaled where a max moved.
    void finish(float* o_t, int Dv) const {
        for (int v = 0; v < RV; ++v) {
            store(row_max + v * kLanes, max[v]);
            store(row_sum + v * kLanes, sum[v]);
        }
        if (raised && o_t) rescale_lane_rows<RV>(o_t, correction, Dv);
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
