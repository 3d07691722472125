// Peak rates of the two instructions the vector kernels' products use, in a
// register-only loop (no memory traffic): the AVX-512 f32 FMA and, where the
// CPU has AVX512-BF16, VDPBF16PS (two bf16 products per lane).  The figures
// behind bf16_pairs_pay_off (native/cpu/src/lane_gemm_bf16.hpp) and the
// "FMA peak" of the issue notes.  Build and run (one figure per thread count):
//
//   g++ -O2 -mavx512f -mavx512bf16 -fopenmp benchmarks/instruction_peak.cpp -o /tmp/peak && /tmp/peak
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 12;        // independent accumulators: enough to hide the latency
constexpr long kSteps = 50000000;  // per thread and instruction

// GFLOP/s of one thread issuing `step` on kChains accumulators, `flops` per instruction.
template <class Step>
double rate(Step step, double flops) {
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1e-3f * float(i));
    const auto start = std::chrono::steady_clock::now();
    for (long s = 0; s < kSteps; ++s)
#pragma GCC unroll 16
        for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    float sink = 0.0f;  // keeps the loop
    for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    if (sink == 1.2345f) std::printf(" ");
    return double(kSteps) * kChains * flops / seconds / 1e9;
}

double fma_rate() {
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
    return rate([&](__m512 x) { return _mm512_fmadd_ps(x, a, b); }, 32.0);
}

__attribute__((target("avx512bf16"))) double dpbf16_rate() {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3800);
    return rate([&](__m512 x) __attribute__((target("avx512bf16"))) { return _mm512_dpbf16_ps(x, a, b); }, 64.0);
}

}  // namespace

int main() {
    const bool bf16 = __builtin_cpu_supports("avx512bf16");
    double fma = 0.0, dp = 0.0;
#pragma omp parallel reduction(+ : fma, dp)
    {
        fma += fma_rate();
        if (bf16) dp += dpbf16_rate();
    }
    std::printf("threads %d: f32 FMA %.1f GFLOP/s", omp_get_max_threads(), fma);
    if (bf16) std::printf(", VDPBF16PS %.1f GFLOP/s", dp);
    std::printf("\n");
    return 0;
}
