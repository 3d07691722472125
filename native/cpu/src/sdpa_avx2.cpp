// The forward and backward kernels built for the avx2 target (flags set in CMakeLists.txt):
// 8 floats per vector, 3 vectors of query rows per block, 4-wide register tiles
// (8-wide for one vector of lanes).
#define GRAPHATTN_ISA_NS isa_avx2
#define GRAPHATTN_LANES 8
#include "sdpa_backward_select.hpp"
#include "sdpa_forward_select.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
struct ForwardAvx2Shape {
    static constexpr int lane_vectors = 3, tile_width = 4, single_vector_tile_width = 8;
    static constexpr int short_lane_vectors = 3, short_tile_width = 4;
    static constexpr int row_layout_max_vectors = 1;
};
using ForwardAvx2 = isa_avx2::ForwardBuild<ForwardAvx2Shape>;
Status sdpa_forward_avx2(const SdpaForwardArgs& args) { return ForwardAvx2::run(args); }
std::string sdpa_forward_plan_avx2(const SdpaForwardArgs& args) { return ForwardAvx2::describe(args); }
struct BackwardAvx2Shape {
    static constexpr int lane_vectors = 3, tile_width = 4;
    static constexpr int short_lane_vectors = 3, short_tile_width = 4;
};
using BackwardAvx2 = isa_avx2::BackwardBuild<BackwardAvx2Shape>;
Status sdpa_backward_avx2(const SdpaBackwardArgs& args) { return BackwardAvx2::run(args); }
std::string sdpa_backward_plan_avx2(const SdpaBackwardArgs& args) { return BackwardAvx2::describe(args); }
}  // namespace graphattn
