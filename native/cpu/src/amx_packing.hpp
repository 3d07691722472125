// Packing bf16 blocks into the VNNI pair layouts that TDPBF16PS reads as its
// B operand (see amx_tiles.hpp): pairs along the columns of a block (for
// X^T as B, e.g. K^T in Q K^T) and pairs along its rows (for X as B, e.g. V
// in P V).  Full, unit-stride blocks take the AVX-512 paths; the rest
// (edges, strided views) a scalar one that zero-fills the padding.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// rows x cols bf16 values at data + r * row_stride + c * col_stride.
struct Bf16Block {
    const uint16_t* data;
    int64_t row_stride, col_stride;
    int rows, cols;
    uint16_t at(int r, int c) const { return data[r * row_stride + c * col_stride]; }
};

// dst[p * ld + j] = (X[j][2p], X[j][2p + 1]) for j < width (a multiple of 16)
// and p < cols_padded / 2; zeros past X's rows and columns.
inline void pack_column_pairs(const Bf16Block& x, int width, int cols_padded, uint32_t* dst, int64_t ld) {
    if (x.col_stride == 1 && x.rows == width && x.cols == cols_padded && x.cols % kTileBf16Cols == 0) {
        __m512i in[16], out[16];
        for (int j0 = 0; j0 < width; j0 += 16)
            for (int p0 = 0; p0 < x.cols / 2; p0 += 16) {
                for (int t = 0; t < 16; ++t) in[t] = _mm512_loadu_si512(x.data + (j0 + t) * x.row_stride + 2 * p0);
                transpose_16x16_words(in, out);
                for (int t = 0; t < 16; ++t) _mm512_storeu_si512(dst + (p0 + t) * ld + j0, out[t]);
            }
        return;
    }
    for (int p = 0; p < cols_padded / 2; ++p) std::memset(dst + p * ld, 0, size_t(width) * 4);
    for (int j = 0; j < x.rows; ++j)
        for (int c = 0; c < x.cols; ++c) reinterpret_cast<uint16_t*>(dst + (c / 2) * ld + j)[c % 2] = x.at(j, c);
}

// dst[jp * ld + c] = (X[2jp][c], X[2jp + 1][c]) for jp < height / 2 and
// c < cols_padded (a multiple of 32); zeros past X's rows and columns.
inline void pack_row_pairs(const Bf16Block& x, int height, int cols_padded, uint32_t* dst, int64_t ld) {
    if (x.col_stride == 1 && x.rows == height && x.cols == cols_padded) {
        alignas(64) int16_t low_index[32], high_index[32];
        for (int w = 0; w < 16; ++w) {
            low_index[2 * w] = int16_t(w), low_index[2 * w + 1] = int16_t(32 + w);
            high_index[2 * w] = int16_t(16 + w), high_index[2 * w + 1] = int16_t(48 + w);
        }
        const __m512i lo = _mm512_load_si512(low_index), hi = _mm512_load_si512(high_index);
        for (int jp = 0; jp < height / 2; ++jp)
            for (int c0 = 0; c0 < cols_padded; c0 += 32) {
                const __m512i even = _mm512_loadu_si512(x.data + (2 * jp) * x.row_stride + c0);
                const __m512i odd = _mm512_loadu_si512(x.data + (2 * jp + 1) * x.row_stride + c0);
                _mm512_storeu_si512(dst + jp * ld + c0, _mm512_permutex2var_epi16(even, lo, odd));
                _mm512_storeu_si512(dst + jp * ld + c0 + 16, _mm512_permutex2var_epi16(even, hi, odd));
            }
        return;
    }
    for (int jp = 0; jp < height / 2; ++jp) std::memset(dst + jp * ld, 0, size_t(cols_padded) * 4);
    for (int j = 0; j < x.rows; ++j)
        for (int c = 0; c < x.cols; ++c) reinterpret_cast<uint16_t*>(dst + (j / 2) * ld + c)[j % 2] = x.at(j, c);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
