// The order in which the kernels hand out their (batch index, block) work
// items to dynamically scheduled threads.
//
// Under a causal mask the blocks of one batch index differ in work (query
// blocks lower down see more keys; key blocks further left are seen by more
// query rows).  Handing out every batch index's longest block first, then
// every second longest, and so on, leaves the short items for last, where
// they even out the threads' finishing times; going batch index by batch
// index instead would end on some long items.  For 16 batch indices of 8
// query blocks on 16 threads, that order's last thread finishes about 11%
// after the average.
#pragma once

#include <cstdint>

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

struct WorkItem {
    int64_t batch;  // flat batch index
    int64_t rank;   // the block's place by work: 0 has the most (when unequal_work)
};

// Item w of batches x blocks items.  Without unequal_work, batch-major with
// rank = block order.
inline WorkItem work_item(int64_t w, int64_t batches, int64_t blocks, bool unequal_work) {
    if (unequal_work) return {w % batches, w / batches};
    return {w / blocks, w % blocks};
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
