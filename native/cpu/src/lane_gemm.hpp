// Register-blocked block products in the "query rows as vector lanes" layout
// used by the forward driver: every operand indexed by a query row is stored
// transposed ([k][row]), so one vector holds kLanes query rows, and the other
// operand (a K or V row) is read as scalars and broadcast.  Both products of
// attention take this one form:
//
//   S^T[j][r]  = sum_d  K[j][d] * Q^T[d][r]      (b(n, k) = K[n][k])
//   O^T[c][r] += sum_j  V[j][c] * P^T[j][r]      (b(n, k) = V[k][n])
//
// A tile keeps kTileN x RV vector accumulators in registers; per k step it
// loads RV vectors of the lane operand and broadcasts kTileN scalars.
#pragma once

#include <algorithm>
#include <cstdint>

#include "isa_namespace.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// acc[n][lanes] = sum_{k < k_count} a_t[k][lanes] * b[n * b_n + k * b_k]
// for n < NT and RV vectors of lanes; rows of a_t are lda floats apart.
// The sums start at zero and callers add C at the end: with C loaded up
// front, GCC kept a second copy of the accumulators on the stack.
template <int RV, int NT>
__attribute__((always_inline)) inline void lane_tile_sums(const float* __restrict a_t, int64_t lda, int k_count,
                                                          const float* __restrict b, int64_t b_n, int64_t b_k,
                                                          VecF (&acc)[NT][RV]) {
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n)
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) acc[n][v] = VecF{};
    for (int k = 0; k < k_count; ++k) {
        VecF a[RV];
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) a[v] = load(a_t + k * lda + v * kLanes);
        const float* bk = b + k * b_k;
#pragma GCC unroll 16
        for (int n = 0; n < NT; ++n) {
            const float bn = bk[n * b_n];
#pragma GCC unroll 16
            for (int v = 0; v < RV; ++v) acc[n][v] += a[v] * bn;
        }
    }
}

// c_t[n][lanes] (+)= the sums above; rows of c_t are ldc floats apart.
template <int RV, int NT, bool Accumulate>
inline void lane_tile(const float* __restrict a_t, int64_t lda, int k_count, const float* __restrict b, int64_t b_n,
                      int64_t b_k, float* __restrict c_t, int64_t ldc) {
    VecF acc[NT][RV];
    lane_tile_sums<RV, NT>(a_t, lda, k_count, b, b_n, b_k, acc);
#pragma GCC unroll 16
    for (int n = 0; n < NT; ++n)
#pragma GCC unroll 16
        for (int v = 0; v < RV; ++v) {
            float* c = c_t + n * ldc + v * kLanes;
            store(c, Accumulate ? load(c) + acc[n][v] : acc[n][v]);
        }
}

// Prefetch hints for `count` rows of `cols` floats, `stride` floats apart.
// A tile's k loop runs thousands of cycles, so hints for the next tile's rows,
// given before it, bring rows that come from L3 in time (fetch_b, fetch_c_cols).
inline void fetch_rows(const float* rows, int64_t stride, int count, int64_t cols, bool for_write) {
    constexpr int kFloatsPerLine = 16;
    for (int r = 0; r < count; ++r)
        for (int64_t x = 0; x < cols; x += kFloatsPerLine) {
            if (for_write)
                __builtin_prefetch(rows + r * stride + x, 1, 3);
            else
                __builtin_prefetch(rows + r * stride + x, 0, 3);
        }
}

// The same product for n < n_count: full tiles of NT, then one narrower tile
// for the remainder.  By default rows are exactly RV vectors long.  With
// fetch_c_cols, each full tile first hints the next tile's rows of c_t over
// that many columns.
template <int RV, int NT, bool Accumulate>
inline void lane_gemm(const float* a_t, int k_count, const float* b, int64_t b_n, int64_t b_k, int n_count,
                      float* c_t, int64_t lda = RV * kLanes, int64_t ldc = RV * kLanes, int64_t fetch_c_cols = 0) {
    int n = 0;
    for (; n + NT <= n_count; n += NT) {
        if (fetch_c_cols) fetch_rows(c_t + (n + NT) * ldc, ldc, std::min(NT, n_count - n - NT), fetch_c_cols, true);
        lane_tile<RV, NT, Accumulate>(a_t, lda, k_count, b + n * b_n, b_n, b_k, c_t + n * ldc, ldc);
    }
    if constexpr (NT > 1) {
        if (n < n_count)
            lane_gemm<RV, NT - 1, Accumulate>(a_t, k_count, b + n * b_n, b_n, b_k, n_count - n, c_t + n * ldc, lda, ldc);
    }
}

// c[n][0:width] (+)= sum_k a[k][0:width] * b[n * b_n + k * b_k] for any width
// that is a multiple of kLanes, in column chunks of RV vectors and narrower
// ones for the rest (rows of a and c are lda and ldc floats apart).  With
// fetch_c, the first chunk hints each next tile's rows of c over the width.
template <int RV, int NT, bool Accumulate>
inline void lane_gemm_wide(const float* a, int64_t lda, int k_count, const float* b, int64_t b_n, int64_t b_k,
                           int n_count, float* c, int64_t ldc, int width, bool fetch_c = false) {
    int x = 0;
    for (; x + RV * kLanes <= width; x += RV * kLanes)
        lane_gemm<RV, NT, Accumulate>(a + x, k_count, b, b_n, b_k, n_count, c + x, lda, ldc, fetch_c && x == 0 ? width : 0);
    if constexpr (RV > 1) {
        if (x < width)
            lane_gemm_wide<RV - 1, NT + 2, Accumulate>(a + x, lda, k_count, b, b_n, b_k, n_count, c + x, ldc, width - x);
    }
}

// The sums of lane_gemm handed tile by tile, still in registers, to
// sink.tile(acc, n) (acc[t]: the sums of n + t) instead of stored.  With
// fetch_b (b's rows b_n apart, b_k == 1), each full tile first hints the next
// tile's rows of b.
template <int RV, int NT, class Sink>
inline void lane_gemm_to(const float* a_t, int k_count, const float* b, int64_t b_n, int64_t b_k, int n_count,
                         Sink& sink, bool fetch_b = false, int n = 0) {
    for (; n + NT <= n_count; n += NT) {
        if (fetch_b) fetch_rows(b + (n + NT) * b_n, b_n, std::min(NT, n_count - n - NT), k_count, false);
        VecF acc[NT][RV];
        lane_tile_sums<RV, NT>(a_t, RV * kLanes, k_count, b + n * b_n, b_n, b_k, acc);
        sink.tile(acc, n);
    }
    if constexpr (NT > 1) {
        if (n < n_count) lane_gemm_to<RV, NT - 1>(a_t, k_count, b, b_n, b_k, n_count, sink, false, n);
    }
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
