// Where a key or value row lies, in one place.  Every CPU kernel and packer
// (through native/cpu/src/kv_reader.hpp) and the SYCL device code find K/V
// rows by this struct alone, so a new cache layout changes this header and
// the readers over it, not the kernels.  Plain arithmetic only: both
// compilers build it.
//
// Two layouts:
//  - a strided view: row j of batch element (b0, b1, b2), column c, lies at
//    element
//        b0 * batch_strides[0] + b1 * batch_strides[1] + b2 * batch_strides[2]
//          + j * row_stride + c * col_stride
//    from the data pointer.  A batch stride of 0 shares the rows across that
//    dimension (the query heads of a GQA/MQA group read one K/V head).
//  - a paged cache (KvPages): b0 is the sequence, whose logical row
//    r = first_row + j lies in block table[b0 * table_stride + r / block_rows]
//    at row r % block_rows; a block starts batch_strides[0] elements after
//    the one before it, so row j, column c lies at
//        block * batch_strides[0] + b1 * batch_strides[1] + b2 * batch_strides[2]
//          + (r % block_rows) * row_stride + c * col_stride.
//    Rows of one block lie row_stride apart; rows of different blocks anywhere.
#pragma once

#include <cstdint>

namespace graphattn {

// The block table of a paged K/V cache (flash-attn's and vLLM's block_table):
// sequence s's blocks are table[s * table_stride + 0, 1, ...], each of
// block_rows rows, table_stride entries a sequence (the table's rows lie
// one after another); num_blocks bounds every entry.  cols: the values of a row
// (the head size), for putting rows of several blocks together.
struct KvPages {
    const int32_t* table = nullptr;
    int64_t table_stride = 0;
    int64_t block_rows = 0;
    int64_t num_blocks = 0;
    int64_t first_row = 0;  // the logical row of key 0
    int64_t rows = 0;       // keys each sequence holds from first_row on: what a read ahead may reach
    int64_t cols = 0;
    bool paged() const { return table != nullptr; }
};

struct KvRowLayout {
    int64_t batch_strides[3] = {0, 0, 0};  // elements
    int64_t row_stride = 0;
    int64_t col_stride = 1;
    KvPages pages;

    // A paged base holds its sequence above kSequenceUnit and its heads'
    // offset below it, so kernels keep treating a base as one opaque number
    // (equal bases: equal rows).  Heads' offsets are checked to lie in
    // [0, kSequenceUnit) (args_check.cpp).
    static constexpr int64_t kSequenceUnit = int64_t(1) << 40;

    // The "base" of batch element (b0, b1, b2) that the row offsets below
    // start from: its first row's offset for a view.
    int64_t batch_offset(int64_t b0, int64_t b1, int64_t b2) const {
        if (pages.paged()) return b0 * kSequenceUnit + b1 * batch_strides[1] + b2 * batch_strides[2];
        return b0 * batch_strides[0] + b1 * batch_strides[1] + b2 * batch_strides[2];
    }
    // Offset of row j of the batch element at `base`.
    int64_t row_offset(int64_t base, int64_t j) const {
        if (!pages.paged()) return base + j * row_stride;
        const int64_t r = pages.first_row + j;
        const int64_t block = pages.table[base / kSequenceUnit * pages.table_stride + r / pages.block_rows];
        return block * batch_strides[0] + base % kSequenceUnit + r % pages.block_rows * row_stride;
    }
    // Rows j, j + 1, ... that lie row_stride apart from row j on (at least 1).
    int64_t run_from(int64_t j, int64_t rows_wanted) const {
        if (!pages.paged()) return rows_wanted;
        const int64_t left = pages.block_rows - (pages.first_row + j) % pages.block_rows;
        return left < rows_wanted ? left : rows_wanted;
    }
    // Offset of column c of that row.
    int64_t element_offset(int64_t base, int64_t j, int64_t c) const { return row_offset(base, j) + c * col_stride; }

    // Whether every index of batch dimension d reads the same rows.
    bool shared_over(int d) const { return pages.paged() && d == 0 ? false : batch_strides[d] == 0; }
    // Whether the columns of a row are adjacent, so that a row is read as one run of values.
    bool unit_columns() const { return col_stride == 1; }
    // Whether the rows of `count` indices of batch dimension d lie side by side within one row stride (the
    // heads of a token-major cache: rows H * D apart, head h's at h * D), so that one token's rows of all of
    // them are one run of memory.  A paged cache's sequence dimension never does.
    bool interleaves(int d, int64_t count) const {
        return count > 1 && !(pages.paged() && d == 0) && batch_strides[d] > 0 && batch_strides[d] * count <= row_stride;
    }
};

}  // namespace graphattn
