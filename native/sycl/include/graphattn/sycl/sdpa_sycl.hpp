// graphattn SYCL plugin: the fused SDPA kernels on a SYCL queue.
//
// Calls take the same argument structs as the CPU kernels (graphattn/sdpa.hpp),
// with USM pointers, and a `sycl::queue*` passed as void* (what dpctl's
// DPCTLSyclQueueRef is), so that callers need no SYCL headers.  Kernels are
// SYCL sources compiled at run time for the queue's device, once per
// (device, variant) in a process, and on disk by the SYCL runtime's
// persistent cache when SYCL_CACHE_PERSISTENT=1.  Launches are asynchronous:
// they wait for the work already on the queue and later work waits for them.
#pragma once

#include <cstdint>
#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {
namespace sycl_plugin {

constexpr int kMaxHeadDim = 512;

// Forward (inference or training, stats written when args.stats.data is set).
Status sdpa_forward(void* queue, const SdpaForwardArgs& args);

// Backward; allocates B * Sq floats of device memory for the call, freed when it ends.
Status sdpa_backward(void* queue, const SdpaBackwardArgs& args);

// When the forward runs the XMX (joint_matrix) kernel for bf16/f16 inputs
// with at least 8 query rows: Auto on devices with the ext_intel_matrix
// aspect (Intel GPUs with XMX; the OpenCL CPU device reports it on CPUs with
// AMX) whose compiler keeps the kernel; Force on any device whose compiler
// keeps it; Off never.  Process-wide, read at each launch; Auto at start.
enum class MatrixKernels { Auto = 0, Force = 1, Off = 2 };
void set_matrix_kernels(MatrixKernels policy);
MatrixKernels matrix_kernels();

// Name of the kernel sdpa_forward runs for these arguments on this queue's
// device: "xmx", or "subgroup (reason)".  May build the XMX kernel to decide.
std::string sdpa_forward_kernel(void* queue, const SdpaForwardArgs& args);

// Builds (or finds) the forward and, with backward, the backward kernels for
// inputs of this dtype and these head sizes; seconds receives the time taken.
Status prebuild(void* queue, DType input_dtype, int head_dim_qk, int head_dim_v, bool backward, double* seconds);

// Builds the XMX (joint_matrix) sources for the queue's device; ok when they
// compile.  has_kernel tells whether the device kept the kernel (devices
// without matrix hardware drop it).
Status build_xmx_sources(void* queue, bool* has_kernel);

// Kernel builds done so far in this process, and the seconds they took.
int64_t builds_done();
double build_seconds_total();

}  // namespace sycl_plugin
}  // namespace graphattn
