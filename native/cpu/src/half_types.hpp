// Conversions between f32 and the 16-bit float formats (bf16, IEEE f16),
// round-to-nearest-even, NaN preserved.  F16C instructions where the
// translation unit is built with them, bit arithmetic otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

inline float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

inline uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

#if defined(__AVX512F__)
// 16 bf16 values as f32: the same widening shift, by vector.
inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

inline uint16_t f32_to_bf16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0) {
        const float magnitude = float(mantissa) * 5.9604644775390625e-08f;  // 2^-24
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u = float_to_bits(f);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u));
    if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
    if (u < 0x38800000u) {                                   // f16 subnormal or zero
        const float scaled = std::nearbyint(bits_to_float(u) * 16777216.0f);  // * 2^24
        return uint16_t(sign | uint16_t(scaled));
    }
    u += 0xfffu + ((u >> 13) & 1u);
    return uint16_t(sign | ((u - 0x38000000u) >> 13));
#endif
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
