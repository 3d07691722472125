// Picks the forward driver for one ISA build: the lane layout for query
// blocks that fill the vector lanes, the row layout for query sequences of
// at most one vector (decode) that would leave most lanes idle.
#pragma once

#include "block_io.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_forward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// RVShort < RV adds a middle tier: query blocks of RVShort vectors where they
// leave fewer padding lanes in all than blocks of RV vectors (the rows of a
// block being the query rows of all heads sharing K/V), so that short
// sequences do not fill blocks mostly with padding lanes: 68 rows take three
// blocks of 32 lanes, not two of 64.  16-core Xeon, in-process A/B, f32 GQA
// (1,32,8,Sq,Skv,D) with 68 or 80 rows per K/V head: 1.18-1.26x; (1,4,1,40,
// 4096,128) (160 rows) 1.53x.
template <int RV, int NT, int NTSingle, int RVShort = RV, int NTShort = NT>
Status sdpa_forward_for_isa(const SdpaForwardArgs& args) {
    int64_t group;
    find_shared_dim(args, group);
    const int64_t rows = group * args.seq_q;
    if (rows <= kLanes) return LaneForward<1, NTSingle>::run(args);
    if constexpr (RVShort < RV) {
        const int64_t short_lanes = round_up(rows, int64_t(RVShort) * kLanes);
        if (short_lanes < round_up(rows, int64_t(RV) * kLanes)) return LaneForward<RVShort, NTShort>::run(args);
    }
    return LaneForward<RV, NT>::run(args);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
