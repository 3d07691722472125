// The lane layout's two block products (lane_gemm.hpp) for bf16 Q, K and V
// on AVX512-BF16, where VDPBF16PS takes 32 bf16 values per instruction,
// multiplies them in pairs exactly and adds both products of a pair to one
// f32 lane: twice the products of an f32 FMA per instruction.
//
// Every operand comes as 32-bit words, each holding a pair of bf16 values
// along the summed dimension (low half first):
//
//   S^T[j][r]  = sum_p  K(j, pair p) . Q^T pairs[p][r]     (p: head-dim pairs)
//   O^T[c][r] += sum_p  V pairs[p][c] . P^T pairs[p][r]    (p: key pairs)
//
// K's pairs are its own rows read in place (or a padded copy); Q^T, P^T and
// V are packed into pairs once per item or key block.  P is rounded to bf16
// as on the AMX tiles; sums stay f32.  Like the tiles, VDPBF16PS reads
// subnormal bf16 as zero.
#pragma once

#include <cstdint>

#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "kv_reader.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Whether rows of a 16-bit operand give their column pairs in place: read in place with adjacent
// columns, even width.
inline bool pairs_in_place(bool unit_columns, int64_t cols) { return unit_columns && cols % 2 == 0; }
inline bool pairs_in_place(const TensorView& t, int64_t cols) { return pairs_in_place(t.strides[4] == 1, cols); }
inline bool pairs_in_place(const KvReader& kv, int64_t cols) { return pairs_in_place(kv.rows_in_place(), cols); }

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn

#if defined(__AVX512F__) && GRAPHATTN_LANES == 16

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "graphattn/cpu_features.hpp"
#include "simd.hpp"

#define GRAPHATTN_BF16_DOTS __attribute__((target("avx512bf16")))

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Whether bf16 products on pairs beat widening bf16 to f32 for the FMAs on
// this CPU: on AMD's Zen 4 a VDPBF16PS costs what an FMA does for twice the
// products; on Intel's it does not pay, so Intel CPUs keep the FMAs.
inline bool bf16_pairs_pay_off() {
    const CpuFeatures& f = cpu_features();
    return f.avx512_bf16 && f.amd;
}

// c_t[n][lanes] (+)= scale * sum_{p < pairs} a_pairs[p][lanes] . word(b, n, p)
// for n < NT and RV vectors of lanes, where word(b, n, p) is the pair of
// bf16 at b + n * b_n + p * b_p (any alignment), broadcast.
template <int RV, int NT, bool Accumulate>
GRAPHATTN_BF16_DOTS inline void pair_tile(const uint32_t* __restrict a_pairs, int64_t lda, int pairs,
                                          const uint16_t* __restrict b, int64_t b_n, int64_t b_p,
                                          float* __restrict c_t, int64_t ldc, float scale) {
    __m512 acc[NT][RV];
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n)
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) acc[n][v] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; ++p) {
        __m512bh a[RV];
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) a[v] = (__m512bh)_mm512_loadu_si512(a_pairs + p * lda + v * kLanes);
        const uint16_t* bp = b + p * b_p;
#pragma GCC unroll 16
        for (int n = 0; n < NT; ++n) {
            uint32_t word;
            std::memcpy(&word, bp + n * b_n, sizeof word);
            const __m512bh bn = (__m512bh)_mm512_set1_epi32(int(word));
#pragma GCC unroll 16
            for (int v = 0; v < RV; ++v) acc[n][v] = _mm512_dpbf16_ps(acc[n][v], a[v], bn);
        }
    }
    const __m512 factor = _mm512_set1_ps(scale);
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n)
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) {
            float* c = c_t + n * ldc + v * kLanes;
            const __m512 sum = _mm512_mul_ps(acc[n][v], factor);
            _mm512_storeu_ps(c, Accumulate ? _mm512_add_ps(_mm512_loadu_ps(c), sum) : sum);
        }
}

// The same for n < n_count: tiles of NT, then one narrower tile for the
// rest.  By default rows of a_pairs and c_t are RV vectors long.
template <int RV, int NT, bool Accumulate>
GRAPHATTN_BF16_DOTS inline void pair_gemm(const uint32_t* a_pairs, int pairs, const uint16_t* b, int64_t b_n,
                                          int64_t b_p, int n_count, float* c_t, float scale = 1.0f,
                                          int64_t lda = RV * kLanes, int64_t ldc = RV * kLanes) {
    int n = 0;
    for (; n + NT <= n_count; n += NT)
        pair_tile<RV, NT, Accumulate>(a_pairs, lda, pairs, b + n * b_n, b_n, b_p, c_t + n * ldc, ldc, scale);
    if constexpr (NT > 1) {
        if (n < n_count)
            pair_gemm<RV, NT - 1, Accumulate>(a_pairs, pairs, b + n * b_n, b_n, b_p, n_count - n, c_t + n * ldc, scale,
                                              lda, ldc);
    }
}

// pair_gemm over lanes `width` wide (a multiple of kLanes), in column chunks
// of RV vectors and narrower ones for the rest (as lane_gemm_wide).
template <int RV, int NT, bool Accumulate>
GRAPHATTN_BF16_DOTS inline void pair_gemm_wide(const uint32_t* a_pairs, int64_t lda, int pairs, const uint16_t* b,
                                               int64_t b_n, int64_t b_p, int n_count, float* c, int64_t ldc,
                                               int width) {
    int x = 0;
    for (; x + RV * kLanes <= width; x += RV * kLanes)
        pair_gemm<RV, NT, Accumulate>(a_pairs + x, pairs, b, b_n, b_p, n_count, c + x, 1.0f, lda, ldc);
    if constexpr (RV > 1) {
        if (x < width)
            pair_gemm_wide<RV - 1, NT + 2, Accumulate>(a_pairs + x, lda, pairs, b, b_n, b_p, n_count, c + x, ldc,
                                                       width - x);
    }
}

// The 16 words (lo[i], hi[i]) of two f32 vectors rounded to bf16 (nearest even).
GRAPHATTN_BF16_DOTS inline __m512i pair_words(__m512 lo, __m512 hi) {
    // VCVTNE2PS2BF16 gives hi's 16 bf16 above lo's; the permutation interleaves them.
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Pairs along the rows of an f32 block in the lanes layout (P^T, dS^T):
// pairs[p][lanes] from rows 2p and 2p + 1 of x_t (`lanes` wide, a multiple of
// 16), for rows [0, rows) in (rows + 1) / 2 pairs, an odd last row paired with
// zeros (the row after it in x_t need not hold finite values).
GRAPHATTN_BF16_DOTS inline void pack_lane_pairs(const float* x_t, int rows, int lanes, uint32_t* pairs) {
    for (int p = 0; p < (rows + 1) / 2; ++p) {
        const float* lo = x_t + 2 * p * lanes;
        const bool has_hi = 2 * p + 1 < rows;
        for (int x = 0; x < lanes; x += kLanes) {
            const __m512 hi = has_hi ? _mm512_loadu_ps(lo + lanes + x) : _mm512_setzero_ps();
            _mm512_storeu_si512(pairs + p * lanes + x, pair_words(_mm512_loadu_ps(lo + x), hi));
        }
    }
}

// One lane vector of a block in the lanes layout: 2^(x - base) of its rows
// [0, rows) (rows ld floats apart), written as pack_lane_pairs would pair
// them (pair rows ld_pairs words apart, an odd last row paired with zero);
// returns the sum of the values before rounding.  The degree-4 exp2 serves:
// the values are rounded to bf16 next.
GRAPHATTN_BF16_DOTS inline VecF exp2_to_lane_pairs(const float* x, int64_t ld, int rows, VecF base, uint32_t* pairs,
                                                   int64_t ld_pairs) {
    VecF sum{};
    for (int r = 0; r < rows; r += 2) {
        const VecF lo = vexp2<true>(load(x + r * ld) - base);
        const VecF hi = r + 1 < rows ? vexp2<true>(load(x + (r + 1) * ld) - base) : VecF{};
        sum += lo + hi;
        _mm512_storeu_si512(pairs + (r / 2) * ld_pairs, pair_words((__m512)lo, (__m512)hi));
    }
    return sum;
}

// Pairs along the rows of a bf16 block (V, K, Q or dO rows): pairs[p][c] =
// (X[2p][c], X[2p + 1][c]) for c < cols, from `count` rows row_stride apart
// with unit column stride (an odd last row pairs with zeros); rows of `pairs`
// are ld words apart, and their words from cols to ld are not written.
inline void pack_row_pairs(const uint16_t* rows, int64_t row_stride, int count, int cols, uint32_t* pairs, int64_t ld) {
    for (int p = 0; p < (count + 1) / 2; ++p) {
        const uint16_t* lo = rows + 2 * p * row_stride;
        const uint16_t* hi = 2 * p + 1 < count ? lo + row_stride : nullptr;
        uint32_t* out = pairs + p * ld;
        for (int c = 0; c < cols; c += kLanes) {
            const __mmask16 m = cols - c >= kLanes ? __mmask16(0xffff) : __mmask16((1u << (cols - c)) - 1);
            const __m512i lo_words = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, lo + c));
            const __m512i hi_words =
                hi ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, hi + c)), 16)
                   : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(out + c, m, _mm512_or_si512(lo_words, hi_words));
        }
    }
}

// rows x `lanes` f32 values (rows ld_f32 apart) rounded to bf16 rows of the
// same layout (ld_bf16 apart), lanes from `count` on written as zeros, so that
// pairs reaching past the last key add nothing whatever those lanes held.
GRAPHATTN_BF16_DOTS inline void round_rows_to_bf16(const float* x, int64_t ld_f32, int rows, int lanes, int count,
                                                   uint16_t* out, int64_t ld_bf16) {
    for (int r = 0; r < rows; ++r)
        for (int l = 0; l < lanes; l += kLanes) {
            const __mmask16 keep = count - l >= kLanes ? __mmask16(0xffff)
                                   : count > l       ? __mmask16((1u << (count - l)) - 1)
                                                     : __mmask16(0);
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(keep, _mm512_loadu_ps(x + r * ld_f32 + l)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld_bf16 + l), (__m256i)h);
        }
}

// Element (r, c) of a 16-bit block with any strides, or 0 past `cols`.
inline uint32_t half_at(const uint16_t* data, int64_t row_stride, int64_t col_stride, int r, int c, int cols) {
    return c < cols ? data[r * row_stride + c * col_stride] : 0u;
}

// Pairs along the columns of `rows` 16-bit rows, any strides: out[r *
// out_row + p * out_pair] = (row r col 2p, row r col 2p + 1) for the
// (cols + 1) / 2 pairs, an odd last column paired with zero.  For operands
// that cannot be read or packed in place.
inline void pack_strided_pairs(const uint16_t* data, int64_t row_stride, int64_t col_stride, int rows, int cols,
                              int pairs, uint32_t* out, int64_t out_row, int64_t out_pair) {
    for (int r = 0; r < rows; ++r)
        for (int p = 0; p < pairs; ++p)
            out[r * out_row + p * out_pair] = half_at(data, row_stride, col_stride, r, 2 * p, cols) |
                                              half_at(data, row_stride, col_stride, r, 2 * p + 1, cols) << 16;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn

#endif
