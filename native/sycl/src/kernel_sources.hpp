// The SYCL kernel sources, embedded at build time from native/sycl/kernels
// (and the headers they include), for the runtime compiler.
#pragma once

namespace graphattn {
namespace sycl_plugin {

struct SourceFile {
    const char* name;  // as #included, e.g. "sdpa_device.hpp" or "graphattn/philox.hpp"
    const char* text;
};

// Every embedded file; the list ends with {nullptr, nullptr}.
extern const SourceFile kKernelSources[];

// The text of one embedded file, or nullptr.
const char* kernel_source(const char* name);

}  // namespace sycl_plugin
}  // namespace graphattn
