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

// A vector build's backward block shapes: lane blocks of `lane_vectors`
// vectors with register tiles `tile_width` wide, or of `short_lane_vectors`
// where both sequences fit them (17 keys fill 17 of 32 lanes, not 17 of 64;
// docs/performance-history.md, "Block shapes").
// `Shape` names them (each build's .cpp defines all four): lane_vectors,
// tile_width, short_lane_vectors (= lane_vectors: no short tier) and
// short_tile_width.

template <class Shape, class Visit>
auto with_backward_driver(const SdpaBackwardArgs& args, Visit&& visit) {
    constexpr int RV = Shape::lane_vectors, NT = Shape::tile_width;
    constexpr int RVShort = Shape::short_lane_vectors, NTShort = Shape::short_tile_width;
    if constexpr (RVShort < RV) {
        const SdpaForwardArgs& a = args.forward;
        if (std::max(a.seq_q, a.seq_kv) <= RVShort * kLanes)
            return visit(DriverTag<LaneBackward<RVShort, NTShort>>{});
    }
    return visit(DriverTag<LaneBackward<RV, NT>>{});
}

// One ISA build's backward, its block shapes given once (see with_backward_driver).
template <class Shape>
struct BackwardBuild {
    static Status run(const SdpaBackwardArgs& args) {
        return with_backward_driver<Shape>(args, [&](auto tag) { return decltype(tag)::type::run(args); });
    }
    // The key pass's layout run() takes for these arguments (key_pass_text).
    static std::string describe(const SdpaBackwardArgs& args) {
        return with_backward_driver<Shape>(args, [&](auto tag) { return decltype(tag)::type::describe(args); });
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
