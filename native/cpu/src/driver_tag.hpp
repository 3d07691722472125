// A kernel driver type as a value, for the visitors that the forward and
// backward selectors (sdpa_*_select.hpp) call with their choice: running it
// and describing its plan for the verbose log take the same choice.
#pragma once

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <class Driver>
struct DriverTag {
    using type = Driver;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
