// The per-ISA builds of the kernels, chosen at run time by dispatch.cpp.
#pragma once

#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {

// sdpa_forward_plan_* and sdpa_backward_plan_*: the work layout the build
// takes for these arguments (work_order.hpp's work_plan_text and
// key_pass_text), for the verbose log.
Status sdpa_forward_portable(const SdpaForwardArgs& args);
std::string sdpa_forward_plan_portable(const SdpaForwardArgs& args);
Status sdpa_backward_portable(const SdpaBackwardArgs& args);
std::string sdpa_backward_plan_portable(const SdpaBackwardArgs& args);
// grad_sinks of a backward call with sinks (sink_gradients.hpp), for every kernel family.
void sdpa_sink_gradients(const SdpaBackwardArgs& args);
#if defined(GRAPHATTN_HAVE_X86_ISAS)
Status sdpa_forward_avx2(const SdpaForwardArgs& args);
std::string sdpa_forward_plan_avx2(const SdpaForwardArgs& args);
Status sdpa_backward_avx2(const SdpaBackwardArgs& args);
std::string sdpa_backward_plan_avx2(const SdpaBackwardArgs& args);
Status sdpa_forward_avx512(const SdpaForwardArgs& args);
std::string sdpa_forward_plan_avx512(const SdpaForwardArgs& args);
Status sdpa_backward_avx512(const SdpaBackwardArgs& args);
std::string sdpa_backward_plan_avx512(const SdpaBackwardArgs& args);
// Q/K/V with each value as `parts` bf16 parts (amx_split.hpp): 1 for bf16
// inputs, 2 for 16-bit floats with f16 among them, 3 for inputs with f32
// among them.  False, with the outputs unfinished, where split inputs hold an
// infinity (split products cannot keep IEEE semantics).
bool sdpa_forward_amx(const SdpaForwardArgs& args, int parts);
std::string sdpa_forward_plan_amx(const SdpaForwardArgs& args, int parts);
// The same for Q/K/V/dO, with 1 or 2 parts (f32 stays on the vector build:
// its five products at six tile products each are slower than the FMAs).
bool sdpa_backward_amx(const SdpaBackwardArgs& args, int parts);
std::string sdpa_backward_plan_amx(const SdpaBackwardArgs& args);
// Query rows per work item of sdpa_forward_amx for f32 inputs with these
// arguments on omp_get_max_threads() threads (data is not read).
int64_t sdpa_forward_amx_item_rows(const SdpaForwardArgs& args);
#endif

}  // namespace graphattn
