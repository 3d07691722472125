// Calls with packed sequences (graphattn/sequences.hpp): checked, cut into
// dense calls of one run of equal-length sequences each and balanced over
// the threads by the work each holds, then run through the kernel table.
#pragma once

#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {

// How a dense call is admitted (its checks, and whether the chosen or forced
// candidate runs it: an error names why not) and run, for each pass.
struct DenseForwardRunner {
    Status (*admit)(const SdpaForwardArgs& args);
    Status (*run)(const SdpaForwardArgs& args);
    std::string (*plan)(const SdpaForwardArgs& args);
};
struct DenseBackwardRunner {
    Status (*admit)(const SdpaBackwardArgs& args);
    Status (*run)(const SdpaBackwardArgs& args);
    std::string (*plan)(const SdpaBackwardArgs& args);
};

// The dense call's window and ALiBi alignment from args.alignment and its
// lengths; as_given leaves them.
SdpaForwardArgs with_alignment_resolved(const SdpaForwardArgs& args);

// Every dense call is admitted before the first one runs, so a call refused
// writes nothing.
Status run_packed_forward(const SdpaForwardArgs& args, const DenseForwardRunner& dense);
Status run_packed_backward(const SdpaBackwardArgs& args, const DenseBackwardRunner& dense);

// The work layout for the verbose log: layout=packed, the counts of dense
// calls run by the whole team and of the tasks pooled one per thread, then
// the plan of the largest dense call.
std::string packed_forward_plan(const SdpaForwardArgs& args, const DenseForwardRunner& dense);
std::string packed_backward_plan(const SdpaBackwardArgs& args, const DenseBackwardRunner& dense);

}  // namespace graphattn
