// Sequences of different lengths packed in one call (flash-attn's varlen
// layout), in one place for the CPU kernels and the SYCL plugin's host code
// (plain C++, both compilers build it).
//
// Sequence s holds the query rows [query_begin, query_begin + query_rows)
// and the key rows [key_begin, key_begin + key_rows) of the packed views;
// its rows are its own: row r of the sequence is row query_begin + r of Q,
// O, the stats, dO and dQ, key r is row key_begin + r of K, V, dK and dV.
// With a paged K/V cache (KvPages), key r of sequence s is logical row
// key_begin + r of s's own blocks instead.
// Causal, the window and ALiBi align each sequence's rows to its own keys
// (graphattn/key_window.hpp's RowAlignment).  A dense batch is the case of
// equal lengths at a constant spacing.
#pragma once

#include <cstdint>

namespace graphattn {

struct SequenceSpan {
    int64_t query_begin = 0;
    int64_t query_rows = 0;
    int64_t key_begin = 0;
    int64_t key_rows = 0;
};

// spans == nullptr: not packed (every batch index has seq_q rows and seq_kv
// keys, found by the batch strides).  Packed: the call's batch[0] counts the
// sequences and the packed views' batch-0 stride is not used; views with one
// value per batch index (ALiBi slopes, sinks) still step by theirs, so they
// may hold one value per sequence (stride > 0) or share one (stride 0).
struct PackedSequences {
    const SequenceSpan* spans = nullptr;
    bool packed() const { return spans != nullptr; }
};

// Sequences s and s + 1 lie one after the other in equal lengths, so that a
// run of them is a dense batch with batch-0 strides of one sequence's rows.
// keys_paged: the keys are found through a block table row per sequence
// (graphattn/kv_rows.hpp), where key_begin is the logical first row, so a
// run's keys start at one logical row instead of lying one after another.
inline bool continues_run(const SequenceSpan& a, const SequenceSpan& b, bool keys_paged) {
    const bool keys_follow = keys_paged ? b.key_begin == a.key_begin : b.key_begin == a.key_begin + a.key_rows;
    return a.query_rows == b.query_rows && a.key_rows == b.key_rows && b.query_begin == a.query_begin + a.query_rows &&
           keys_follow;
}

}  // namespace graphattn
