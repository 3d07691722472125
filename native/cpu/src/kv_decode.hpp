// Decoding one group of a quantized row (graphattn/kv_format.hpp) with the
// ISA's vectors: out[c] = (q[c] - z) * s for the integer formats, q - z
// exact, so one rounding as the rule's; the scalar loop takes what the
// vectors leave and the portable build.  The reader (kv_reader.hpp) calls it
// per group.
#pragma once

#include <cstdint>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "graphattn/kv_format.hpp"
#include "half_types.hpp"
#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

#if defined(__AVX2__) || defined(__AVX512F__)
// Bytes widened to 16-bit lanes as their nibbles, one byte each: each byte's low nibble, then its high one.
inline __m128i nibble_bytes(__m128i widened) {
    return _mm_or_si128(_mm_and_si128(widened, _mm_set1_epi16(15)), _mm_slli_epi16(_mm_srli_epi16(widened, 4), 8));
}
#endif

#if defined(__AVX512F__)
// 16 stored integers of columns c0 .. c0 + 16 as f32 (c0 even for 4 bits).
template <KvFormat F>
inline __m512 stored_x16(const uint8_t* row, int c0) {
    if constexpr (F == KvFormat::u8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0))));
    } else if constexpr (F == KvFormat::s8) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0))));
    } else if constexpr (F == KvFormat::s4_in_byte) {  // the low nibble, sign-extended
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c0)));
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 28), 28));
    } else {  // u4, s4: 8 bytes, each one's low nibble before its high one
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c0 / 2)));
        __m512i q = _mm512_cvtepu8_epi32(nibble_bytes(b));
        if constexpr (F == KvFormat::s4)
            q = _mm512_sub_epi32(_mm512_xor_si512(q, _mm512_set1_epi32(8)), _mm512_set1_epi32(8));
        return _mm512_cvtepi32_ps(q);
    }
}
#elif defined(__AVX2__)
// 8 stored integers of columns c0 .. c0 + 8 as f32 (c0 even for 4 bits).
template <KvFormat F>
inline __m256 stored_x8(const uint8_t* row, int c0) {
    if constexpr (F == KvFormat::u8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c0))));
    } else if constexpr (F == KvFormat::s8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c0))));
    } else if constexpr (F == KvFormat::s4_in_byte) {  // the low nibble, sign-extended
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c0)));
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(q, 28), 28));
    } else {  // u4, s4: 4 bytes, each one's low nibble before its high one
        int32_t word;
        __builtin_memcpy(&word, row + c0 / 2, 4);
        const __m128i b = _mm_cvtepu8_epi16(_mm_cvtsi32_si128(word));
        __m256i q = _mm256_cvtepu8_epi32(nibble_bytes(b));
        if constexpr (F == KvFormat::s4)
            q = _mm256_sub_epi32(_mm256_xor_si256(q, _mm256_set1_epi32(8)), _mm256_set1_epi32(8));
        return _mm256_cvtepi32_ps(q);
    }
}
#endif

// out[c] = (q(c0 + c) - z) * s for c < n, columns of a row of adjacent values (bytes; 4 bits: n and c0 even).
template <KvFormat F>
inline void decode_group(const uint8_t* row, int c0, int n, float s, float z, float* out) {
    int c = 0;
#if defined(__AVX512F__)
    const __m512 zv = _mm512_set1_ps(z), sv = _mm512_set1_ps(s);
    for (; c + 16 <= n; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_sub_ps(stored_x16<F>(row, c0 + c), zv), sv));
#elif defined(__AVX2__)
    const __m256 zv = _mm256_set1_ps(z), sv = _mm256_set1_ps(s);
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_sub_ps(stored_x8<F>(row, c0 + c), zv), sv));
#endif
    for (; c < n; ++c) out[c] = (float(kv_stored_int(F, row, c0 + c)) - z) * s;
}

// A row of `groups` groups of G adjacent values: group g's scale scales[g], its zero point zeros[g] (f32).
template <KvFormat F>
inline void decode_groups(const uint8_t* row, int groups, int G, const float* scales, const float* zeros, float* out) {
    for (int g = 0; g < groups; ++g) decode_group<F>(row, g * G, G, scales[g], zeros[g], out + g * G);
}

// The same by a format known at run time: one switch a row.
inline void decode_groups(KvFormat f, const uint8_t* row, int groups, int G, const float* scales, const float* zeros,
                          float* out) {
    switch (f) {
        case KvFormat::u8: return decode_groups<KvFormat::u8>(row, groups, G, scales, zeros, out);
        case KvFormat::s8: return decode_groups<KvFormat::s8>(row, groups, G, scales, zeros, out);
        case KvFormat::u4: return decode_groups<KvFormat::u4>(row, groups, G, scales, zeros, out);
        case KvFormat::s4: return decode_groups<KvFormat::s4>(row, groups, G, scales, zeros, out);
        case KvFormat::s4_in_byte: return decode_groups<KvFormat::s4_in_byte>(row, groups, G, scales, zeros, out);
        default: return;
    }
}

#if defined(__AVX512F__)
// 16 fp8 bytes as f32, by way of f16: each byte becomes an f16 whose value is the f8's (e5m2: its high byte,
// exactly; e4m3: sign, then the 7 other bits shifted into the f16's, which scales every value, subnormals
// included, by 2^-8 (kFp8E4m3Unscale undoes it); its NaN codes S.1111.111 set apart).
template <KvFormat F>
inline __m512 fp8_x16(const uint8_t* bytes) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    if constexpr (F == KvFormat::fp8_e5m2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(low7, 7));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(low7, _mm256_set1_epi16(0x7f));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(__builtin_nanf("")));
}
#elif defined(__AVX2__) && defined(__F16C__)
// 8 fp8 bytes as f32, as fp8_x16 does 16.
template <KvFormat F>
inline __m256 fp8_x8(const uint8_t* bytes) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
    if constexpr (F == KvFormat::fp8_e5m2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    const __m128i low7 = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(low7, 7));
    const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f)));
    return _mm256_blendv_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(nan));
}
#endif

// What the vector decoding of e4m3 (fp8_x16, fp8_x8) leaves its values scaled by: its scale takes this factor.
constexpr float kFp8E4m3Unscale = 256.0f;

// out[c] = f8(row[c]) * s for c < n: by vectors where the ISA has them, `values` (the 256 values of the
// format's bytes) taking what the vectors leave.
inline void decode_fp8(KvFormat f, const float* values, const uint8_t* row, int n, float s, float* out) {
    int c = 0;
#if defined(__AVX512F__)
    const bool e4m3 = f == KvFormat::fp8_e4m3;
    const __m512 sv = _mm512_set1_ps(e4m3 ? s * kFp8E4m3Unscale : s);
    for (; c + 16 <= n; c += 16)
        _mm512_storeu_ps(out + c, _mm512_mul_ps(e4m3 ? fp8_x16<KvFormat::fp8_e4m3>(row + c)
                                                     : fp8_x16<KvFormat::fp8_e5m2>(row + c), sv));
#endif
    (void)f;
    for (; c < n; ++c) out[c] = values[row[c]] * s;
}

// One vector (kLanes values) of the stored values of columns c0 on (c0 even for 4 bits), as f32: the
// integer formats' integers (before the zero point and scale), fp8's values (e4m3's kFp8E4m3Unscale times
// less, as its vector decoding gives them).  The kernels call it as they read rows (KvReader::lanes_block).
template <KvFormat F>
inline VecF stored_lanes(const uint8_t* row, int c0) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
    if constexpr (kv_fp8(F)) return (VecF)fp8_x16<F>(row + c0);
    else return (VecF)stored_x16<F>(row, c0);
#elif defined(__AVX2__) && GRAPHATTN_LANES == 8 && defined(__F16C__)
    if constexpr (kv_fp8(F)) return (VecF)fp8_x8<F>(row + c0);
    else return (VecF)stored_x8<F>(row, c0);
#else
    VecF v;
    for (int i = 0; i < kLanes; ++i) {
        if constexpr (kv_fp8(F))
            v[i] = kv_fp8_value(F, row[c0 + i]) / (F == KvFormat::fp8_e4m3 ? kFp8E4m3Unscale : 1.0f);
        else
            v[i] = float(kv_stored_int(F, row, c0 + i));
    }
    return v;
#endif
}

// dst[c] = bf16(src[c]) for c < n, round to nearest even, NaN kept a (quiet) NaN.
inline void store_bf16_row(const float* src, int n, uint16_t* dst) {
    int c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= n; c += 16) {
        const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + c));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                     _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), _mm512_cvtepi32_epi16(r));
    }
#endif
    for (; c < n; ++c) dst[c] = f32_to_bf16(src[c]);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
