// Products of f16 and f32 data on bf16 tiles, by splitting each value into
// bf16 parts.
//
// x = x0 + x1 (+ x2): x0 is the bf16 rounding of x, x1 that of the rest and
// x2 that of what is left.  Two parts hold an f16 value (11 significant bits)
// exactly; three hold an f32 value to within 2^-26 of it.  A dot product
// sum_k a_k b_k becomes the sum of the part products a_i b_j with
// i + j < Parts; those left out, with the rounding of the last parts, come to
// at most 2^-18 (two parts) or 2^-25 (three) of |a_k b_k|.  Each kept product
// is exact in f32 and the tiles accumulate in f32, so three parts give a dot
// product within f32's own rounding of each product (2^-24).  (Tiles read
// subnormal bf16 as zero: the last parts of values below about 2^-110 are
// lost.)  Each operand keeps its parts in planes of their own; a tile product
// runs over every term.  Parts = 1 is the plain bf16 product.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.hpp"
#include "graphattn/sdpa.hpp"
#include "half_types.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <int Parts>
struct SplitTerms {
    static_assert(Parts >= 1 && Parts <= 3, "one to three bf16 parts");
    static constexpr int kTerms = Parts == 1 ? 1 : (Parts == 2 ? 3 : 6);
    // Term t multiplies A's part a_part(t) by B's part b_part(t), in an order
    // where each term shares its A or its B part with the one before (see
    // tiles_2x2_split_product): two parts a0 b1, a0 b0, a1 b0; three parts
    // a2 b0, a1 b0, a1 b1, a0 b1, a0 b2, a0 b0 (one part changes at a time,
    // so a step loads seven operand pairs, not eight).
    static constexpr int a_part(int t) {
        if (Parts == 1) return 0;
        if (Parts == 2) return t == 2 ? 1 : 0;
        return t == 0 ? 2 : (t < 3 ? 1 : 0);
    }
    static constexpr int b_part(int t) {
        if (Parts == 1) return 0;
        if (Parts == 2) return t == 0 ? 1 : 0;
        return t < 2 ? 0 : (t < 4 ? 1 : (t == 4 ? 2 : 0));
    }
};

// Adds A B to the 2 x 2 accumulator tiles (amx_tiles.hpp) over `steps`
// reduction steps of 32 bf16, summing every term of split operands (one term
// for Parts = 1).  A's rows are a_row_bytes apart and its 16-row bands a_band
// apart (in elements), its part p a_part_step elements after part 0; B (VNNI
// pairs) has rows b_row_bytes apart, 16 per step, its part p b_part_step
// words after part 0.  A part's tiles are loaded only where the term
// before used another part, so a step loads 2 + 2 * kTerms tiles at most
// instead of 4 * kTerms (three parts: 14 loads for 24 products).
template <int Parts>
inline void tiles_2x2_split_product(const uint16_t* a, int64_t a_row_bytes, int64_t a_band, int64_t a_part_step,
                                    const uint32_t* b, int64_t b_row_bytes, int64_t b_part_step, int steps) {
    using Terms = SplitTerms<Parts>;
    const int64_t b_row_words = b_row_bytes / 4;
    for (int step = 0; step < steps; ++step) {
        for (int t = 0; t < Terms::kTerms; ++t) {
            if (t == 0 || Terms::a_part(t) != Terms::a_part(t - 1)) {
                const uint16_t* a_tiles = a + Terms::a_part(t) * a_part_step + step * kTileBf16Cols;
                _tile_loadd(4, a_tiles, a_row_bytes);
                _tile_loadd(5, a_tiles + a_band, a_row_bytes);
            }
            if (t == 0 || Terms::b_part(t) != Terms::b_part(t - 1)) {
                const uint32_t* b_tiles = b + Terms::b_part(t) * b_part_step + step * kTileRows * b_row_words;
                _tile_loadd(6, b_tiles, b_row_bytes);
                _tile_loadd(7, b_tiles + 16, b_row_bytes);
            }
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

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

// The first `count` (0 < count < 32) of 32 values at p as load_32_as_f32
// gives them, the rest 0; masked loads, so nothing past them is read.
inline void load_32_as_f32(const void* p, DType dt, int count, __m512& lo, __m512& hi) {
    const __mmask16 lo_mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
    const __mmask16 hi_mask = count <= 16 ? __mmask16(0) : __mmask16((1u << (count - 16)) - 1);
    hi = _mm512_setzero_ps();
    if (dt == DType::f32) {
        const float* f = static_cast<const float*>(p);
        lo = _mm512_maskz_loadu_ps(lo_mask, f);
        if (hi_mask) hi = _mm512_maskz_loadu_ps(hi_mask, f + 16);
        return;
    }
    const uint16_t* h = static_cast<const uint16_t*>(p);
    const __m256i lo_words = _mm256_maskz_loadu_epi16(lo_mask, h);
    const __m256i hi_words = hi_mask ? _mm256_maskz_loadu_epi16(hi_mask, h + 16) : _mm256_setzero_si256();
    if (dt == DType::f16) {
        lo = _mm512_cvtph_ps(lo_words);
        hi = _mm512_cvtph_ps(hi_words);
    } else {
        lo = bf16x16_to_f32(lo_words);
        hi = bf16x16_to_f32(hi_words);
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
// Past the first `count` values (count < 32) the parts are 0, and nothing
// there is read; at count <= 0, all of them.
template <int Parts>
inline void load_split_32(const void* p, DType dt, __m512i parts[Parts], __mmask16& infinite, int count = 32) {
    if (count <= 0) {
        for (int part = 0; part < Parts; ++part) parts[part] = _mm512_setzero_si512();
        return;
    }
    __m512 lo, hi;
    if (count >= 32)
        load_32_as_f32(p, dt, lo, hi);
    else
        load_32_as_f32(p, dt, count, lo, hi);
    infinite |= _mm512_fpclass_ps_mask(lo, 0x18) | _mm512_fpclass_ps_mask(hi, 0x18);  // 0x18: +-inf
    split_32<Parts>(lo, hi, parts);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
