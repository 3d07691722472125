// Picks the forward driver for one ISA build: the lane layout for query
// blocks that fill the vector lanes, the row layout for query sequences of
// at most one vector (decode) that would leave most lanes idle.
#pragma once

#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_forward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// RVShort < RV adds a middle tier: query blocks of RVShort vectors where the
// rows of a block (the query rows of all heads sharing K/V) fit in them, so
// that short sequences do not fill blocks mostly with padding lanes.
template <int RV, int NT, int NTSingle, int RVShort = RV, int NTShort = NT>
Status sdpa_forward_for_isa(const SdpaForwardArgs& args) {
    int64_t group;
    find_shared_dim(args, group);
    const int64_t rows = group * args.seq_q;
    if (rows <= kLanes) return LaneForward<1, NTSingle>::run(args);
    if constexpr (RVShort < RV) {
        if (rows <= RVShort * kLanes) return LaneForward<RVShort, NTShort>::run(args);
    }
    return LaneForward<RV, NT>::run(args);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
