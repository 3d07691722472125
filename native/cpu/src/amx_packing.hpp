// Packing bf16 blocks into the VNNI pair layouts that TDPBF16PS reads as its
// B operand (see amx_tiles.hpp): pairs along the columns of a block (for
// X^T as B, e.g. K^T in Q K^T) and pairs along its rows (for X as B, e.g. V
// in P V).  Unit-stride rows take the AVX-512 paths, with masked loads at the
// edges; strided rows a scalar one that zero-fills the padding.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx_split.hpp"
#include "amx_tiles.hpp"
#include "block_io.hpp"
#include "isa_namespace.hpp"
#include "transpose_block.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// rows x cols bf16 values at data + r * row_stride + c * col_stride.
struct Bf16Block {
    const uint16_t* data;
    int64_t row_stride, col_stride;
    int rows, cols;
    uint16_t at(int r, int c) const { return data[r * row_stride + c * col_stride]; }
};

// Indices for interleaving the 16-bit words of two rows of 32: (a0, b0, a1, b1, ...)
// takes `low` for words 0-15 of each row and `high` for words 16-31.
struct WordInterleave {
    __m512i low, high;
    WordInterleave() {
        alignas(64) int16_t low_index[32], high_index[32];
        for (int w = 0; w < 16; ++w) {
            low_index[2 * w] = int16_t(w), low_index[2 * w + 1] = int16_t(32 + w);
            high_index[2 * w] = int16_t(16 + w), high_index[2 * w + 1] = int16_t(48 + w);
        }
        low = _mm512_load_si512(low_index);
        high = _mm512_load_si512(high_index);
    }
};

// 32 words of row `row` from column c0, zeros from column `cols` on.
inline __m512i load_words(const uint16_t* row, int c0, int cols) {
    const int n = cols - c0;
    const __mmask32 keep = n >= 32 ? ~__mmask32(0) : (n <= 0 ? __mmask32(0) : (__mmask32(1) << n) - 1);
    return _mm512_maskz_loadu_epi16(keep, row + c0);
}

// dst[p * ld + j] = (X[j][2p], X[j][2p + 1]) for j < width (a multiple of 16)
// and p < cols_padded / 2 (cols_padded a multiple of 32); zeros past X's rows
// and columns.
inline void pack_column_pairs(const Bf16Block& x, int width, int cols_padded, uint32_t* dst, int64_t ld) {
    if (x.col_stride == 1) {
        const __m512i zero = _mm512_setzero_si512();
        __m512i in[16], out[16];
        for (int j0 = 0; j0 < width; j0 += 16)
            for (int p0 = 0; p0 < cols_padded / 2; p0 += 16) {
                for (int t = 0; t < 16; ++t)
                    in[t] = j0 + t < x.rows ? load_words(x.data + (j0 + t) * x.row_stride, 2 * p0, x.cols) : zero;
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
    if (x.col_stride == 1) {
        const WordInterleave interleave;
        const __m512i lo = interleave.low, hi = interleave.high, zero = _mm512_setzero_si512();
        for (int jp = 0; jp < height / 2; ++jp)
            for (int c0 = 0; c0 < cols_padded; c0 += 32) {
                const __m512i even = 2 * jp < x.rows ? load_words(x.data + (2 * jp) * x.row_stride, c0, x.cols) : zero;
                const __m512i odd =
                    2 * jp + 1 < x.rows ? load_words(x.data + (2 * jp + 1) * x.row_stride, c0, x.cols) : zero;
                _mm512_storeu_si512(dst + jp * ld + c0, _mm512_permutex2var_epi16(even, lo, odd));
                _mm512_storeu_si512(dst + jp * ld + c0 + 16, _mm512_permutex2var_epi16(even, hi, odd));
            }
        return;
    }
    for (int jp = 0; jp < height / 2; ++jp) std::memset(dst + jp * ld, 0, size_t(cols_padded) * 4);
    for (int j = 0; j < x.rows; ++j)
        for (int c = 0; c < x.cols; ++c) reinterpret_cast<uint16_t*>(dst + (j / 2) * ld + c)[j % 2] = x.at(j, c);
}

// Split packings: a block of f32, bf16 or f16 values with unit column
// stride (SplitRows; padding to whole tiles packs as zeros, read from
// nowhere) goes into bf16 parts (amx_split.hpp), one segment per part.  They
// convert, split, pad and pack in registers, in one pass, and add the lanes
// that held an infinity to `infinite`.

// `rows` rows of `cols` values of dtype dt at data, row_stride elements apart.
struct SplitRows {
    const void* data;
    DType dt;
    int64_t row_stride;
    int rows, cols;

    // The parts of values c0 .. c0 + 31 of row j, zeros past the rows and
    // columns.  Checked = false: the caller knows there is no padding there.
    template <int Parts, bool Checked>
    void load(int j, int c0, __m512i parts[Parts], __mmask16& infinite) const {
        const bool real = !Checked || j < rows;
        load_split_32<Parts>(real ? element_ptr(data, dt, j * row_stride + c0) : data, dt, parts, infinite,
                             !Checked ? 32 : (real ? cols - c0 : 0));
    }
};

// body(checked) with checked a compile-time bool, true where the block has
// padding: blocks without it skip the masks and bounds checks, which would
// slow the lone long items that packing dominates.
template <typename Body>
inline void with_padding_checks(bool padded, Body body) {
    if (padded)
        body(std::true_type{});
    else
        body(std::false_type{});
}

// As pack_column_pairs for `width` keys and cols_padded columns: part p's
// cols_padded / 2 pair rows, from dst + p * (cols_padded / 2) * ld.
template <int Parts>
inline void pack_column_pairs_split(const SplitRows& x, int width, int cols_padded, uint32_t* dst, int64_t ld,
                                    __mmask16& infinite) {
    with_padding_checks(x.rows < width || x.cols < cols_padded, [&](auto checked) {
        __m512i in[Parts][16], out[16], parts[Parts];
        for (int j0 = 0; j0 < width; j0 += 16)
            for (int c0 = 0; c0 < cols_padded; c0 += kTileBf16Cols) {
                for (int r = 0; r < 16; ++r) {
                    x.load<Parts, decltype(checked)::value>(j0 + r, c0, parts, infinite);
                    for (int p = 0; p < Parts; ++p) in[p][r] = parts[p];
                }
                for (int p = 0; p < Parts; ++p) {
                    transpose_16x16_words(in[p], out);
                    uint32_t* seg = dst + (int64_t(p) * (cols_padded / 2) + c0 / 2) * ld + j0;
                    for (int r = 0; r < 16; ++r) _mm512_storeu_si512(seg + r * ld, out[r]);
                }
            }
    });
}

// As pack_row_pairs for `height` keys: part p's height / 2 pair rows, from
// dst + p * part_rows * ld.
template <int Parts>
inline void pack_row_pairs_split(const SplitRows& x, int height, int cols_padded, uint32_t* dst, int64_t ld,
                                 int64_t part_rows, __mmask16& infinite) {
    with_padding_checks(x.rows < height || x.cols < cols_padded, [&](auto checked) {
        const WordInterleave interleave;
        __m512i even[Parts], odd[Parts];
        for (int jp = 0; jp < height / 2; ++jp)
            for (int c0 = 0; c0 < cols_padded; c0 += kTileBf16Cols) {
                x.load<Parts, decltype(checked)::value>(2 * jp, c0, even, infinite);
                x.load<Parts, decltype(checked)::value>(2 * jp + 1, c0, odd, infinite);
                for (int p = 0; p < Parts; ++p) {
                    uint32_t* out = dst + (int64_t(p) * part_rows + jp) * ld + c0;
                    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(even[p], interleave.low, odd[p]));
                    _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(even[p], interleave.high, odd[p]));
                }
            }
    });
}

// A operand rows: dst[r * ld + p * cols_padded + c] = part p of X[r][c] for
// r < x.rows (zeros for x.cols <= c < cols_padded).
template <int Parts>
inline void pack_rows_split(const SplitRows& x, int cols_padded, uint16_t* dst, int64_t ld, __mmask16& infinite) {
    __m512i parts[Parts];
    for (int r = 0; r < x.rows; ++r)
        for (int c0 = 0; c0 < cols_padded; c0 += kTileBf16Cols) {
            x.load<Parts, true>(r, c0, parts, infinite);
            for (int p = 0; p < Parts; ++p) _mm512_storeu_si512(dst + r * ld + p * cols_padded + c0, parts[p]);
        }
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
