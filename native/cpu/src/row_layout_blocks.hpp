// Micro-kernels of the forward's row layout (decode, short query blocks):
// query rows (a GQA group's heads, a few query positions) against one block
// of keys, with the keys as the lanes of the score vectors.  Rows go in
// register blocks (up to 4 for row-key partials, 6 after a K^T packing) so
// that each K and V vector loaded serves them all.  K and V rows are read in
// place in their own dtype (DT: f32, bf16 or f16, unit column stride) and
// widened as they are loaded, so decode streams each K/V byte once.
#pragma once

#include <cstdint>
#include <immintrin.h>
#include <type_traits>
#include <utility>

#include "graphattn/sdpa.hpp"
#include "half_types.hpp"
#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

constexpr int kPartialsRowBlock = 4;  // rows per register block of the row-key partials
// Rows per register block of the K^T product and of P V after it: 6 rows of
// four key or column vectors keep 24 of AVX-512's 32 registers as sums.
constexpr int kKeyTransposeRowBlock = 6;
constexpr int kRowLayoutKeyVectors = 4;                        // score vectors per softmax step
constexpr int kRowLayoutKeys = kRowLayoutKeyVectors * kLanes;  // keys per block

// Calls f(std::integral_constant<int, n>) for n in 1..Max, chosen at run time
// (values past Max give Max).
template <int Max, typename F>
inline void with_count(int n, F&& f) {
    if constexpr (Max > 1) {
        if (n >= Max) return f(std::integral_constant<int, Max>{});
        return with_count<Max - 1>(n, std::forward<F>(f));
    } else {
        (void)n;
        f(std::integral_constant<int, 1>{});
    }
}

// sums[t] = the horizontal sum of vector t of kLanes consecutive vectors: one
// transposing reduction instead of kLanes separate horizontal sums.
inline VecF transposed_sums(const float* vectors) {
#if defined(__AVX512F__)
    if constexpr (kLanes == 16) {
        // Pairs of vectors -> per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
        __m512 pairs[8];
        for (int i = 0; i < 8; ++i) {
            const __m512 a = _mm512_loadu_ps(vectors + 32 * i), b = _mm512_loadu_ps(vectors + 32 * i + 16);
            pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // Quads -> per 128-bit lane the partial sums of vectors 4i..4i+3.
        __m512 quads[4];
        for (int i = 0; i < 4; ++i) {
            const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
            quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        }
        // Sum the four 128-bit lanes of each quad; quad i lands in 128-bit lane i.
        const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                         _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
        const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                         _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
        return (VecF)_mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88), _mm512_shuffle_f32x4(q01, q23, 0xDD));
    }
#endif
    VecF sums;
    for (int t = 0; t < kLanes; ++t) sums[t] = horizontal_sum(load(vectors + t * kLanes));
    return sums;
}

// kLanes elements of dtype DT at p, as f32.
template <DType DT>
inline VecF load_as_f32(const void* p) {
    if constexpr (DT == DType::f32) {
        return load(static_cast<const float*>(p));
    } else {
        const uint16_t* h = static_cast<const uint16_t*>(p);
#if defined(__AVX512F__)
        if constexpr (kLanes == 16) {
            const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
            if constexpr (DT == DType::f16) return (VecF)_mm512_cvtph_ps(words);
            return (VecF)bf16x16_to_f32(words);
        }
#elif defined(__AVX2__) && defined(__F16C__)
        if constexpr (kLanes == 8) {
            const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
            if constexpr (DT == DType::f16) return (VecF)_mm256_cvtph_ps(words);
            return (VecF)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
        }
#endif
        VecF v;
        for (int i = 0; i < kLanes; ++i) v[i] = DT == DType::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
        return v;
    }
}

template <DType DT>
inline const void* element_at(const void* base, int64_t index) {
    return static_cast<const char*>(base) + index * (DT == DType::f32 ? 4 : 2);
}

// A block's K or V rows in place in their own dtype DT (unit column stride), rows `stride` values apart, as
// the micro-kernels below read rows: lanes(t, c) is the vector of row t's columns c .. c + kLanes as f32.
// (A quantized block's rows, decoded as they are read, are kv_reader.hpp's QuantLanes.)
template <DType DT>
struct PlainLanes {
    const void* base;
    int64_t stride;
    VecF lanes(int t, int c) const { return load_as_f32<DT>(element_at<DT>(base, t * stride + c)); }
};

// partials[(r * kRowLayoutKeys + t) * kLanes ...] = lane-wise products of query
// row r and key t summed over the head dim (Dp, a multiple of kLanes,
// zero-padded), for the key vectors that hold keys < kv; keys past kv give
// zero vectors.  transposed_sums of the kLanes partials of keys
// v * kLanes ... then gives row r's score vector v.
template <int R, class Rows>
inline void row_key_partials(const float* const* q_rows, const Rows& keys, int kv, int Dp, float* partials) {
    const int key_count = (kv + kLanes - 1) / kLanes * kLanes;
    for (int t = 0; t < key_count; ++t) {
        VecF acc[R] = {};
        if (t < kv) {
            for (int c = 0; c < Dp; c += kLanes) {
                const VecF k = keys.lanes(t, c);
                for (int r = 0; r < R; ++r) acc[r] += load(q_rows[r] + c) * k;
            }
        }
        for (int r = 0; r < R; ++r) store(partials + (r * kRowLayoutKeys + t) * kLanes, acc[r]);
    }
}

#if defined(__AVX512F__)
// row_key_partials for bf16 Q and K on AVX512-BF16: each instruction takes
// 32 head-dim values of a row and of a key, multiplies them in pairs exactly
// and adds both products to a lane's f32 sum, with no conversion to f32 and
// half the instructions (the partials then hold sums over pairs of columns,
// which transposed_sums adds up as before).  Like the AMX tiles, it reads
// subnormal bf16 as zero.  Q rows are the unscaled bf16 inputs (Dp a
// multiple of 32); the caller scales the scores.
template <int R>
__attribute__((target("avx512bf16"))) inline void row_key_partials_bf16(const uint16_t* const* q_rows,
                                                                       const uint16_t* keys, int64_t key_stride,
                                                                       int kv, int Dp, float* partials) {
    const int key_count = (kv + kLanes - 1) / kLanes * kLanes;
    for (int t = 0; t < key_count; ++t) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        if (t < kv) {
            const uint16_t* k_row = keys + t * key_stride;
            for (int c = 0; c < Dp; c += 32) {
                const __m512bh k = (__m512bh)_mm512_loadu_si512(k_row + c);
                for (int r = 0; r < R; ++r)
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(q_rows[r] + c), k);
            }
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(partials + (r * kRowLayoutKeys + t) * kLanes, acc[r]);
    }
}

inline void partials_bf16_in_row_blocks(int R, const uint16_t* const* q_rows, const uint16_t* keys,
                                        int64_t key_stride, int kv, int Dp, float* partials) {
    with_count<kPartialsRowBlock>(
        R, [&](auto rows) { row_key_partials_bf16<rows.value>(q_rows, keys, key_stride, kv, Dp, partials); });
}
#endif

// score_rows[r][0, NV * kLanes) = sum over d < D of q_rows[r][d] * k_t[d][...]:
// R rows against NV vectors of keys packed as K^T (rows kRowLayoutKeys apart),
// the keys as lanes.  Each K^T vector loaded serves all R rows, and no
// horizontal sums are needed, unlike row_key_partials.
template <int R, int NV>
inline void row_scores_from_k_t(const float* const* q_rows, const float* k_t, int D, float* const* score_rows) {
    VecF acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NV; ++i) acc[r][i] = VecF{};
    for (int d = 0; d < D; ++d) {
        VecF k[NV];
        for (int i = 0; i < NV; ++i) k[i] = load(k_t + d * kRowLayoutKeys + i * kLanes);
        for (int r = 0; r < R; ++r) {
            const VecF q = splat(q_rows[r][d]);
            for (int i = 0; i < NV; ++i) acc[r][i] += q * k[i];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NV; ++i) store(score_rows[r] + i * kLanes, acc[r][i]);
}

// o_rows[r] += sum over t < kv of p_rows[r][t] * V row t, for R rows and
// NV vectors of columns starting at column c0.
template <int R, int NV, class Rows>
inline void accumulate_pv_columns(const float* const* p_rows, const Rows& values, int kv, float* const* o_rows,
                                  int c0) {
    VecF acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NV; ++i) acc[r][i] = load(o_rows[r] + c0 + i * kLanes);
    for (int t = 0; t < kv; ++t) {
        VecF v[NV];
        for (int i = 0; i < NV; ++i) v[i] = values.lanes(t, c0 + i * kLanes);
        for (int r = 0; r < R; ++r) {
            const VecF p = splat(p_rows[r][t]);
            for (int i = 0; i < NV; ++i) acc[r][i] += p * v[i];
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < NV; ++i) store(o_rows[r] + c0 + i * kLanes, acc[r][i]);
}

// o_rows[r][0, Dvp) += P V for R rows (Dvp a multiple of kLanes).
template <int R, class Rows>
inline void accumulate_pv(const float* const* p_rows, const Rows& values, int kv, int Dvp, float* const* o_rows) {
    constexpr int kWide = 4;  // column vectors per register block
    int c = 0;
    for (; c + kWide * kLanes <= Dvp; c += kWide * kLanes)
        accumulate_pv_columns<R, kWide>(p_rows, values, kv, o_rows, c);
    for (; c < Dvp; c += kLanes) accumulate_pv_columns<R, 1>(p_rows, values, kv, o_rows, c);
}

// Calls f(rows, dtype) with R (1..MaxRows) and the K/V dtype as
// compile-time constants (std::integral_constant), chosen at run time.
template <int MaxRows, typename F>
inline void with_row_block(int R, DType dt, F&& f) {
    auto by_rows = [&](auto dtype) { with_count<MaxRows>(R, [&](auto rows) { f(rows, dtype); }); };
    switch (dt) {
        case DType::bf16: by_rows(std::integral_constant<DType, DType::bf16>{}); break;
        case DType::f16: by_rows(std::integral_constant<DType, DType::f16>{}); break;
        default: by_rows(std::integral_constant<DType, DType::f32>{}); break;
    }
}

inline void partials_in_row_blocks(DType dt, int R, const float* const* q_rows, const void* keys,
                                   int64_t key_stride, int kv, int Dp, float* partials) {
    with_row_block<kPartialsRowBlock>(R, dt, [&](auto rows, auto dtype) {
        row_key_partials<rows.value>(q_rows, PlainLanes<dtype.value>{keys, key_stride}, kv, Dp, partials);
    });
}

// Scores of R rows (1..kKeyTransposeRowBlock) against the first kv keys of a
// packed K^T block (kv <= kRowLayoutKeys; the key vectors past kv are skipped).
inline void scores_from_k_t_in_row_blocks(int R, int kv, const float* const* q_rows, const float* k_t, int D,
                                          float* const* score_rows) {
    with_count<kKeyTransposeRowBlock>(R, [&](auto rows) {
        with_count<kRowLayoutKeyVectors>((kv + kLanes - 1) / kLanes, [&](auto vectors) {
            row_scores_from_k_t<rows.value, vectors.value>(q_rows, k_t, D, score_rows);
        });
    });
}

inline void accumulate_pv_in_row_blocks(DType dt, int R, const float* const* p_rows, const void* values,
                                        int64_t value_stride, int kv, int Dvp, float* const* o_rows) {
    with_row_block<kKeyTransposeRowBlock>(R, dt, [&](auto rows, auto dtype) {
        accumulate_pv<rows.value>(p_rows, PlainLanes<dtype.value>{values, value_stride}, kv, Dvp, o_rows);
    });
}

// The same two products over rows of any source (`Rows` with lanes(t, c), as PlainLanes), R (1..the row
// blocks' sizes) chosen at run time.
template <class Rows>
inline void partials_in_row_blocks(int R, const float* const* q_rows, const Rows& keys, int kv, int Dp,
                                   float* partials) {
    with_count<kPartialsRowBlock>(R, [&](auto rows) { row_key_partials<rows.value>(q_rows, keys, kv, Dp, partials); });
}
template <class Rows>
inline void accumulate_pv_in_row_blocks(int R, const float* const* p_rows, const Rows& values, int kv, int Dvp,
                                        float* const* o_rows) {
    with_count<kKeyTransposeRowBlock>(R, [&](auto rows) { accumulate_pv<rows.value>(p_rows, values, kv, Dvp, o_rows); });
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
