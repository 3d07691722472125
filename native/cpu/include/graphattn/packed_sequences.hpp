// Calls with packed sequences (graphattn/sequences.hpp): checked, cut into
// dense calls of one run of equal-length sequences each and balanced over
// the threads by the work each holds, then run by the caller's dense entry
// point (the CPU kernel table, or the SYCL plugin's launches).
#pragma once

#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {

// How a dense call is admitted (its checks, and whether the chosen or forced
// candidate runs it: an error names why not) and run, for each pass, with
// the entry point's context (the SYCL queue; null on the CPU).  `pooled`:
// small runs may go one per thread at once (CPU threads); else every run is
// one call after another.  `host_fills`: rows of sequences without keys (or
// keys without rows) are written here on the host; else they go to the
// dense calls as sequences of no keys (no rows), which write them (device
// memory the host cannot write).
template <class Args>
struct DenseRunner {
    Status (*admit)(const Args& args, void* context);
    Status (*run)(const Args& args, void* context);
    std::string (*plan)(const Args& args, void* context);
    void* context = nullptr;
    bool pooled = true;
    bool host_fills = true;
};
using DenseForwardRunner = DenseRunner<SdpaForwardArgs>;
using DenseBackwardRunner = DenseRunner<SdpaBackwardArgs>;

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
