// Splitting the keys among work items where the items alone would leave
// threads idle, merging the splits' partial results by their log-sum-exp,
// and finishing a row from its max and sum: what the lane and AMX forwards
// share.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "block_io.hpp"
#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Keys per split at least: shorter splits cost more in per-item set-up and
// merging than they gain in threads.  The row layout's items (at most 64
// rows, no padding ones) set up and merge little, and where threads idle even
// once their rows are spread over items, they split down to
// kMinRowLayoutKeysPerSplit.
constexpr int64_t kMinKeysPerSplit = 512;
constexpr int64_t kMinRowLayoutKeysPerSplit = 256;

struct KeySplits {
    int64_t count = 1;  // splits of each work item's keys
    int64_t keys = 1;   // keys per split: a multiple of the key block, or all of them in one split
};

// The first `keys` keys in about `count` splits of whole key blocks.
inline KeySplits even_key_splits(int64_t count, int64_t keys, int64_t block) {
    KeySplits s;
    if (count <= 1) {
        s.keys = std::max<int64_t>(keys, 1);
        return s;
    }
    s.keys = round_up((keys + count - 1) / count, block);
    s.count = (keys + s.keys - 1) / s.keys;
    return s;
}

// Splits per item for `items` work items to make about `pieces` pieces of
// work, each split at least min_keys of the `keys` keys long.
inline int64_t key_split_count(int64_t pieces, int64_t items, int64_t keys, int64_t min_keys) {
    return std::max<int64_t>(1, std::min((pieces + items - 1) / items, keys / min_keys));
}

// Splits of the first `keys` keys (those some query row sees) for `items`
// work items on `threads` threads: none where the items fill the threads,
// else about `per_thread` pieces of work per thread, in whole key blocks.
// A single item whose keys come to 1.5 minimum splits but under two
// (768-1023 keys of kMinKeysPerSplit) takes two splits rather than one, since
// alone it leaves every other thread idle (docs/performance-history.md, "Kernel
// internals").
inline KeySplits plan_key_splits(int64_t items, int64_t threads, int64_t per_thread, int64_t keys, int64_t block,
                                 int64_t min_keys = kMinKeysPerSplit) {
    int64_t count = items < threads ? key_split_count(per_thread * threads, items, keys, min_keys) : 1;
    if (items == 1 && count == 1 && threads > 1 && 2 * keys >= 3 * min_keys) count = 2;
    return even_key_splits(count, keys, block);
}

// How many of each work item's key splits have written their partial
// results: the split that writes an item's last one merges the item, so no
// thread waits at a barrier for every split of every item before merging.
class SplitsDone {
public:
    SplitsDone(int64_t items, int64_t splits)
        : splits_(splits), done_(splits > 1 ? new std::atomic<int64_t>[size_t(items)]() : nullptr) {}

    // Called once per (item, split) after its partial is written: whether it was the item's last, and the
    // other splits' partials are visible to this thread (acquire-release on the count).
    bool finishes(int64_t item) { return done_[item].fetch_add(1, std::memory_order_acq_rel) == splits_ - 1; }

private:
    int64_t splits_;
    std::unique_ptr<std::atomic<int64_t>[]> done_;
};

// One row's results merged from `splits` key splits by their log-sum-exp.
// Split s keeps the row's unnormalised output at o + s * split_stride (Dv
// values o_step apart), its running max (base 2) at max_at[s * split_stride]
// and its sum at sum_at[s * split_stride].  The merged output goes to acc
// (Dv values acc_step apart), its max and sum to row_max and row_sum.
inline void merge_split_row(const float* o, int64_t o_step, const float* max_at, const float* sum_at,
                            int64_t split_stride, int64_t splits, int Dv, float* acc, int64_t acc_step,
                            float& row_max, float& row_sum) {
    float m = -__builtin_inff();
    for (int64_t s = 0; s < splits; ++s) m = std::max(m, max_at[s * split_stride]);
    const float base = m == -__builtin_inff() ? 0.0f : m;  // no finite score in any split: every weight 0
    float sum = 0.0f;
    for (int c = 0; c < Dv; ++c) acc[c * acc_step] = 0.0f;
    for (int64_t s = 0; s < splits; ++s) {
        const float weight = std::exp2(max_at[s * split_stride] - base);
        sum += weight * sum_at[s * split_stride];
        if (weight == 0.0f) continue;
        const float* part = o + s * split_stride;
        for (int c = 0; c < Dv; ++c) acc[c * acc_step] += weight * part[c * o_step];
    }
    row_max = m;
    row_sum = sum;
}

// A forward row's output factor and log-sum-exp from its running max (base
// 2) and sum.  sum > 0: a normal row.  sum == 0: every score was masked,
// giving 0 and -inf in SoftMax mode inf_as_zero, NaN otherwise.  NaN: a NaN
// score.  Apart, so that calls without stats take no logarithm (a twentieth
// of f32 (2,16,16,17,17,64)).
inline float row_factor(const SdpaForwardArgs& a, float sum) {
    if (sum > 0.0f) return 1.0f / sum;
    return sum == 0.0f && a.inf_as_zero ? 0.0f : std::nanf("");
}

// A row's running max and sum (base 2) with its sink logit sink2 (base 2)
// folded in (graphattn/score_mods.hpp); out_scale takes the factor its
// unnormalised output needs for the new max.
inline void fold_row_sink(float sink2, float& row_max, float& row_sum, float& out_scale) {
    const SinkFold f = fold_sink(row_max, row_sum, sink2, [](float x) { return std::exp2(x); });
    row_max = f.max;
    row_sum = f.sum;
    out_scale = f.output_factor;
}

inline float row_lse(const SdpaForwardArgs& a, float row_max, float sum) {
    if (sum > 0.0f) return row_max * kLn2 + std::log(sum);
    return sum == 0.0f && a.inf_as_zero ? -__builtin_inff() : std::nanf("");
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
