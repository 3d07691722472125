// Where a key or value row lies, in one place.  Every CPU kernel and packer
// (through native/cpu/src/kv_reader.hpp) and the SYCL device code find K/V
// rows by this struct alone, so a new cache layout changes this header and
// the readers over it, not the kernels.  Plain arithmetic only: both
// compilers build it.
//
// The one layout today is a strided view: row j of batch element
// (b0, b1, b2), column c, lies at element
//     b0 * batch_strides[0] + b1 * batch_strides[1] + b2 * batch_strides[2]
//       + j * row_stride + c * col_stride
// from the data pointer.  A batch stride of 0 shares the rows across that
// dimension (the query heads of a GQA/MQA group read one K/V head).
#pragma once

#include <cstdint>

namespace graphattn {

struct KvRowLayout {
    int64_t batch_strides[3] = {0, 0, 0};  // elements
    int64_t row_stride = 0;
    int64_t col_stride = 1;

    // Offset of the first row of batch element (b0, b1, b2): the "base" the
    // row offsets below start from.
    int64_t batch_offset(int64_t b0, int64_t b1, int64_t b2) const {
        return b0 * batch_strides[0] + b1 * batch_strides[1] + b2 * batch_strides[2];
    }
    // Offset of row j of the batch element at `base`.
    int64_t row_offset(int64_t base, int64_t j) const { return base + j * row_stride; }
    // Offset of column c of that row.
    int64_t element_offset(int64_t base, int64_t j, int64_t c) const { return row_offset(base, j) + c * col_stride; }

    // Whether every index of batch dimension d reads the same rows.
    bool shared_over(int d) const { return batch_strides[d] == 0; }
    // Whether the columns of a row are adjacent, so that a row is read as one run of values.
    bool unit_columns() const { return col_stride == 1; }
};

}  // namespace graphattn
