// exp(x) for softmax in a form compilers vectorise: Cody-Waite range
// reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, and the exponent
// built from integer bits.  The truncated Taylor series errs by at most
// r^7/7! < 1.3e-7 relative on that interval.  exp(-inf) = 0 exactly
// (masked scores) and NaN stays NaN (a NaN input row must not become 0).
#pragma once

#include <cstdint>
#include <cstring>

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

inline float fast_exp(float x) {
    constexpr float kLog2e = 1.44269504088896341f;
    constexpr float kLn2Hi = 0.693145751953125f;
    constexpr float kLn2Lo = 1.428606765330187e-06f;
    constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
    constexpr float kLowest = -87.0f;           // below this exp(x) is subnormal: give 0
    constexpr float kHighest = 88.0f;

    float clamped = x < kLowest ? kLowest : x;  // comparisons keep NaN as it is
    clamped = clamped > kHighest ? kHighest : clamped;
    const float k = (clamped * kLog2e + kRoundMagic) - kRoundMagic;
    const float r = (clamped - k * kLn2Hi) - k * kLn2Lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t exponent_bits = uint32_t(int32_t(k) + 127) << 23;
    float two_to_k;
    std::memcpy(&two_to_k, &exponent_bits, sizeof two_to_k);
    const float result = p * two_to_k;
    return x < kLowest ? 0.0f : result;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
