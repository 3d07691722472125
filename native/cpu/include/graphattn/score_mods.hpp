// The score modifiers of attention, in one place: what happens to a score
// between the scale and the mask, and what a sink adds to the softmax.  Every
// CPU kernel and the SYCL device code take the rule from here, so the header
// holds plain arithmetic only (both compilers build it; exp2 and tanh come
// from the caller's math).
//
// For query row i and key j, in this order:
//     s  = scale * q_i . k_j
//     s  = c * tanh(s / c)              softcap c > 0 (Gemma 2)
//     s -= m * |i' - j|                 ALiBi slope m of the head (BLOOM, MPT);
//                                       i' = i, or i + Skv - Sq bottom-right
//     then the explicit mask, then the key window (key_window.hpp), then
//     p_ij = exp(s_ij) / (exp(sigma) + sum_k exp(s_ik))
//                                       sink logit sigma of the head (gpt-oss)
// so stats = log(exp(sigma) + sum_k exp(s_ik)) and P = exp(S - stats) still
// holds in the backward; a row that sees no key puts all its weight on the
// sink: output 0, stats sigma.  The rules hold in any units, so the kernels
// apply them to base-2 scores with c, m and sigma times log2(e).
#pragma once

#include <cstdint>

namespace graphattn {

// The largest magnitude whose base-2 units (times log2(e)) stay finite in
// float32: the bound of a finite scale and of a softcap, which the kernels
// hold in those units.
constexpr float kFloat32Max = 3.40282347e+38f;
constexpr float kBase2Max = 2.3586574e+38f;  // kFloat32Max / log2(e)

// The softcaps a call may have besides 0 (none): c and c * log2(e) float32
// normal numbers, so that neither c, 1 / c nor c * log2(e) rounds to 0 or
// overflows.
constexpr float kSoftcapMin = 1.17549435e-38f;  // float32's least normal number
constexpr float kSoftcapMax = kBase2Max;
inline bool softcap_in_range(float c) { return c == 0.0f || (c >= kSoftcapMin && c <= kSoftcapMax); }

// Beyond |s| = kTanhSaturates * c the softcap is +-c: tanh rounds to +-1 in
// float32 there, and the kernels' tanh clamps its argument to it.
constexpr float kTanhSaturates = 9.0f;

// The softcap's derivative 1 - tanh^2 at score s, t = tanh(s / c): 0 from
// the saturation on, where the clamped tanh is flat, so that scores far past
// the cap carry no gradient, as the limit gives (1 - t^2 would stay at t's
// rounding, about 1e-7, which a huge scale then multiplies).  NaN stays NaN.
// T: float, or a vector of floats whose comparisons select lanes.
template <class T>
inline T softcap_derivative(T s, T t, float cap) {
    const float edge = kTanhSaturates * cap;
    return s * s >= edge * edge ? t * 0.0f : 1.0f - t * t;
}

// |i' - j| for row i aligned by row_shift (0 top-left, Skv - Sq bottom-right).
inline float alibi_distance(int64_t i, int64_t j, int64_t row_shift) {
    const int64_t d = i + row_shift - j;
    return float(d < 0 ? -d : d);
}

// An ALiBi slope in base-2 units (log2e: log2(e)), saturated to the largest
// finite float: a slope whose product overflows must still leave the
// diagonal's score as it is (inf * 0 would be NaN), as the limit of ever
// larger slopes does.  NaN stays NaN.
inline float alibi_slope_log2(float slope, float log2e) {
    const float s = slope * log2e;
    return s > kFloat32Max ? kFloat32Max : (s < -kFloat32Max ? -kFloat32Max : s);
}

// A row's online-softmax totals (running max and sum of exp2(s - max), base 2)
// with the sink's exp2(sigma) added to the sum.  output_factor rescales the
// row's unnormalised output to the new max.  exp2 is the caller's function.
// A sink of +inf (or one whose base-2 value overflows) takes all the weight:
// output 0, stats +inf, as the limit does (inf - inf would be NaN).
struct SinkFold {
    float max, sum, output_factor;
};
template <class Exp2>
inline SinkFold fold_sink(float row_max, float row_sum, float sink, Exp2 exp2) {
    if (!(row_max == row_max) || !(row_sum == row_sum)) return {row_max, row_sum, 1.0f};  // NaN stays
    if (sink == __builtin_inff()) return {sink, 1.0f, 0.0f};
    const float m = row_max > sink ? row_max : sink;
    const float old = row_max == -__builtin_inff() ? 0.0f : exp2(row_max - m);
    return {m, row_sum * old + exp2(sink - m), old};
}

// The sink's share exp(sigma - stats) of a row's softmax (natural units;
// exp is the caller's function), which its gradient takes: 1 where both are
// +inf (a sink that took all the weight), NaN for a NaN row.
template <class T, class Exp>
inline T sink_weight(T sigma, T stats, Exp exp) {
    return sigma == stats ? T(1) : exp(sigma - stats);
}

}  // namespace graphattn
