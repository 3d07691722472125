// The forward and backward kernels built for the avx512 target (flags set in CMakeLists.txt):
// 16 floats per vector, 4 vectors of query rows per block, 6-wide register tiles
// (2 vectors and 10-wide tiles where those leave fewer padding lanes, 12-wide for one vector of lanes);
// blocks of up to 4 vectors of rows in the row layout where more than a quarter of the lanes would be padding;
// backward blocks of 2 vectors where both sequences fit them.
#define GRAPHATTN_ISA_NS isa_avx512
#define GRAPHATTN_LANES 16
#include "sdpa_backward_select.hpp"
#include "sdpa_forward_select.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
struct ForwardAvx512Shape {
    static constexpr int lane_vectors = 4, tile_width = 6, single_vector_tile_width = 12;
    static constexpr int short_lane_vectors = 2, short_tile_width = 10;
    static constexpr int row_layout_max_vectors = 4;
};
using ForwardAvx512 = isa_avx512::ForwardBuild<ForwardAvx512Shape>;
Status sdpa_forward_avx512(const SdpaForwardArgs& args) { return ForwardAvx512::run(args); }
std::string sdpa_forward_plan_avx512(const SdpaForwardArgs& args) { return ForwardAvx512::describe(args); }
struct BackwardAvx512Shape {
    static constexpr int lane_vectors = 4, tile_width = 6;
    static constexpr int short_lane_vectors = 2, short_tile_width = 10;
};
using BackwardAvx512 = isa_avx512::BackwardBuild<BackwardAvx512Shape>;
Status sdpa_backward_avx512(const SdpaBackwardArgs& args) { return BackwardAvx512::run(args); }
std::string sdpa_backward_plan_avx512(const SdpaBackwardArgs& args) { return BackwardAvx512::describe(args); }
}  // namespace graphattn
