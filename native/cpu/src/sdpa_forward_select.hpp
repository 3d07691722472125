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

// RVShort < RV adds a middle tier: query blocks of RVShort vectors where they
// leave fewer padding lanes in all than blocks of RV vectors (the rows of a
// block being the query rows of all heads sharing K/V), so that short
// sequences do not fill blocks mostly with padding lanes: 68 rows take three
// blocks of 32 lanes, not two of 64.  16-core Xeon, in-process A/B, f32 GQA
// (1,32,8,Sq,Skv,D) with 68 or 80 rows per K/V head: 1.18-1.26x; (1,4,1,40,
// 4096,128) (160 rows) 1.53x.
//
// Blocks of RV vectors that would leave threads idle even with their keys
// split (few heads, keys too few to split) go in blocks of RVShort too: twice
// the work items for the same lanes or fewer.  16-core Xeon, separate
// processes, two runs: f32 (1,1,1,48,300,80) 1.26-1.77x, (1,8,8,64,768,64)
// 1.49-1.61x, (1,4,4,100,1000,64) 1.49-1.60x, (1,1,1,128,1024,64)
// 1.45-1.50x, causal (1,2,2,250,2048,64) 1.17-1.42x, f16 (1,16,4,16,768,80)
// 1.27-1.31x; where the keys split enough, shorter blocks only read K/V more
// often: (1,8,8,40,1024,128) 0.94x, (1,8,8,64,4096,64) 0.96x.
//
// RowRVMax > 1 gives the row layout the calls of at most RowRVMax vectors of
// rows where the lane layout would leave more than a quarter of its lanes as
// padding (17 rows fill 17 of 32 lanes, 40 rows 40 of 64); it has no padding
// rows.  At full lanes the row layout is the slower (2-core Xeon, one
// thread, (1,4,Sq,768,D): 32 and 64 rows 1.21-1.33x faster in lanes), so it
// takes only the poorly filled blocks: 17-20 rows 1.17-1.23x, 40 rows 1.24x;
// 24 and 48 rows (three quarters) 1.03-1.04x.  Longer GQA groups in even
// row-layout blocks (4 x 17 rows: two of 34 instead of lanes 68 of 96) were
// no steady gain on the 16-core Xeon ((1,32,8,17,Skv,D) 0.97-1.45x, (1,8,2,
// 17,2048,128) 0.80-0.98x).  AVX2's lane blocks won at 16-24 rows (0.62-0.83x
// in rows), so it keeps the row layout to one vector.
//
// The row layout also takes 17-64 rows that fill the lanes well where the
// lane blocks would leave threads idle: it spreads a K/V head's rows over
// several items (LaneForward::plan).  16-core Xeon, separate processes, two
// runs: f32 (1,8,2,8,900,128) 1.81-2.11x, (1,1,1,24,300,80) 1.24-1.66x,
// (1,8,8,24,768,64) 1.21-1.42x, (1,2,2,32,1024,128) 1.25-1.38x,
// (1,16,4,8,300,80) 1.06-1.16x, f16 1.17-1.21x.
//
// Calls visit(DriverTag<the chosen LaneForward>{}) and returns what it returns.
template <int RV, int NT, int NTSingle, int RVShort = RV, int NTShort = NT, int RowRVMax = 1, class Visit>
auto with_forward_driver(const SdpaForwardArgs& args, Visit&& visit) {
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
template <int... Shape>
struct ForwardBuild {
    static Status run(const SdpaForwardArgs& args) {
        return with_forward_driver<Shape...>(args, [&](auto tag) { return decltype(tag)::type::run(args); });
    }
    // The work layout run() takes for these arguments (work_plan_text).
    static std::string describe(const SdpaForwardArgs& args) {
        return with_forward_driver<Shape...>(args, [&](auto tag) { return decltype(tag)::type::describe(args); });
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
