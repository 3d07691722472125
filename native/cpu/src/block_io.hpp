// Moving 2-D blocks between strided tensors of any supported dtype and the
// kernels' f32 scratch buffers.  The dtype switch sits outside the element
// loops, so each loop is a plain typed copy the compiler can vectorise.
#pragma once

#include <algorithm>
#include <cstdint>

#include "graphattn/sdpa.hpp"
#include "half_types.hpp"
#include "transpose_block.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Element offset of batch index b in view t.
inline int64_t view_batch_offset(const TensorView& t, const int64_t b[kBatchDims]) {
    return b[0] * t.strides[0] + b[1] * t.strides[1] + b[2] * t.strides[2];
}

// Address of element `offset` (in elements) of a tensor of dtype dt.
inline const char* element_ptr(const void* base, DType dt, int64_t offset) {
    return static_cast<const char*>(base) + offset * dtype_size(dt);
}

// Consecutive rows read in place: row r, column c at data + r * row_stride +
// c * col_stride elements of `dtype`.
struct RowBlock {
    const void* data;
    DType dtype;
    int64_t row_stride, col_stride;

    const uint16_t* words() const { return static_cast<const uint16_t*>(data); }  // bf16 and f16
    const float* floats() const { return static_cast<const float*>(data); }
    const uint16_t* word_row(int64_t r) const { return words() + r * row_stride; }
};

// The rows of view t from element `offset` on.
inline RowBlock view_rows(const TensorView& t, int64_t offset) {
    return {element_ptr(t.data, t.dtype, offset), t.dtype, t.strides[3], t.strides[4]};
}

// Contiguous 16-bit rows to f32 with the ISA's conversion instructions
// (F16C for f16; bf16 is a widening shift).
inline void convert_contiguous(const uint16_t* s, float* d, int cols, bool is_f16) {
    int c = 0;
#if defined(__AVX512F__)
    if (is_f16) {
        for (; c + 16 <= cols; c += 16)
            _mm512_storeu_ps(d + c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c))));
    } else {
        for (; c + 16 <= cols; c += 16) {
            _mm512_storeu_ps(d + c, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c))));
        }
    }
#elif defined(__F16C__)
    if (is_f16)
        for (; c + 8 <= cols; c += 8)
            _mm256_storeu_ps(d + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c))));
#endif
    if (is_f16) {
        for (; c < cols; ++c) d[c] = f16_to_f32(s[c]);
    } else {
        for (; c < cols; ++c) d[c] = bf16_to_f32(s[c]);
    }
}

template <typename Storage, typename Convert>
inline void copy_block(const Storage* src, int64_t row_stride, int64_t col_stride, int rows, int cols,
                       float* dst, int64_t dst_row_stride, int64_t dst_col_stride, Convert convert) {
    for (int r = 0; r < rows; ++r) {
        const Storage* s = src + r * row_stride;
        float* d = dst + r * dst_row_stride;
        if (col_stride == 1 && dst_col_stride == 1) {
            for (int c = 0; c < cols; ++c) d[c] = convert(s[c]);
        } else {
            for (int c = 0; c < cols; ++c) d[c * dst_col_stride] = convert(s[c * col_stride]);
        }
    }
}

// dst(r, c) = float(src(r, c)) for r < rows, c < cols; dst is addressed with
// (dst_row_stride, dst_col_stride) so the same routine loads a transposed block.
inline void load_block(const void* src, DType dt, int64_t row_stride, int64_t col_stride, int rows, int cols,
                       float* dst, int64_t dst_row_stride, int64_t dst_col_stride) {
    switch (dt) {
        case DType::f32:
            copy_block(static_cast<const float*>(src), row_stride, col_stride, rows, cols, dst, dst_row_stride,
                       dst_col_stride, [](float v) { return v; });
            break;
        case DType::bf16:
            if (col_stride == 1 && dst_col_stride == 1) {
                for (int r = 0; r < rows; ++r)
                    convert_contiguous(static_cast<const uint16_t*>(src) + r * row_stride, dst + r * dst_row_stride,
                                       cols, false);
                break;
            }
            copy_block(static_cast<const uint16_t*>(src), row_stride, col_stride, rows, cols, dst, dst_row_stride,
                       dst_col_stride, [](uint16_t v) { return bf16_to_f32(v); });
            break;
        case DType::f16:
            if (col_stride == 1 && dst_col_stride == 1) {
                for (int r = 0; r < rows; ++r)
                    convert_contiguous(static_cast<const uint16_t*>(src) + r * row_stride, dst + r * dst_row_stride,
                                       cols, true);
                break;
            }
            copy_block(static_cast<const uint16_t*>(src), row_stride, col_stride, rows, cols, dst, dst_row_stride,
                       dst_col_stride, [](uint16_t v) { return f16_to_f32(v); });
            break;
        case DType::boolean:
            copy_block(static_cast<const uint8_t*>(src), row_stride, col_stride, rows, cols, dst, dst_row_stride,
                       dst_col_stride, [](uint8_t v) { return v ? 1.0f : 0.0f; });
            break;
    }
}

// f32 to contiguous f16 with F16C, round to nearest even: scalar
// conversions of whole output rows took a tenth of small half-precision calls.
inline void f16_from_f32_contiguous(const float* s, uint16_t* d, int cols) {
    int c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= cols; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c),
                            _mm512_cvtps_ph(_mm512_loadu_ps(s + c), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; c + 8 <= cols; c += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + c), _mm256_cvtps_ph(_mm256_loadu_ps(s + c), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; c < cols; ++c) d[c] = f32_to_f16(s[c]);
}

// dst[c * col_stride] = convert(src[c]) for c < cols, in dst's dtype.
inline void store_row(const float* src, int cols, void* dst, DType dt, int64_t col_stride) {
    if (dt == DType::f16 && col_stride == 1) return f16_from_f32_contiguous(src, static_cast<uint16_t*>(dst), cols);
    if (dt == DType::bf16 && col_stride == 1) {  // a unit-stride loop the compiler vectorises
        uint16_t* d = static_cast<uint16_t*>(dst);
        for (int c = 0; c < cols; ++c) d[c] = f32_to_bf16(src[c]);
        return;
    }
    switch (dt) {
        case DType::f32: {
            float* d = static_cast<float*>(dst);
            for (int c = 0; c < cols; ++c) d[c * col_stride] = src[c];
            break;
        }
        case DType::bf16: {
            uint16_t* d = static_cast<uint16_t*>(dst);
            for (int c = 0; c < cols; ++c) d[c * col_stride] = f32_to_bf16(src[c]);
            break;
        }
        case DType::f16: {
            uint16_t* d = static_cast<uint16_t*>(dst);
            for (int c = 0; c < cols; ++c) d[c * col_stride] = f32_to_f16(src[c]);
            break;
        }
        case DType::boolean: {
            uint8_t* d = static_cast<uint8_t*>(dst);
            for (int c = 0; c < cols; ++c) d[c * col_stride] = src[c] != 0.0f;
            break;
        }
    }
}

// Writes cols values to the row of view t that starts at element `offset`.
inline void store_view_row(const float* src, int cols, const TensorView& t, int64_t offset) {
    store_row(src, cols, const_cast<char*>(element_ptr(t.data, t.dtype, offset)), t.dtype, t.strides[4]);
}

// The smallest multiple of `multiple` that is >= value.
inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Batch index b of row-major flat index `flat` over dims of the given sizes.
inline void unflatten_batch(const int64_t sizes[kBatchDims], int64_t flat, int64_t b[kBatchDims]) {
    for (int d = kBatchDims - 1; d >= 0; --d) {
        b[d] = flat % sizes[d];
        flat /= sizes[d];
    }
}

// Rows written per transpose by store_transposed_rows: its scratch holds
// this many rows of `cols` floats.
constexpr int kTransposedRowsAtOnce = 16;

// Rows row0 .. row0 + count of view t at batch index b from a transposed f32
// accumulator: row l is factor * acc_t[c * ld + l] for c < cols.
inline void store_transposed_rows(const float* acc_t, int64_t ld, int count, int cols, float factor,
                                  const TensorView& t, const int64_t b[kBatchDims], int64_t row0, float* scratch) {
    for (int l0 = 0; l0 < count; l0 += kTransposedRowsAtOnce) {
        const int n = std::min(kTransposedRowsAtOnce, count - l0);
        transpose_f32(acc_t + l0, ld, cols, n, scratch, cols, factor);
        for (int l = 0; l < n; ++l)
            store_view_row(scratch + l * cols, cols, t, view_batch_offset(t, b) + (row0 + l0 + l) * t.strides[3]);
    }
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
