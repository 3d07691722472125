// The per-ISA builds of the kernels, chosen at run time by dispatch.cpp.
#pragma once

#include "graphattn/sdpa.hpp"

namespace graphattn {

Status sdpa_forward_portable(const SdpaForwardArgs& args);
Status sdpa_backward_portable(const SdpaBackwardArgs& args);
#if defined(GRAPHATTN_HAVE_X86_ISAS)
Status sdpa_forward_avx2(const SdpaForwardArgs& args);
Status sdpa_backward_avx2(const SdpaBackwardArgs& args);
Status sdpa_forward_avx512(const SdpaForwardArgs& args);
Status sdpa_backward_avx512(const SdpaBackwardArgs& args);
// bf16 Q/K/V, or (split) 16-bit floats with f16 among them, each value as two
// bf16 parts.  False, with the outputs unfinished, where split inputs hold an
// infinity (split products cannot keep IEEE semantics).
bool sdpa_forward_amx(const SdpaForwardArgs& args, bool split);
bool sdpa_backward_amx(const SdpaBackwardArgs& args, bool split);  // the same, for Q/K/V/dO
#endif

}  // namespace graphattn
