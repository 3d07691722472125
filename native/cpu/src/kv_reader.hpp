// Reading key and value rows: the CPU kernels' and packers' one way to K and
// V.  It owns how a row is found (graphattn/kv_rows.hpp) and decoded (its
// dtype, or its quantized format: graphattn/kv_format.hpp), so kernels ask
// it for blocks of rows, never for strides.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_io.hpp"
#include "graphattn/kv_rows.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "kv_decode.hpp"
#include "scratch.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Room of one thread where a reader puts a block of K or V rows together
// when its layout keeps them apart (rows of several blocks of a paged
// cache); a strided view never uses it, so it stays empty (nothing
// allocated).
class KvStage {
public:
    void* room(size_t bytes) {
        if (bytes > bytes_) {
            buffer_ = AlignedFloats::uninitialized((bytes + 3) / 4);
            bytes_ = bytes;
        }
        return buffer_.get();
    }

private:
    AlignedFloats buffer_;
    size_t bytes_ = 0;
};

// A block of a quantized view's rows as kernels decode them while they read them (KvReader::lanes_block):
// row t's stored bytes, and each group's scale and zero point as f32 at [t * groups + g], the group of each
// vector of columns (vector_group[c / kLanes]), and the format.  Made once per thread by
// KvReader::lanes_block_for for a block of up to `max_rows` rows of `cols` values.
struct KvLanesBlock {
    KvFormat format = KvFormat::plain;
    int groups = 0;
    std::vector<const uint8_t*> rows;
    std::vector<float> scales, zeros;
    std::vector<int> vector_group;

    KvLanesBlock() = default;
    KvLanesBlock(int max_rows, int max_groups, int cols)
        : rows(size_t(max_rows)), scales(size_t(max_rows) * max_groups), zeros(size_t(max_rows) * max_groups),
          vector_group(size_t(cols + kLanes - 1) / kLanes) {}
};

// The rows of a KvLanesBlock as the row layout's micro-kernels read them (row_layout_blocks.hpp): vector
// `c / kLanes` of row t's values, (stored - zero point) * scale (fp8: value * scale), decoded as it is read.
template <KvFormat F>
struct QuantLanes {
    const KvLanesBlock& block;
    VecF lanes(int t, int c) const {
        const size_t at = size_t(t) * size_t(block.groups) + size_t(block.vector_group[size_t(c / kLanes)]);
        const VecF stored = stored_lanes<F>(block.rows[size_t(t)], c);
        if constexpr (kv_fp8(F))
            return stored * splat(block.scales[at]);
        else
            return (stored - splat(block.zeros[at])) * splat(block.scales[at]);
    }
};

// Calls f(QuantLanes<F>{block}) with the block's format F a compile-time constant.
template <class Fn>
inline void with_quant_lanes(const KvLanesBlock& block, Fn&& f) {
    switch (block.format) {
        case KvFormat::u8: return f(QuantLanes<KvFormat::u8>{block});
        case KvFormat::s8: return f(QuantLanes<KvFormat::s8>{block});
        case KvFormat::u4: return f(QuantLanes<KvFormat::u4>{block});
        case KvFormat::s4: return f(QuantLanes<KvFormat::s4>{block});
        case KvFormat::s4_in_byte: return f(QuantLanes<KvFormat::s4_in_byte>{block});
        case KvFormat::fp8_e4m3: return f(QuantLanes<KvFormat::fp8_e4m3>{block});
        case KvFormat::fp8_e5m2: return f(QuantLanes<KvFormat::fp8_e5m2>{block});
        default: return;
    }
}

// Where the scales or zero points of a quantized view lie (KvQuantParams):
// per group, through the rows' own block table; per batch element, by the
// batch strides alone.
inline KvRowLayout quant_params_layout(const KvQuantParams& p, const KvPages& pages, bool per_group) {
    KvRowLayout layout;
    for (int d = 0; d < kBatchDims; ++d) layout.batch_strides[d] = p.strides[d];
    layout.row_stride = per_group ? p.strides[3] : 0;
    layout.col_stride = per_group ? p.strides[4] : 0;
    if (per_group) layout.pages = pages;
    return layout;
}

inline float scale_value(const void* data, DType dt, int64_t offset) {
    switch (dt) {
        case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(data)[offset]);
        case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(data)[offset]);
        default: return static_cast<const float*>(data)[offset];
    }
}

// The 256 values of an fp8 format's bytes, computed once.
inline const float* fp8_values(KvFormat f) {
    static const std::array<float, 256> e4m3 = [] {
        std::array<float, 256> t{};
        for (int i = 0; i < 256; ++i) t[size_t(i)] = kv_fp8_value(KvFormat::fp8_e4m3, uint8_t(i));
        return t;
    }();
    static const std::array<float, 256> e5m2 = [] {
        std::array<float, 256> t{};
        for (int i = 0; i < 256; ++i) t[size_t(i)] = kv_fp8_value(KvFormat::fp8_e5m2, uint8_t(i));
        return t;
    }();
    return f == KvFormat::fp8_e4m3 ? e4m3.data() : e5m2.data();
}

// n bytes from src to dst by whole vectors, the rest by memcpy: a decode step copies each K/V row of a block
// (a few hundred bytes), where the library's memcpy spent more on choosing its method than on the copy.
inline void copy_row_bytes(char* dst, const char* src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 64 <= n; i += 64)
        _mm512_storeu_si512(reinterpret_cast<void*>(dst + i), _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
#elif defined(__AVX2__)
    for (; i + 32 <= n; i += 32)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#endif
    if (i < n) std::memcpy(dst + i, src + i, size_t(n - i));
}

class KvReader {
public:
    explicit KvReader(const TensorView& t)
        : data_(t.data), dtype_(read_dtype(t)), layout_(kv_row_layout(t)), quant_(t.quant),
          scale_layout_(quant_params_layout(t.quant.scales, t.pages, !kv_fp8(t.quant.format))),
          zero_layout_(quant_params_layout(t.quant.zero_points, t.pages, true)) {}

    // The dtype of the rows that block(), adjacent_block() and the kernels read.
    DType dtype() const { return dtype_; }
    // An opaque number for batch element b's rows: equal bases, equal rows.  A quantized reader's holds the
    // indices themselves (the shared ones 0), since its scales are found from them by strides of their own.
    int64_t batch_offset(const int64_t b[kBatchDims]) const {
        if (!quant_.quantized()) return layout_.batch_offset(b[0], b[1], b[2]);
        int64_t base = 0;
        for (int d = 0; d < kBatchDims; ++d) base = base << kIndexBits | (shared_over(d) ? 0 : b[d]);
        return base;
    }
    bool shared_over(int d) const { return layout_.shared_over(d); }
    // Batch indices a quantized reader's base holds: below 2^20 each (checked with the arguments).
    static constexpr int kIndexBits = 20;

    // Whether the rows of a block() hold their columns as runs of adjacent
    // values in dtype(), so kernels read them so (else they decode them into
    // scratch of their own).  A quantized reader's blocks always do: they are
    // decoded rows.
    bool rows_in_place() const { return quant_.quantized() || layout_.unit_columns(); }
    // Whether block() and adjacent_block() decode rows into the stage (a quantized view): a copy either way,
    // so a kernel that computes in f32 asks load_f32 for them instead, which decodes straight to f32.
    bool rows_decoded() const { return quant_.quantized(); }
    // Whether lanes_block() takes rows of `cols` values, so that a kernel decodes them a vector at a time as
    // it reads them instead of through a decoded copy: a quantized view whose rows are adjacent bytes in
    // groups of whole vectors (kv_decode.hpp's stored_lanes).
    bool decodes_lanes(int cols) const {
        if (!quant_.quantized() || layout_.col_stride != 1 || cols % kLanes != 0) return false;
        return kv_fp8(quant_.format) || quant_.group % kLanes == 0;
    }
    // Groups of a row of `cols` values (fp8: its one scale).
    int groups_of(int cols) const { return kv_fp8(quant_.format) ? 1 : int(cols / quant_.group); }

    // A block for lanes_block() of up to max_rows rows of `cols` values (decodes_lanes(cols)): its format,
    // groups and each vector's group set once.
    KvLanesBlock lanes_block_for(int max_rows, int cols) const {
        KvLanesBlock block(max_rows, groups_of(cols), cols);
        block.format = quant_.format;
        block.groups = groups_of(cols);
        const int G = kv_fp8(quant_.format) ? cols : int(quant_.group);
        for (size_t v = 0; v < block.vector_group.size(); ++v) block.vector_group[v] = int(v) * kLanes / G;
        return block;
    }

    // Rows j0 .. j0 + rows of the batch element at `base` into `block` (from lanes_block_for): their bytes
    // where they lie, their scales and zero points as f32 (e4m3's scale times kFp8E4m3Unscale, as its vector
    // decoding wants).  The next as many rows are prefetched first, as decode_rows does.
    void lanes_block(int64_t base, int64_t j0, int rows, int cols, KvLanesBlock& block) const {
        prefetch_rows(base, j0 + rows, rows, cols);
        const size_t groups = size_t(block.groups);
        const float unscale = quant_.format == KvFormat::fp8_e4m3 ? kFp8E4m3Unscale : 1.0f;
        for_each_row(base, j0, rows, [&](int t, const uint8_t* row, int64_t scales_at, int64_t zeros_at) {
            block.rows[size_t(t)] = row;
            float* s = block.scales.data() + size_t(t) * groups;
            group_params(scales_at, zeros_at, int(groups), s, block.zeros.data() + size_t(t) * groups, unscale);
        });
    }

    // Rows j0 .. j0 + rows (cols values each) of the batch element at `base` asked for ahead of their reading,
    // with their scales and zero points.
    void prefetch(int64_t base, int64_t j0, int rows, int cols) const { prefetch_rows(base, j0, rows, cols); }

    // Rows j0 .. j0 + rows of `count` indices of batch dimension d from the batch element at `base` on, which
    // lie side by side in each token row (KvRowLayout::interleaves(d, count)), read once by loads, a cache
    // line each, so that they lie in the core's caches before a kernel reads parts of them: one run of
    // memory a token, where a head's part of each is a stripe that streams at well under the rate whole rows
    // do.  Loads, not prefetches, as a core may drop prefetches with many misses in flight.  A quantized
    // view's scales and zero points likewise, where they lie so too.
    void bring_in_token_rows(int64_t base, int64_t j0, int rows, int cols, int d, int64_t count) const {
        const int64_t last = rows_held(j0, rows);
        for_each_part(base, cols, [&](const RowPart& part) {
            if (part.layout->interleaves(d, count))
                bring_in_run_rows(part, j0, last, (count - 1) * part.layout->batch_strides[d] + part.row_elements);
        });
    }

    // The same for f32 reads: in place only where the rows already are f32.
    bool f32_in_place() const { return dtype_ == DType::f32 && rows_in_place(); }

    // Rows j0 .. j0 + rows of the batch element at `base` (batch_offset) as
    // one block of the reader's dtype, rows row_stride apart, columns as
    // stored: in place where the layout keeps them so (a view always does; a
    // paged cache where they lie in one block), else put together in
    // `stage` (rows of `pages.cols` values, adjacent), which then holds them
    // until its next use.
    RowBlock block(int64_t base, int64_t j0, int rows, KvStage& stage) const {
        if (quant_.quantized()) return decoded_block(base, j0, rows, int(layout_.pages.cols), stage);
        if (layout_.run_from(j0, rows) >= rows) return strided_block(base, j0);  // one run: read where they are
        return gathered_block(base, j0, rows, layout_.pages.cols, stage);
    }

    // The same rows (cols values each) always adjacent: in place only where they already lie one after
    // another with no gap (row stride cols, unit columns, one block), else put together in `stage`.
    // For kernels that pass over a block's rows more than once: rows a token-major stride apart (2^n
    // bytes) share a few L1 sets, so each pass would miss again (figures: docs/performance.md).
    RowBlock adjacent_block(int64_t base, int64_t j0, int rows, int cols, KvStage& stage) const {
        if (quant_.quantized()) return decoded_block(base, j0, rows, cols, stage);
        if (layout_.unit_columns() && layout_.row_stride == cols && layout_.run_from(j0, rows) >= rows)
            return strided_block(base, j0);
        return gathered_block(base, j0, rows, cols, stage);
    }

    // dst(r, c) = value (r, c) of rows j0 .. j0 + rows as f32, c < cols; dst
    // addressed by (dst_row_stride, dst_col_stride), so a transposed block
    // loads as well.  Padding of dst is left as it is.
    void load_f32(int64_t base, int64_t j0, int rows, int cols, float* dst, int64_t dst_row_stride,
                  int64_t dst_col_stride = 1) const {
        if (quant_.quantized()) {
            float wide[kMaxDecodedCols];
            if (dst_col_stride == 1) {  // straight into dst
                decode_rows(base, j0, rows, cols, [&](int r) { return dst + r * dst_row_stride; }, [](int, const float*) {});
                return;
            }
            decode_rows(base, j0, rows, cols, [&](int) { return wide; }, [&](int r, const float* values) {
                float* out = dst + r * dst_row_stride;
                for (int c = 0; c < cols; ++c) out[c * dst_col_stride] = values[c];
            });
            return;
        }
        for (int64_t j = j0; j < j0 + rows;) {  // one run per block the rows lie in (one for a view)
            const int n = int(layout_.run_from(j, j0 + rows - j));
            const RowBlock b = strided_block(base, j);
            load_block(b.data, dtype_, b.row_stride, b.col_stride, n, cols, dst + (j - j0) * dst_row_stride,
                       dst_row_stride, dst_col_stride);
            j += n;
        }
    }

    // Rows j0 .. j0 + rows as f32 with unit column stride: in place where
    // f32_in_place(), else decoded into scratch (rows of cols values,
    // scratch_ld apart).  row_stride receives the returned rows' stride.
    const float* rows_f32(int64_t base, int64_t j0, int rows, int cols, float* scratch, int64_t scratch_ld,
                          int64_t& row_stride) const {
        if (f32_in_place() && !quant_.quantized() && layout_.run_from(j0, rows) >= rows) {
            const RowBlock b = strided_block(base, j0);
            row_stride = b.row_stride;
            return b.floats();
        }
        load_f32(base, j0, rows, cols, scratch, scratch_ld);
        row_stride = scratch_ld;
        return scratch;
    }

private:
    // Batch element `base` (a quantized reader's batch_offset) as its indices.
    static void batch_indices(int64_t base, int64_t b[kBatchDims]) {
        for (int d = kBatchDims - 1; d >= 0; --d, base >>= kIndexBits) b[d] = base & ((int64_t(1) << kIndexBits) - 1);
    }

    // Rows j0 .. j0 + rows of a quantized view decoded to f32 (graphattn/kv_format.hpp): row r's cols values
    // into target(r) (adjacent), then handed to done(r, values).  Offsets are found once per run of rows in
    // one block and stepped from there: a table lookup and a division a row cost as much as decoding it.  The
    // next as many rows are prefetched first.
    template <class Target, class Done>
    void decode_rows(int64_t base, int64_t j0, int rows, int cols, Target&& target, Done&& done) const {
        prefetch_rows(base, j0 + rows, rows, cols);
        for_each_row(base, j0, rows, [&](int t, const uint8_t* row, int64_t scales_at, int64_t zeros_at) {
            float* out = target(t);
            decode_row(row, scales_at, zeros_at, cols, out);
            done(t, static_cast<const float*>(out));
        });
    }

    // body(t, bytes, scales_at, zeros_at) for rows t = 0 .. rows of j0 on of the quantized batch element at
    // `base`: each row's bytes and the offsets of its scales and zero points, found once per run of rows in
    // one block and stepped from there (a table lookup and a division a row cost as much as decoding it).
    template <class Body>
    void for_each_row(int64_t base, int64_t j0, int rows, Body&& body) const {
        int64_t b[kBatchDims];
        batch_indices(base, b);
        const int64_t data_base = layout_.batch_offset(b[0], b[1], b[2]);
        const int64_t scales_base = scale_layout_.batch_offset(b[0], b[1], b[2]);
        const int64_t zeros_base = zero_layout_.batch_offset(b[0], b[1], b[2]);
        for (int64_t j = j0; j < j0 + rows;) {
            const int64_t n = layout_.run_from(j, j0 + rows - j);
            const uint8_t* row = static_cast<const uint8_t*>(data_) + layout_.row_offset(data_base, j);
            int64_t scales_at = scale_layout_.row_offset(scales_base, j);
            int64_t zeros_at = quant_.zero_points.data ? zero_layout_.row_offset(zeros_base, j) : 0;
            for (int64_t r = 0; r < n; ++r) {
                body(int(j - j0 + r), row, scales_at, zeros_at);
                row += layout_.row_stride;
                scales_at += scale_layout_.row_stride;
                zeros_at += zero_layout_.row_stride;
            }
            j += n;
        }
    }

    // A row's `groups` scales (times `unscale`) and zero points as f32 from their offsets (no zero points: 0).
    // The dtypes are chosen once a row, and on AVX-512 up to 16 adjacent groups convert as one vector: decode
    // takes them for every row of every block, and one by one they cost as much as decoding 4-bit values.
    void group_params(int64_t scales_at, int64_t zeros_at, int groups, float* s, float* z,
                      float unscale = 1.0f) const {
        const int64_t ss = scale_layout_.col_stride, zs = zero_layout_.col_stride;
        const void* scales = quant_.scales.data;
        const uint8_t* zeros = static_cast<const uint8_t*>(quant_.zero_points.data);
        const bool signed_zeros = kv_signed(quant_.format);
#if defined(__AVX512F__)
        if (groups <= 16 && ss == 1 && (!zeros || zs == 1)) {  // masked loads: lanes past `groups` are not read
            const __mmask16 m = __mmask16((1u << groups) - 1u);
            __m512 sv;
            if (quant_.scales.dtype == DType::f32)
                sv = _mm512_maskz_loadu_ps(m, static_cast<const float*>(scales) + scales_at);
            else {
                const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(scales) + scales_at);
                sv = quant_.scales.dtype == DType::f16 ? _mm512_cvtph_ps(h) : bf16x16_to_f32(h);
            }
            _mm512_mask_storeu_ps(s, m, _mm512_mul_ps(sv, _mm512_set1_ps(unscale)));
            __m512 zv = _mm512_setzero_ps();
            if (zeros) {
                const __m128i zb = _mm_maskz_loadu_epi8(m, zeros + zeros_at);
                zv = _mm512_cvtepi32_ps(signed_zeros ? _mm512_cvtepi8_epi32(zb) : _mm512_cvtepu8_epi32(zb));
            }
            _mm512_mask_storeu_ps(z, m, zv);
            return;
        }
#endif
        for (int g = 0; g < groups; ++g) s[g] = scale_value(scales, quant_.scales.dtype, scales_at + g * ss) * unscale;
        if (!zeros)
            std::fill(z, z + groups, 0.0f);
        else if (signed_zeros)
            for (int g = 0; g < groups; ++g) z[g] = float(int8_t(zeros[zeros_at + g * zs]));
        else
            for (int g = 0; g < groups; ++g) z[g] = float(zeros[zeros_at + g * zs]);
    }

    // One row's values from its bytes and the offsets of its scales and zero points.
    void decode_row(const uint8_t* row, int64_t scales_at, int64_t zeros_at, int cols, float* out) const {
        const KvFormat f = quant_.format;
        if (kv_fp8(f)) {
            const float* values = fp8_values(f);
            const float s = scale_value(quant_.scales.data, quant_.scales.dtype, scales_at);
            const int64_t cs = layout_.col_stride;
            if (cs == 1) {
                decode_fp8(f, values, row, cols, s, out);
            } else {
                for (int c = 0; c < cols; ++c) out[c] = values[row[c * cs]] * s;
            }
            return;
        }
        const int G = int(quant_.group), groups = cols / G;
        float s[kMaxDecodedCols], z[kMaxDecodedCols];  // a group may be one value (the C++ API takes any G)
        group_params(scales_at, zeros_at, groups, s, z);
        if (layout_.col_stride == 1) return decode_groups(f, row, groups, G, s, z, out);
        const int64_t cs = layout_.col_stride;  // 8-bit only (4-bit rows are adjacent bytes)
        for (int c = 0; c < cols; ++c) out[c] = (float(kv_stored_int(f, row + c * cs, 0)) - z[c / G]) * s[c / G];
    }

    // The bytes of rows j0 .. j0 + rows asked for ahead of their reading: a block's rows lie a token apart
    // (or in blocks anywhere), which the hardware prefetchers do not follow, so each row's load would wait.
    // How far: rows_held.
    void prefetch_rows(int64_t base, int64_t j0, int rows, int cols) const {
        const int64_t last = rows_held(j0, rows);
        for_each_part(base, cols, [&](const RowPart& part) {
            for_each_line(part, j0, last, part.row_elements, [](const char* p) { __builtin_prefetch(p, 0, 3); });
        });
    }

    // One array a row's reading takes (its values; a quantized row's bytes, scales or zero points): where its
    // rows lie, the batch element's first, and a row's elements (of `size` bytes).
    struct RowPart {
        const void* data;
        int64_t size;
        const KvRowLayout* layout;
        int64_t first;
        int64_t row_elements;
    };

    // f(part) for each array the rows of `cols` values of the batch element at `base` (batch_offset) are read
    // from: the values, or a quantized view's bytes, then its scales and zero points where it has them per group.
    template <class F>
    void for_each_part(int64_t base, int cols, F&& f) const {
        if (!quant_.quantized()) {  // base is the layout's own offset
            f(RowPart{data_, dtype_size(dtype_), &layout_, base, cols * layout_.col_stride});
            return;
        }
        int64_t b[kBatchDims];
        batch_indices(base, b);
        f(RowPart{data_, 1, &layout_, layout_.batch_offset(b[0], b[1], b[2]),
                  kv_row_bytes(quant_.format, cols) * layout_.col_stride});
        const int64_t groups = kv_fp8(quant_.format) ? 0 : cols / quant_.group;
        if (groups == 0) return;  // one scale for all rows
        f(RowPart{quant_.scales.data, dtype_size(quant_.scales.dtype), &scale_layout_,
                  scale_layout_.batch_offset(b[0], b[1], b[2]), groups * scale_layout_.col_stride});
        if (quant_.zero_points.data)
            f(RowPart{quant_.zero_points.data, 1, &zero_layout_, zero_layout_.batch_offset(b[0], b[1], b[2]),
                      groups * zero_layout_.col_stride});
    }

    // Of rows j0 .. j0 + rows, how many a read ahead takes: a paged view's no further than the keys its
    // sequence holds (no table entry past them is read); a strided view's all (loads are asked only for its
    // rows; prefetches may pass its last one, as a prefetch never faults).
    int64_t rows_held(int64_t j0, int64_t rows) const {
        return layout_.pages.paged() ? std::max<int64_t>(0, std::min<int64_t>(rows, layout_.pages.rows - j0)) : rows;
    }

    // line(p) for each 64-byte line's start p of the first `elements` elements of rows j0 .. j0 + rows of `part`.
    template <class Line>
    static void for_each_line(const RowPart& part, int64_t j0, int64_t rows, int64_t elements, Line&& line) {
        const KvRowLayout& layout = *part.layout;
        const int64_t bytes = elements * part.size;
        for (int64_t j = j0; j < j0 + rows;) {
            const int64_t n = layout.run_from(j, j0 + rows - j);
            const char* row = static_cast<const char*>(part.data) + layout.row_offset(part.first, j) * part.size;
            for (int64_t r = 0; r < n; ++r, row += layout.row_stride * part.size)
                for (int64_t x = 0; x < bytes; x += 64) line(row + x);
            j += n;
        }
    }

    // The first `elements` elements of rows j0 .. j0 + rows of `part` (a token row's run), one load a line.
    static void bring_in_run_rows(const RowPart& part, int64_t j0, int64_t rows, int64_t elements) {
        uint8_t seen = 0;
        for_each_line(part, j0, rows, elements, [&](const char* p) { seen ^= *reinterpret_cast<const volatile uint8_t*>(p); });
        (void)seen;
    }

    // Rows j0 .. j0 + rows of a quantized view decoded into `stage` as dtype() rows of `cols` values, adjacent.
    RowBlock decoded_block(int64_t base, int64_t j0, int rows, int cols, KvStage& stage) const {
        if (dtype_ == DType::f32) {
            float* dst = static_cast<float*>(stage.room(size_t(rows) * size_t(cols) * 4));
            decode_rows(base, j0, rows, cols, [&](int r) { return dst + r * cols; }, [](int, const float*) {});
            return {dst, dtype_, cols, 1};
        }
        uint16_t* dst = static_cast<uint16_t*>(stage.room(size_t(rows) * size_t(cols) * 2));
        float wide[kMaxDecodedCols];
        decode_rows(base, j0, rows, cols, [&](int) { return wide; }, [&](int r, const float* values) {
            if (dtype_ == DType::bf16)
                store_bf16_row(values, cols, dst + r * cols);
            else
                store_row(values, cols, dst + r * cols, dtype_, 1);
        });
        return {dst, dtype_, cols, 1};
    }

    // The widest row decoded at once: the largest head size a call takes (args_check.cpp).
    static constexpr int kMaxDecodedCols = 4096;

    // Rows j0 .. j0 + rows copied into `stage` one run after another, `cols` values each, adjacent,
    // columns as stored.
    RowBlock gathered_block(int64_t base, int64_t j0, int rows, int64_t cols, KvStage& stage) const {
        const int64_t size = dtype_size(dtype_);
        char* dst = static_cast<char*>(stage.room(size_t(rows * cols * size)));
        for (int64_t j = j0; j < j0 + rows;) {
            const int64_t n = layout_.run_from(j, j0 + rows - j);
            const RowBlock src = strided_block(base, j);
            char* out = dst + (j - j0) * cols * size;
            const char* in = static_cast<const char*>(src.data);
            for (int64_t r = 0; r < n; ++r) {
                if (layout_.unit_columns()) {
                    copy_row_bytes(out + r * cols * size, in + r * src.row_stride * size, cols * size);
                    continue;
                }
                for (int64_t c = 0; c < cols; ++c)
                    std::memcpy(out + (r * cols + c) * size, in + (r * src.row_stride + c * src.col_stride) * size,
                                size_t(size));
            }
            j += n;
        }
        return {dst, dtype_, cols, 1};
    }

    RowBlock strided_block(int64_t base, int64_t j0) const {
        return {element_ptr(data_, dtype_, layout_.row_offset(base, j0)), dtype_, layout_.row_stride,
                layout_.col_stride};
    }

    const void* data_;
    DType dtype_;
    KvRowLayout layout_;
    KvQuant quant_;
    KvRowLayout scale_layout_, zero_layout_;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
