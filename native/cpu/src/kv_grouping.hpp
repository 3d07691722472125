// How the batch indices of a backward call group around K and V: the batch
// dims where K and V have stride 0 (the query heads of a GQA group, or any
// broadcast) are "shared", and one K/V batch index ("outer" index, shared
// dims at 0) stands for every batch index that differs from it only there.
// A backward work item that owns an outer index can sum dK/dV over its
// members without races.
#pragma once

#include <algorithm>
#include <cstdint>

#include <omp.h>

#include "block_io.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "kv_reader.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

struct KvGrouping {
    bool shared[kBatchDims];
    int64_t shared_sizes[kBatchDims];  // sizes of the shared dims, 1 elsewhere
    int64_t outer_sizes[kBatchDims];   // sizes of the other dims, 1 on shared ones
    int64_t group = 1;                 // batch indices per outer index
    int64_t outer_items = 1;           // number of outer indices

    explicit KvGrouping(const SdpaForwardArgs& a) {
        const KvReader keys(a.key);  // check_backward_args: V and the K/V gradients share K's broadcast dims
        for (int d = 0; d < kBatchDims; ++d) {
            shared[d] = a.batch[d] > 1 && keys.shared_over(d);
            shared_sizes[d] = shared[d] ? a.batch[d] : 1;
            outer_sizes[d] = shared[d] ? 1 : a.batch[d];
            group *= shared_sizes[d];
            outer_items *= outer_sizes[d];
        }
    }

    void outer_index(int64_t outer, int64_t b[kBatchDims]) const { unflatten_batch(outer_sizes, outer, b); }

    // Batch index of member g (< group) of outer index outer_b.
    void member(const int64_t outer_b[kBatchDims], int64_t g, int64_t b[kBatchDims]) const {
        unflatten_batch(shared_sizes, g, b);
        for (int d = 0; d < kBatchDims; ++d)
            if (!shared[d]) b[d] = outer_b[d];
    }

    // Items per outer index for a backward pass whose items own the whole
    // group of an outer index: enough for `per_thread` items per thread and at
    // most one per key block.  Split s takes key blocks s, s + splits, ...
    // (under a causal mask a key block's work falls with its index, and
    // interleaving gives the splits equal shares) and sums its dQ into a buffer
    // of its own, of dq_plane floats: splits beyond kMinDqSplits only while all
    // the buffers fit kDqBufferFloats (16 MiB): more splits keep few heads'
    // threads busy, but unbounded ones spend more on dQ buffers than they save.
    static constexpr int64_t kMinDqSplits = 4;
    static constexpr int64_t kDqBufferFloats = int64_t(4) << 20;
    int64_t key_splits(int64_t threads, int64_t per_thread, int64_t key_blocks, int64_t dq_plane) const {
        const int64_t wanted = (per_thread * threads + outer_items - 1) / outer_items;
        const int64_t most = std::max(kMinDqSplits, kDqBufferFloats / std::max<int64_t>(1, dq_plane));
        return std::max<int64_t>(1, std::min<int64_t>({wanted, most, key_blocks}));
    }
};

// A backward key pass's work: each K/V batch index's key blocks of `block`
// keys, split among `splits` items (KvGrouping::key_splits), on a team as
// large as the key blocks allow: the last wave's pieces run on it (sized by
// splits instead, few heads ran on four threads per head).
struct KeyPassWork {
    int64_t key_blocks, splits;
    int team;
};

inline KeyPassWork key_pass_work(const KvGrouping& kv, int64_t seq_kv, int64_t block, int64_t per_thread,
                                 int64_t dq_plane) {
    const int64_t key_blocks = (seq_kv + block - 1) / block;
    return {key_blocks, kv.key_splits(omp_get_max_threads(), per_thread, key_blocks, dq_plane),
            team_for_items(kv.outer_items * key_blocks)};
}

// out[d] = factor * (sum over splits s of first[s * plane + d]) for d < cols:
// one dQ row from the split buffers of KvGrouping::key_splits.
inline void sum_split_row(const float* first, int64_t plane, int64_t splits, int cols, float factor, float* out) {
    for (int d = 0; d < cols; ++d) out[d] = 0.0f;
    for (int64_t s = 0; s < splits; ++s)
        for (int d = 0; d < cols; ++d) out[d] += first[s * plane + d];
    for (int d = 0; d < cols; ++d) out[d] *= factor;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
