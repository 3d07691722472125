// Picks the forward driver for one ISA build: the lane layout for query
// blocks that fill the vector lanes, the row layout for short query
// sequences (decode) that would leave most lanes idle.
#pragma once

#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_forward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <int RV, int NT, int NTShort>
Status sdpa_forward_for_isa(const SdpaForwardArgs& args) {
    int64_t group;
    find_shared_dim(args, group);
    if (group * args.seq_q <= kLanes) return LaneForward<1, NTShort>::run(args);
    return LaneForward<RV, NT>::run(args);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
