// A fixed-width float vector for the kernels, written with GCC/Clang vector
// extensions so one source serves every ISA build: each translation unit sets
// GRAPHATTN_LANES to the width its -m flags make native (16 for AVX-512,
// 8 for AVX2, 4 for the portable SSE2/NEON baseline) and the compiler maps
// the operations onto those registers.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "graphattn/score_mods.hpp"
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

// x in every lane, as one broadcast.  (Not VecF{} + x: without -ffast-math
// the compiler must keep that add, since 0 + -0 is +0; and GCC turns a
// lane-by-lane fill into one masked insert per lane.)
inline VecF splat(float x) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
    return (VecF)_mm512_set1_ps(x);
#elif defined(__AVX__) && GRAPHATTN_LANES == 8
    return (VecF)_mm256_set1_ps(x);
#elif defined(__SSE__) && GRAPHATTN_LANES == 4
    return (VecF)_mm_set1_ps(x);
#else
    VecF v;
    for (int i = 0; i < kLanes; ++i) v[i] = x;
    return v;
#endif
}

// Lane index 0, 1, ..., kLanes - 1 as floats (for per-lane row numbers).
inline VecF lane_index() {
    VecF v;
    for (int i = 0; i < kLanes; ++i) v[i] = float(i);
    return v;
}

// max that ignores a NaN in `x` (comparison with NaN is false), so a NaN
// score never hides the running maximum; NaN still reaches the row sum.
inline VecF max_ignoring_nan(VecF x, VecF m) { return x > m ? x : m; }

// Whether x > y in any lane (false where either is NaN).
inline bool any_greater(VecF x, VecF y) {
#if defined(__AVX512F__)
    if constexpr (kLanes == 16) return _mm512_cmp_ps_mask((__m512)x, (__m512)y, _CMP_GT_OQ) != 0;
#endif
    const VecI greater = x > y;
    bool any = false;
    for (int i = 0; i < kLanes; ++i) any |= greater[i] != 0;
    return any;
}

inline float horizontal_sum(VecF v) {
#if defined(__AVX512F__)
    if constexpr (kLanes == 16) return _mm512_reduce_add_ps((__m512)v);
#endif
    float sum = v[0];
    for (int i = 1; i < kLanes; ++i) sum += v[i];
    return sum;
}

// x[i] *= m[i] for i < n (n a multiple of kLanes).
inline void multiply_in_place(float* x, const float* m, size_t n) {
    for (size_t i = 0; i < n; i += kLanes) store(x + i, load(x + i) * load(m + i));
}

// sum of x[i] * y[i] for i < n, in vector partial sums.
inline float dot(const float* x, const float* y, int n) {
    VecF acc{};
    int i = 0;
    for (; i + kLanes <= n; i += kLanes) acc += load(x + i) * load(y + i);
    float sum = horizontal_sum(acc);
    for (; i < n; ++i) sum += x[i] * y[i];
    return sum;
}

// Largest lane of v, which must hold no NaN (callers reduce max_ignoring_nan results).
inline float horizontal_max(VecF v) {
#if defined(__AVX512F__)
    if constexpr (kLanes == 16) return _mm512_reduce_max_ps((__m512)v);
#endif
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
    return m;
}

// 2^f for f in [-1/2, 1/2]: degree-5 polynomial fitted to the relative error
// (weighted least squares on Chebyshev nodes); max relative error 1.5e-7 with
// these f32 coefficients, about one ulp.
inline VecF exp2_reduced(VecF f) {
    VecF p = splat(0.0013266970636323094f);
    p = p * f + 0.009675459936261177f;
    p = p * f + 0.05550742521882057f;
    p = p * f + 0.24022121727466583f;
    p = p * f + 0.6931469440460205f;
    return p * f + 1.0000001192092896f;
}

// Degree 4, fitted the same way: max relative error 2.7e-6, for results that
// are rounded to bf16 next (relative step 2^-9) and sums kept to about 1e-5.
inline VecF exp2_reduced_coarse(VecF f) {
    VecF p = splat(0.009570099413394928f);
    p = p * f + 0.05591785907745361f;
    p = p * f + 0.240247443318367f;
    p = p * f + 0.6931217908859253f;
    return p * f + 0.9999992847442627f;
}

// 2^x per lane, for softmax in base 2 (log2(e) folded into the scale):
// 2^-inf = 0 and NaN stays NaN.  Coarse: the degree-4 polynomial.
template <bool Coarse = false>
inline VecF vexp2(VecF x) {
#if defined(__AVX512F__)
    if constexpr (kLanes == 16) {
        // Below -126 (-inf included) the result is set to 0 exactly, never a
        // subnormal (slow, and a masked score must add nothing); the NaN that
        // -inf leaves in f is masked out with it.  NaN stays NaN.
        const __m512 k = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const VecF f = (VecF)_mm512_sub_ps((__m512)x, k);
        const __mmask16 normal = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
        return (VecF)_mm512_maskz_scalef_ps(normal, (__m512)(Coarse ? exp2_reduced_coarse(f) : exp2_reduced(f)), k);
    }
#endif
    const VecF lowest = splat(-126.0f);
    VecF c = x < lowest ? lowest : x;  // comparisons keep NaN as it is
    c = c > 127.0f ? splat(127.0f) : c;
    const VecF round_magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const VecF k = (c + round_magic) - round_magic;
    const VecI bits = (__builtin_convertvector(k, VecI) + 127) << 23;
    VecF two_to_k;
    std::memcpy(&two_to_k, &bits, sizeof two_to_k);
    const VecF result = (Coarse ? exp2_reduced_coarse(c - k) : exp2_reduced(c - k)) * two_to_k;
    return x < lowest ? VecF{} : result;
}

constexpr float kLog2e = 1.44269504088896341f;

// s clamped to [-edge, edge] per lane; NaN stays NaN.
inline VecF clamp_keeping_nan(VecF s, float edge) {
#if defined(__AVX512DQ__)
    // one vrangeps: the smaller magnitude of s and edge, with s's sign; NaN stays NaN
    if constexpr (kLanes == 16) return (VecF)_mm512_range_ps((__m512)s, _mm512_set1_ps(edge), 0x02);
#endif
#if defined(__AVX512F__)
    if constexpr (kLanes == 16)  // max and min return their second operand, s, where it is NaN
        return (VecF)_mm512_min_ps(_mm512_set1_ps(edge), _mm512_max_ps(_mm512_set1_ps(-edge), (__m512)s));
#endif
    return s > edge ? splat(edge) : (s < -edge ? splat(-edge) : s);  // comparisons keep NaN
}

// tanh(x) / x as P(x^2) / Q(x^2) for |x| <= 9 (beyond it tanh rounds to
// +-1 in f32): P and Q of degree 4, a rational fit to the relative error
// (reweighted least squares): Softcap's max relative error in f32 is under
// 4e-7 on either path, near 0 included, so that a cap of any size adds about
// no more error to the scores than their own rounding.  Coefficients from t^0
// up.
constexpr float kTanhP[5] = {1.0f, 0.13381083f, 0.0034956546f, 2.0610109e-05f, 1.3355956e-08f};
constexpr float kTanhQ[5] = {1.0f, 0.46714398f, 0.02587724f, 0.00032857407f, 7.7771153e-07f};
constexpr float kTanhEdge = kTanhSaturates;

// tanh(x) / x as N(x^2), N of degree 4, for |x| <= 0.625: the same kind of
// fit, max relative error in f32 about 2.4e-7.  Scores within 0.625 c take
// it (a cap is set above the scores' usual size, to bound outliers): no
// clamp and no division, so the softcap costs fewer vector operations than
// an exp2.
constexpr float kTanhNear[5] = {0.9999998932f, -0.3333195459f, 0.1330453103f, -0.05182209953f, 0.01505127685f};
constexpr float kTanhNearEdge = 0.625f;

// The softcap of one call, c tanh(s / c), on scores that arrive as x with
// s = input_scale * x; NaN stays NaN.  With t = x^2 and the fits'
// coefficients scaled once per call by (input_scale / c)^(2k) (input_scale
// folded into N's and P's too), one multiply for t and none for s / c:
// a vector whose lanes all lie within the near edge (|s| <= 0.625 c) is
// x N(t); any other is clamped to the edge (|s| <= 9c) and is x' P(t) / Q(t),
// t = x'^2.  Where the scaled coefficients or t would leave f32's normal
// range (caps far from the scores' size), it evaluates the rational fit on
// s / c as written; that branch is the same for every score of a call.
struct Softcap {
    float cap = 0.0f, inv_cap = 0.0f;  // c and 1 / c
    float input_scale = 1.0f;
    bool scaled = false;
    float edge = 0.0f;    // scaled: x clamped to +-edge
    float near_t = 0.0f;  // scaled: the near fit serves t = x^2 up to this
    float p[5] = {}, q[5] = {}, n[5] = {};

    Softcap() = default;
    explicit Softcap(float cap_, float input_scale_ = 1.0f)
        : cap(cap_), inv_cap(1.0f / cap_), input_scale(input_scale_) {
        const double u = double(input_scale) / double(cap), u2 = u * u;
        const double e = kTanhEdge / u;
        double power = 1.0;
        bool normal = e * e < 1e36;
        for (int k = 0; k < 5; ++k) {
            const double pk = kTanhP[k] * input_scale * power, qk = kTanhQ[k] * power;
            const double nk = kTanhNear[k] * input_scale * power;
            normal = normal && pk > 1e-36 && pk < 1e36 && qk > 1e-36 && qk < 1e36 && std::fabs(nk) > 1e-36 &&
                     std::fabs(nk) < 1e36;
            p[k] = float(pk);
            q[k] = float(qk);
            n[k] = float(nk);
            power *= u2;
        }
        scaled = normal;
        edge = float(e);
        near_t = float(kTanhNearEdge * kTanhNearEdge / u2);
    }

    VecF operator()(VecF x) const {
        if (__builtin_expect(scaled, 1)) {
            const VecF t = x * x;  // NaN lanes stay NaN on either fit; +-inf takes the clamp
            if (__builtin_expect(!any_greater(t, splat(near_t)), 1)) return x * polynomial(t, n);
            const VecF c = clamp_keeping_nan(x, edge);
            return c * rational(c * c, p, q);
        }
        return unscaled(x);
    }

    // The rational fit on s / c as written, out of line (rare caps).
    __attribute__((noinline, cold)) VecF unscaled(VecF x) const {
        const VecF c = clamp_keeping_nan(x * input_scale, kTanhEdge * cap);
        const VecF y = c * inv_cap;
        return c * rational(y * y, kTanhP, kTanhQ);
    }

    // N(t), Horner's rule.
    static VecF polynomial(VecF t, const float (&nc)[5]) {
        VecF sum = splat(nc[4]);
        sum = sum * t + nc[3];
        sum = sum * t + nc[2];
        sum = sum * t + nc[1];
        return sum * t + nc[0];
    }

    // P(t) / Q(t), Horner's rule for each.
    static VecF rational(VecF t, const float (&pc)[5], const float (&qc)[5]) {
        VecF num = splat(pc[4]), den = splat(qc[4]);
        num = num * t + pc[3];
        den = den * t + qc[3];
        num = num * t + pc[2];
        den = den * t + qc[2];
        num = num * t + pc[1];
        den = den * t + qc[1];
        num = num * t + pc[0];
        den = den * t + qc[0];
        return num / den;
    }
};

constexpr float kLn2 = 0.693147180559945309f;
constexpr float kMaxFloat = kFloat32Max;

// x * log2(e), clamped to [-FLT_MAX, FLT_MAX] for a finite x: a finite score
// or mask as low as -FLT_MAX (a common "masked" value) must keep its meaning,
// so that a row masked only that way still gets the uniform softmax of the
// reference, and one above FLT_MAX / log2(e) (3e38) must stay the largest
// finite score rather than become +inf, whose max would give inf - inf = NaN.
inline float to_log2_units(float x) {
    const float y = x * kLog2e;
    if (y < -kMaxFloat && x >= -kMaxFloat) return -kMaxFloat;
    return (y > kMaxFloat && x <= kMaxFloat) ? kMaxFloat : y;
}

inline VecF to_log2_units(VecF x) {
    const VecF y = x * kLog2e;
    const VecF low = (y < -kMaxFloat) & (x >= -kMaxFloat) ? splat(-kMaxFloat) : y;
    return (y > kMaxFloat) & (x <= kMaxFloat) ? splat(kMaxFloat) : low;
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
