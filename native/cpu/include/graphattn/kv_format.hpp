// How a quantized key or value row is decoded, in one place: the formats of
// a compressed K/V cache (oneDNN's DynamicDequantize, per group of columns)
// and the value of each stored element.  The CPU reader
// (native/cpu/src/kv_reader.hpp) decodes rows by these rules alone.  Plain
// arithmetic only: both compilers build it.
//
// A row of D values is stored as D / G groups of G columns; group g has one
// scale s_g and, where given, one zero point z_g (else 0):
//   u8, s8:  one byte a value, value = (q - z_g) * s_g (u8 unsigned, s8 signed)
//   u4, s4:  two values a byte, column c in byte c / 2, the even column in the
//            low nibble (oneDNN's order); value = (q - z_g) * s_g
//   s4_in_byte: one s4 value a byte, in its low nibble (ml_dtypes' int4, as
//            the graph API's s4 tensors hold them); value = (q - z_g) * s_g
//            (a u4 value a byte is u8's rule)
//   fp8_e4m3, fp8_e5m2: one byte a value (float8_e4m3fn, float8_e5m2),
//            value = f8 * s, one scale a batch element (a tensor or a K/V
//            head), no zero point.
#pragma once

#include <cstdint>
#include <cstring>

namespace graphattn {

enum class KvFormat : int32_t { plain = 0, u8 = 1, s8 = 2, u4 = 3, s4 = 4, fp8_e4m3 = 5, fp8_e5m2 = 6, s4_in_byte = 7 };

inline bool kv_four_bit(KvFormat f) { return f == KvFormat::u4 || f == KvFormat::s4; }
constexpr bool kv_fp8(KvFormat f) { return f == KvFormat::fp8_e4m3 || f == KvFormat::fp8_e5m2; }
inline bool kv_signed(KvFormat f) { return f == KvFormat::s8 || f == KvFormat::s4 || f == KvFormat::s4_in_byte; }

// Bytes of a row of `cols` values.
inline int64_t kv_row_bytes(KvFormat f, int64_t cols) { return kv_four_bit(f) ? (cols + 1) / 2 : cols; }

// The integer stored for column c of a row of bytes `row` (u8, s8, u4, s4).
inline int32_t kv_stored_int(KvFormat f, const uint8_t* row, int64_t c) {
    switch (f) {
        case KvFormat::u8: return row[c];
        case KvFormat::s8: return int32_t(int8_t(row[c]));
        case KvFormat::u4: return (row[c >> 1] >> ((c & 1) * 4)) & 15;
        case KvFormat::s4: {
            const int32_t n = (row[c >> 1] >> ((c & 1) * 4)) & 15;
            return n >= 8 ? n - 16 : n;
        }
        case KvFormat::s4_in_byte: {
            const int32_t n = row[c] & 15;
            return n >= 8 ? n - 16 : n;
        }
        default: return 0;
    }
}

// float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no
// infinities, S.1111.111 is NaN) and float8_e5m2 (IEEE-like: bias 15, 2
// mantissa bits, infinities and NaNs) as f32.
inline float kv_fp8_value(KvFormat f, uint8_t byte) {
    const bool e4m3 = f == KvFormat::fp8_e4m3;
    const int mantissa_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, exponent_max = e4m3 ? 15 : 31;
    const uint32_t sign = uint32_t(byte >> 7) << 31;
    const int exponent = (byte & 0x7f) >> mantissa_bits;
    const uint32_t mantissa = byte & ((1u << mantissa_bits) - 1);
    uint32_t bits;
    if (exponent == exponent_max && (!e4m3 || mantissa == (1u << mantissa_bits) - 1)) {
        bits = e4m3 || mantissa ? 0x7fc00000u : 0x7f800000u;  // NaN, or e5m2's infinity
    } else if (exponent == 0) {
        // Subnormal: mantissa * 2^(1 - bias - mantissa_bits), exact in f32.
        float v = float(mantissa);
        for (int i = 0; i < bias - 1 + mantissa_bits; ++i) v *= 0.5f;
        std::memcpy(&bits, &v, sizeof bits);
    } else {
        bits = uint32_t(exponent - bias + 127) << 23 | mantissa << (23 - mantissa_bits);
    }
    bits |= sign;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

}  // namespace graphattn
