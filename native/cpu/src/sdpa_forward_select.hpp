// Picks the forward driver for one ISA build: the lane layout for query
// blocks that fill the vector lanes, the row layout for query sequences of
// at most one vector (decode) and, where the build allows, for short blocks
// that would leave many lanes idle.
#pragma once

#include <string>

#include "block_io.hpp"
#include "driver_tag.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "sdpa_forward_lanes.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// A vector build's forward block shapes, in vectors of query rows (lanes)
// and register-tile widths (keys per tile).  `short_*` adds a middle tier
// of shorter lane blocks where they leave fewer padding lanes in all than
// full ones (68 rows take three blocks of 32 lanes, not two of 64; the rows
// of a block are the query rows of every head sharing K/V), or where full
// blocks would leave threads idle even with their keys split.  Up to
// `row_layout_max_vectors` vectors of rows go to the row layout (no padding
// rows) where lane blocks would leave more than a quarter of their lanes as
// padding, or threads idle.  docs/performance-history.md, "Block shapes", has the
// measurements behind each tier.
// `Shape` names them (each build's .cpp defines all six):
//   lane_vectors, tile_width: the lane blocks' vectors of query rows and the
//     keys per register tile;
//   single_vector_tile_width: the tile width of blocks of one vector (decode);
//   short_lane_vectors, short_tile_width: the middle tier (short_lane_vectors
//     = lane_vectors: none);
//   row_layout_max_vectors: the most vectors of rows the row layout takes
//     (1: only calls of at most one vector).

template <class Shape, class Visit>
auto with_forward_driver(const SdpaForwardArgs& args, Visit&& visit) {
    constexpr int RV = Shape::lane_vectors, NT = Shape::tile_width, NTSingle = Shape::single_vector_tile_width;
    constexpr int RVShort = Shape::short_lane_vectors, NTShort = Shape::short_tile_width;
    constexpr int RowRVMax = Shape::row_layout_max_vectors;
    int64_t group;
    find_shared_dim(args, group);
    const int64_t rows = group * args.seq_q;
    if (rows <= kLanes) return visit(DriverTag<LaneForward<1, NTSingle>>{});
    const int64_t threads = omp_get_max_threads();
    const int64_t lanes = std::min(round_up(rows, int64_t(RVShort) * kLanes), round_up(rows, int64_t(RV) * kLanes));
    auto idles_threads = [&](const LanePlan& p) { return p.outer_items * p.splits < threads; };
    bool short_blocks = false;
    if constexpr (RVShort < RV)
        short_blocks = lanes < round_up(rows, int64_t(RV) * kLanes) || idles_threads(LaneForward<RV, NT>::plan(args));
    if constexpr (RowRVMax > 1) {
        if (rows <= RowRVMax * kLanes &&
            (4 * rows < 3 * lanes || idles_threads(short_blocks ? LaneForward<RVShort, NTShort>::plan(args)
                                                                : LaneForward<RV, NT>::plan(args)))) {
            if (rows <= 2 * kLanes) return visit(DriverTag<LaneForward<2, NTSingle, true>>{});
            if constexpr (RowRVMax > 2) {
                if (rows <= 3 * kLanes) return visit(DriverTag<LaneForward<3, NTSingle, true>>{});
                return visit(DriverTag<LaneForward<4, NTSingle, true>>{});
            }
        }
    }
    if (short_blocks) return visit(DriverTag<LaneForward<RVShort, NTShort>>{});
    return visit(DriverTag<LaneForward<RV, NT>>{});
}

// One ISA build's forward, its block shapes given once (see with_forward_driver).
template <class Shape>
struct ForwardBuild {
    static Status run(const SdpaForwardArgs& args) {
        return with_forward_driver<Shape>(args, [&](auto tag) { return decltype(tag)::type::run(args); });
    }
    // The work layout run() takes for these arguments (work_plan_text).
    static std::string describe(const SdpaForwardArgs& args) {
        return with_forward_driver<Shape>(args, [&](auto tag) { return decltype(tag)::type::describe(args); });
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
