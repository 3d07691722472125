// The forward kernel built for the avx512 target (flags set in CMakeLists.txt).
#define GRAPHATTN_ISA_NS isa_avx512
#include "microkernels_portable.hpp"
#include "sdpa_forward_impl.hpp"
#include "isa_entry_points.hpp"

namespace graphattn {
Status sdpa_forward_avx512(const SdpaForwardArgs& args) {
    return isa_avx512::sdpa_forward_impl<isa_avx512::PortableMicroKernels>(args);
}
}  // namespace graphattn
