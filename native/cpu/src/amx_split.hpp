// Products of f16 data on bf16 tiles, by splitting each value into bf16
// parts.
//
// x = x0 + x1: x0 is the bf16 rounding of x and x1 that of the rest, so two
// parts hold an f16 value (11 significant bits) exactly.  A dot product
// sum_k a_k b_k becomes the sum of the part products a_i b_j with i + j < 2;
// the one left out, a1 b1, is at most 2^-18 of |a_k b_k|, and every kept
// product is exact in the tiles' f32 accumulation.  Laid side by side along
// the reduction dimension, A as [a_i(0) a_i(1) ...] and B as [b_j(0); b_j(1);
// ...], the terms are one tile product over a reduction `kTerms` times as long.
// Parts = 1 is the plain bf16 product.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "graphattn/sdpa.hpp"
#include "half_types.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <int Parts>
struct SplitTerms {
    static_assert(Parts == 1 || Parts == 2, "one or two bf16 parts");
    static constexpr int kTerms = Parts == 1 ? 1 : 3;
    // Term t multiplies A's part a_part(t) by B's part b_part(t): a0 b0, a0 b1, a1 b0.
    static constexpr int a_part(int t) { return t == 2 ? 1 : 0; }
    static constexpr int b_part(int t) { return t == 1 ? 1 : 0; }
};

// 32 consecutive values of dtype dt (f32, bf16 or f16) at p, as f32: the first 16 in lo.
inline void load_32_as_f32(const void* p, DType dt, __m512& lo, __m512& hi) {
    if (dt == DType::f32) {
        lo = _mm512_loadu_ps(p);
        hi = _mm512_loadu_ps(static_cast<const float*>(p) + 16);
        return;
    }
    const __m256i* h = static_cast<const __m256i*>(p);
    if (dt == DType::f16) {
        lo = _mm512_cvtph_ps(_mm256_loadu_si256(h));
        hi = _mm512_cvtph_ps(_mm256_loadu_si256(h + 1));
    } else {
        lo = bf16x16_to_f32(_mm256_loadu_si256(h));
        hi = bf16x16_to_f32(_mm256_loadu_si256(h + 1));
    }
}

// The bf16 parts of 32 finite values (NaN passes too), lo holding the first
// 16, each part as one row of 32.
template <int Parts>
inline void split_32(__m512 lo, __m512 hi, __m512i parts[Parts]) {
    for (int p = 0; p < Parts; ++p) {
        parts[p] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        if (p + 1 == Parts) break;
        const __m512 lo_part = bf16x16_to_f32(_mm512_castsi512_si256(parts[p]));
        const __m512 hi_part = bf16x16_to_f32(_mm512_extracti64x4_epi64(parts[p], 1));
        lo = _mm512_sub_ps(lo, lo_part);
        hi = _mm512_sub_ps(hi, hi_part);
    }
}

// The bf16 parts of the 32 values at p (dtype dt).  Split products cannot
// keep IEEE infinities (a part 0 * inf is NaN where the whole value times inf
// is not), so `infinite` gathers which lanes held one: a caller that sees any
// runs the call on a kernel without splits.
template <int Parts>
inline void load_split_32(const void* p, DType dt, __m512i parts[Parts], __mmask16& infinite) {
    __m512 lo, hi;
    load_32_as_f32(p, dt, lo, hi);
    infinite |= _mm512_fpclass_ps_mask(lo, 0x18) | _mm512_fpclass_ps_mask(hi, 0x18);  // 0x18: +-inf
    split_32<Parts>(lo, hi, parts);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
