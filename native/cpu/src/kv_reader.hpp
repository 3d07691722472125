// Reading key and value rows: the CPU kernels' and packers' one way to K and
// V.  It owns how a row is found (graphattn/kv_rows.hpp) and decoded (its
// dtype), so kernels ask it for blocks of rows, never for strides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "block_io.hpp"
#include "graphattn/kv_rows.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
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

class KvReader {
public:
    explicit KvReader(const TensorView& t) : data_(t.data), dtype_(t.dtype), layout_(kv_row_layout(t)) {}

    DType dtype() const { return dtype_; }
    int64_t batch_offset(const int64_t b[kBatchDims]) const { return layout_.batch_offset(b[0], b[1], b[2]); }
    bool shared_over(int d) const { return layout_.shared_over(d); }

    // Whether the rows of a block() hold their columns as runs of adjacent
    // values, so kernels read them in the tensor's own dtype (else they
    // decode them into scratch of their own).
    bool rows_in_place() const { return layout_.unit_columns(); }
    // The same for f32 reads: in place only where the rows already are f32.
    bool f32_in_place() const { return dtype_ == DType::f32 && rows_in_place(); }

    // Rows j0 .. j0 + rows of the batch element at `base` (batch_offset) as
    // one block of the reader's dtype, rows row_stride apart, columns as
    // stored: in place where the layout keeps them so (a view always does; a
    // paged cache where they lie in one block), else put together in
    // `stage` (rows of `pages.cols` values, adjacent), which then holds them
    // until its next use.
    RowBlock block(int64_t base, int64_t j0, int rows, KvStage& stage) const {
        if (layout_.run_from(j0, rows) >= rows) return strided_block(base, j0);  // one run: read where they are
        return gathered_block(base, j0, rows, layout_.pages.cols, stage);
    }

    // The same rows (cols values each) always adjacent: in place only where they already lie one after
    // another with no gap (row stride cols, unit columns, one block), else put together in `stage`.
    // For kernels that pass over a block's rows more than once: rows a token-major stride apart (2^n
    // bytes) share a few L1 sets, so each pass would miss again (figures: docs/performance.md).
    RowBlock adjacent_block(int64_t base, int64_t j0, int rows, int cols, KvStage& stage) const {
        if (layout_.unit_columns() && layout_.row_stride == cols && layout_.run_from(j0, rows) >= rows)
            return strided_block(base, j0);
        return gathered_block(base, j0, rows, cols, stage);
    }

    // dst(r, c) = value (r, c) of rows j0 .. j0 + rows as f32, c < cols; dst
    // addressed by (dst_row_stride, dst_col_stride), so a transposed block
    // loads as well.  Padding of dst is left as it is.
    void load_f32(int64_t base, int64_t j0, int rows, int cols, float* dst, int64_t dst_row_stride,
                  int64_t dst_col_stride = 1) const {
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
        if (f32_in_place() && layout_.run_from(j0, rows) >= rows) {
            const RowBlock b = strided_block(base, j0);
            row_stride = b.row_stride;
            return b.floats();
        }
        load_f32(base, j0, rows, cols, scratch, scratch_ld);
        row_stride = scratch_ld;
        return scratch;
    }

private:
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
                    std::memcpy(out + r * cols * size, in + r * src.row_stride * size, size_t(cols * size));
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
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
