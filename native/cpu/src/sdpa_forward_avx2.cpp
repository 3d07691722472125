// The forward kernel built for the avx2 target (flags set in CMakeLists.txt).
#define GRAPHATTN_ISA_NS isa_avx2
#include "microkernels_portable.hpp"
#include "sdpa_forward_impl.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
Status sdpa_forward_avx2(const SdpaForwardArgs& args) {
    return isa_avx2::sdpa_forward_impl<isa_avx2::PortableMicroKernels>(args);
}
}  // namespace graphattn
