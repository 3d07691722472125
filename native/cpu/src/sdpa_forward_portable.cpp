// The forward kernel built for the portable target (flags set in CMakeLists.txt).
#define GRAPHATTN_ISA_NS isa_portable
#include "microkernels_portable.hpp"
#include "sdpa_forward_impl.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
Status sdpa_forward_portable(const SdpaForwardArgs& args) {
    return isa_portable::sdpa_forward_impl<isa_portable::PortableMicroKernels>(args);
}
}  // namespace graphattn
