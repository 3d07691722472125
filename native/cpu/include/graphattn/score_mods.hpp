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

// |i' - j| for row i aligned by row_shift (0 top-left, Skv - Sq bottom-right).
inline float alibi_distance(int64_t i, int64_t j, int64_t row_shift) {
    const int64_t d = i + row_shift - j;
    return float(d < 0 ? -d : d);
}

// A row's online-softmax totals (running max and sum of exp2(s - max), base 2)
// with the sink's exp2(sigma) added to the sum.  output_factor rescales the
// row's unnormalised output to the new max.  exp2 is the caller's function.
struct SinkFold {
    float max, sum, output_factor;
};
template <class Exp2>
inline SinkFold fold_sink(float row_max, float row_sum, float sink, Exp2 exp2) {
    if (!(row_max == row_max) || !(row_sum == row_sum)) return {row_max, row_sum, 1.0f};  // NaN stays
    const float m = row_max > sink ? row_max : sink;
    const float old = row_max == -__builtin_inff() ? 0.0f : exp2(row_max - m);
    return {m, row_sum * old + exp2(sink - m), old};
}

}  // namespace graphattn
