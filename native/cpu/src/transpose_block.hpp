// Transposes of f32 blocks between row layouts and the kernels' "lanes"
// layouts ([column][row]).  The AVX-512 build moves whole 16 x 16 blocks
// through registers; other builds, and the edges, copy element by element.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

#if defined(__AVX512F__)
// 16 x 16 transpose of 32-bit words: dst row i, word j = src row j, word i.
inline void transpose_16x16_words(const __m512i in[16], __m512i out[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 16; i += 2) {  // interleave words of row pairs
        a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
        a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // then 64-bit pairs of row quads
        b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    // Lane L (128 bits) of b[4q + r] now holds word 4L + r of rows 4q..4q+3;
    // output row 4L + r gathers lane L of b[r], b[4 + r], b[8 + r], b[12 + r].
    for (int r = 0; r < 4; ++r) {
        const __m512i x0 = _mm512_shuffle_i32x4(b[r], b[4 + r], 0x88);  // lanes 0,2 of each
        const __m512i x1 = _mm512_shuffle_i32x4(b[r], b[4 + r], 0xdd);  // lanes 1,3
        const __m512i y0 = _mm512_shuffle_i32x4(b[8 + r], b[12 + r], 0x88);
        const __m512i y1 = _mm512_shuffle_i32x4(b[8 + r], b[12 + r], 0xdd);
        out[r] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        out[8 + r] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        out[4 + r] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        out[12 + r] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}
#endif

// dst[c * dst_ld + r] = factor * row(r)[c] for r < rows, c < cols, where
// row(r) is the address of source row r (rows need not be evenly spaced);
// rows from `rows` up to `padded_rows` are written as zeros (padding lanes:
// transposed with the last rows, not cleared apart, which took one small fill
// per column).  T is float, or uint32_t for words moved as they are (bf16
// pairs; rows at any alignment, no factor).
template <typename T, typename RowAddress>
inline void transpose_rows(RowAddress row, int rows, int cols, T* dst, int64_t dst_ld, float factor = 1.0f,
                           int padded_rows = 0) {
    static_assert(sizeof(T) == 4, "32-bit elements");
    constexpr bool scaled = std::is_same_v<T, float>;
    auto element = [&](const T* src, int c) {  // src[c], read at any alignment, times the factor
        T x;
        std::memcpy(&x, src + c, sizeof x);
        if constexpr (scaled) return x * factor;
        return x;
    };
    padded_rows = std::max(padded_rows, rows);
    int r0 = 0;
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(factor);
    for (; r0 + 16 <= padded_rows; r0 += 16) {
        const int real = std::clamp(rows - r0, 0, 16);  // source rows in this group; the rest are zeros
        if (real == 0) {  // padding only: nothing to transpose
            for (int c = 0; c < cols; ++c) _mm512_storeu_si512(dst + c * dst_ld + r0, _mm512_setzero_si512());
            continue;
        }
        const T* src[16];
        for (int i = 0; i < real; ++i) src[i] = row(r0 + i);
        int c0 = 0;
        for (; c0 + 16 <= cols; c0 += 16) {
            __m512i in[16], out[16];
            for (int i = 0; i < 16; ++i) in[i] = i < real ? _mm512_loadu_si512(src[i] + c0) : _mm512_setzero_si512();
            transpose_16x16_words(in, out);
            for (int i = 0; i < 16; ++i) {
                if constexpr (scaled) out[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(out[i]), f));
                _mm512_storeu_si512(dst + (c0 + i) * dst_ld + r0, out[i]);
            }
        }
        for (int c = c0; c < cols; ++c)
            for (int i = 0; i < 16; ++i) dst[c * dst_ld + r0 + i] = i < real ? element(src[i], c) : T(0);
    }
#endif
    for (int r = r0; r < padded_rows; ++r) {
        if (r >= rows) {
            for (int c = 0; c < cols; ++c) dst[c * dst_ld + r] = T(0);
            continue;
        }
        const T* src = row(r);
        for (int c = 0; c < cols; ++c) dst[c * dst_ld + r] = element(src, c);
    }
}

template <typename RowAddress>
inline void transpose_rows_f32(RowAddress row, int rows, int cols, float* dst, int64_t dst_ld, float factor = 1.0f,
                               int padded_rows = 0) {
    transpose_rows<float>(row, rows, cols, dst, dst_ld, factor, padded_rows);
}

// The same for rows src_ld floats apart.
inline void transpose_f32(const float* src, int64_t src_ld, int rows, int cols, float* dst, int64_t dst_ld,
                          float factor = 1.0f) {
    transpose_rows_f32([=](int r) { return src + r * src_ld; }, rows, cols, dst, dst_ld, factor);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
