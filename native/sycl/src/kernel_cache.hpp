// Runtime-compiled kernels: one executable bundle per (device, context,
// source, build options), built on first use and kept for the process.
#pragma once

#include <sycl/sycl.hpp>

#include <string>
#include <vector>

namespace graphattn {
namespace sycl_plugin {

struct KernelVariant {
    std::string source;                // an embedded file, e.g. "sdpa_forward.cpp"
    std::vector<std::string> options;  // -D build options
};

// The bundle of `variant` for the queue's device, built if not yet built.
// Throws sycl::exception with the compiler's log when the build fails; a failed
// variant is remembered and throws the same error again without rebuilding.
sycl::kernel_bundle<sycl::bundle_state::executable>& kernel_bundle_for(sycl::queue& queue,
                                                                             const KernelVariant& variant);

// A kernel of that bundle by its extern "C" name; has_kernel false (and an
// empty optional kernel) when the device dropped it.
bool bundle_has_kernel(sycl::kernel_bundle<sycl::bundle_state::executable>& bundle, const char* name);

int64_t build_count();
double build_seconds();

}  // namespace sycl_plugin
}  // namespace graphattn
