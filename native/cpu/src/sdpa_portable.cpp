// The forward and backward kernels built for the portable target (flags set in CMakeLists.txt):
// 4 floats per vector, 3 vectors of query rows per block, 4-wide register tiles
// (8-wide for one vector of lanes).
#define GRAPHATTN_ISA_NS isa_portable
#define GRAPHATTN_LANES 4
#include "sdpa_backward_select.hpp"
#include "sdpa_forward_select.hpp"
#include "isa_entry_points.hpp"
#include "sink_gradients.hpp"

namespace graphattn {
struct ForwardPortableShape {
    static constexpr int lane_vectors = 3, tile_width = 4, single_vector_tile_width = 8;
    static constexpr int short_lane_vectors = 3, short_tile_width = 4;
    static constexpr int row_layout_max_vectors = 1;
};
using ForwardPortable = isa_portable::ForwardBuild<ForwardPortableShape>;
Status sdpa_forward_portable(const SdpaForwardArgs& args) { return ForwardPortable::run(args); }
std::string sdpa_forward_plan_portable(const SdpaForwardArgs& args) { return ForwardPortable::describe(args); }
struct BackwardPortableShape {
    static constexpr int lane_vectors = 3, tile_width = 4;
    static constexpr int short_lane_vectors = 3, short_tile_width = 4;
};
using BackwardPortable = isa_portable::BackwardBuild<BackwardPortableShape>;
Status sdpa_backward_portable(const SdpaBackwardArgs& args) { return BackwardPortable::run(args); }
std::string sdpa_backward_plan_portable(const SdpaBackwardArgs& args) { return BackwardPortable::describe(args); }
void sdpa_sink_gradients(const SdpaBackwardArgs& args) { isa_portable::sink_gradients(args); }
}  // namespace graphattn
