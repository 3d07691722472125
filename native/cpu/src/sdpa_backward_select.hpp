// Picks the backward driver for one ISA build: lane blocks of RV vectors, or
// of RVShort vectors for short sequences.
#pragma once

#include <algorithm>

#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_backward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Calls whose query and key lengths both fit RVShort vectors take lane blocks
// of RVShort vectors: 17 keys fill 17 of 32 lanes instead of 17 of 64.
// 16-core Xeon, separate processes, medians of three, Sq = Skv = 17-32:
// 1.05-1.42x ((1,8,8,32,32,128) 1.42x, (1,32,8,17,17,80) 1.17x).
template <int RV, int NT, int RVShort = RV, int NTShort = NT>
Status sdpa_backward_for_isa(const SdpaBackwardArgs& args) {
    if constexpr (RVShort < RV) {
        const SdpaForwardArgs& a = args.forward;
        if (std::max(a.seq_q, a.seq_kv) <= RVShort * kLanes) return LaneBackward<RVShort, NTShort>::run(args);
    }
    return LaneBackward<RV, NT>::run(args);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
