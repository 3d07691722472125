// Picks the backward driver for one ISA build: lane blocks of RV vectors, or
// of RVShort vectors for short sequences.
#pragma once

#include <algorithm>
#include <string>

#include "driver_tag.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_backward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Calls whose query and key lengths both fit RVShort vectors take lane blocks
// of RVShort vectors: 17 keys fill 17 of 32 lanes instead of 17 of 64.
// 16-core Xeon, separate processes, medians of three, Sq = Skv = 17-32:
// 1.05-1.42x ((1,8,8,32,32,128) 1.42x, (1,32,8,17,17,80) 1.17x).
//
// Calls visit(DriverTag<the chosen LaneBackward>{}) and returns what it returns.
template <int RV, int NT, int RVShort = RV, int NTShort = NT, class Visit>
auto with_backward_driver(const SdpaBackwardArgs& args, Visit&& visit) {
    if constexpr (RVShort < RV) {
        const SdpaForwardArgs& a = args.forward;
        if (std::max(a.seq_q, a.seq_kv) <= RVShort * kLanes)
            return visit(DriverTag<LaneBackward<RVShort, NTShort>>{});
    }
    return visit(DriverTag<LaneBackward<RV, NT>>{});
}

// One ISA build's backward, its block shapes given once (see with_backward_driver).
template <int... Shape>
struct BackwardBuild {
    static Status run(const SdpaBackwardArgs& args) {
        return with_backward_driver<Shape...>(args, [&](auto tag) { return decltype(tag)::type::run(args); });
    }
    // The key pass's layout run() takes for these arguments (key_pass_text).
    static std::string describe(const SdpaBackwardArgs& args) {
        return with_backward_driver<Shape...>(args, [&](auto tag) { return decltype(tag)::type::describe(args); });
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
