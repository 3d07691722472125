// The kernel candidates of each pass, tried in order (dispatch.cpp): the
// first that accepts a call runs it.  A candidate may also be forced for
// every later call of its pass in this process (tests, timing one kernel
// against another).
#pragma once

#include <cstdint>
#include <string>

#include "graphattn/sdpa.hpp"

namespace graphattn {

enum class Pass : int32_t { forward = 0, backward = 1 };

// How a candidate meets a call: what it can run, and whether it is the faster.
enum class Fit : int32_t {
    other_dtype = 0,  // built for another dtype class
    cannot = 1,       // this CPU or a requested feature rules it out
    slower = 2,       // it can run the call, but a measured rule prefers a later candidate
    accepts = 3,
};

// A candidate's answer to one call, with the rule that gave it (no commas:
// the verbose log is comma-separated).  The text lives as long as the
// library: reasons are built once, so that choosing costs no allocation.
struct Verdict {
    Fit fit = Fit::cannot;
    const char* reason = "";
    bool runs() const { return fit == Fit::slower || fit == Fit::accepts; }
};

// The candidates of a pass, in the order they are tried.
int kernel_candidate_count(Pass pass);
const char* kernel_candidate_name(Pass pass, int index);

// "" where the candidate can run on this CPU (for some call), else why not.
std::string kernel_candidate_unavailable(Pass pass, int index);

// Each candidate's verdict on a call, in table order.
Verdict forward_candidate_verdict(int index, const SdpaForwardArgs& args);
Verdict backward_candidate_verdict(int index, const SdpaBackwardArgs& args);

// Forces the named candidate on every later call of the pass in this process
// ("" restores the automatic choice).  A forced candidate runs calls that a
// speed rule would give to another (Fit::slower); a call it cannot run fails
// with a message naming it.  Errors: an unknown name, or a candidate this CPU
// cannot run.
Status force_kernel(Pass pass, const std::string& name);

// The forced candidate's name, or "" when the choice is automatic.
std::string forced_kernel(Pass pass);

}  // namespace graphattn
