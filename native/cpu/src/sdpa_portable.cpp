// The forward and backward kernels built for the portable target (flags set in CMakeLists.txt):
// 4 floats per vector, 3 vectors of query rows per block, 4-wide register tiles
// (8-wide for one vector of lanes).
#define GRAPHATTN_ISA_NS isa_portable
#define GRAPHATTN_LANES 4
#include "sdpa_backward_select.hpp"
#include "sdpa_forward_select.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
using ForwardPortable = isa_portable::ForwardBuild<3, 4, 8>;
Status sdpa_forward_portable(const SdpaForwardArgs& args) { return ForwardPortable::run(args); }
std::string sdpa_forward_plan_portable(const SdpaForwardArgs& args) { return ForwardPortable::describe(args); }
using BackwardPortable = isa_portable::BackwardBuild<3, 4>;
Status sdpa_backward_portable(const SdpaBackwardArgs& args) { return BackwardPortable::run(args); }
std::string sdpa_backward_plan_portable(const SdpaBackwardArgs& args) { return BackwardPortable::describe(args); }
}  // namespace graphattn
