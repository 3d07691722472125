// A fixed-width float vector for the kernels, written with GCC/Clang vector
// extensions so one source serves every ISA build: each translation unit sets
// GRAPHATTN_LANES to the width its -m flags make native (16 for AVX-512,
// 8 for AVX2, 4 for the portable SSE2/NEON baseline) and the compiler maps
// the operations onto those registers.
#pragma once

#include <cstdint>
#include <cstring>

#include "isa_namespace.hpp"

#ifndef GRAPHATTN_LANES
#error "define GRAPHATTN_LANES (floats per vector register) before including simd.hpp"
#endif

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

constexpr int kLanes = GRAPHATTN_LANES;

typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline VecF load(const float* p) {
    VecF v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }

inline VecF splat(float x) { return VecF{} + x; }

// Lane index 0, 1, ..., kLanes - 1 as floats (for per-lane row numbers).
inline VecF lane_index() {
    VecF v;
    for (int i = 0; i < kLanes; ++i) v[i] = float(i);
    return v;
}

// max that ignores a NaN in `x` (comparison with NaN is false), so a NaN
// score never hides the running maximum; NaN still reaches the row sum.
inline VecF max_ignoring_nan(VecF x, VecF m) { return x > m ? x : m; }

inline float horizontal_max(VecF v) {
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

// exp(x) per lane; the vector twin of fast_exp (same reduction, same
// polynomial, same bound), with exp(-inf) = 0 and NaN kept.
inline VecF vexp(VecF x) {
    const VecF lowest = splat(-87.0f), highest = splat(88.0f);
    VecF c = x < lowest ? lowest : x;
    c = c > highest ? highest : c;
    const VecF round_magic = splat(12582912.0f);
    const VecF k = (c * 1.44269504088896341f + round_magic) - round_magic;
    const VecF r = (c - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
    VecF p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const VecI bits = (__builtin_convertvector(k, VecI) + 127) << 23;
    VecF two_to_k;
    std::memcpy(&two_to_k, &bits, sizeof two_to_k);
    const VecF result = p * two_to_k;
    return x < lowest ? VecF{} : result;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
