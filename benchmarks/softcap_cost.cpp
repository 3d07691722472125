// The softcap's tanh against the softmax's exp2, per score, in the kernels'
// own AVX-512 vector code (native/cpu/src/simd.hpp): each pass reads a block
// of scores, transforms it and stores it, as the kernels' score passes do, on
// one thread over a block that stays in L1.  Prints one JSON line and a
// line of text: ns per score for exp2 and for c * tanh(s / c), and their ratio
// (the softcap costs no more than the exps where it is <= 1); and the softcap
// with its division replaced by rcp14 and a Newton step, the alternative
// vsoftcap does not take.  Build and run:
//
//   g++ -O2 -mavx512f -Inative/cpu/src -Inative/cpu/include benchmarks/softcap_cost.cpp -o /tmp/softcap_cost \
//     && /tmp/softcap_cost "$(lscpu | sed -n 's/Model name: *//p')"
#define GRAPHATTN_ISA_NS isa_bench
#define GRAPHATTN_LANES 16
#include <chrono>
#include <cstdio>

#include "simd.hpp"

using namespace graphattn::isa_bench;

namespace {

constexpr int kScores = 4096;  // 16 KiB: one score block of the lane kernels
constexpr int kRounds = 20000;

// Best ns per score of `pass` over kRounds passes, in 5 tries.
template <class Pass>
double ns_per_score(float* scores, Pass pass) {
    double best = 1e30;
    for (int attempt = 0; attempt < 5; ++attempt) {
        const auto start = std::chrono::steady_clock::now();
        for (int round = 0; round < kRounds; ++round)
            for (int x = 0; x < kScores; x += kLanes) store(scores + x, pass(load(scores + x)));
        const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
        best = ns / (double(kRounds) * kScores) < best ? ns / (double(kRounds) * kScores) : best;
    }
    return best;
}

}  // namespace

int main(int argc, char** argv) {
    alignas(64) static float scores[kScores];
    const auto reset = [] {
        for (int i = 0; i < kScores; ++i) scores[i] = float((i * 37) % 200 - 100) * 0.05f;  // scores in [-5, 5)
    };
    reset();
    // exp2 of the score less a row max (0 here), as the softmax takes it; the result feeds the next round,
    // kept in range by subtracting 1
    const double exp_ns = ns_per_score(scores, [](VecF s) { return vexp2(s) - 1.0f; });
    reset();
    const float cap = 50.0f * kLog2e, inv_cap = 1.0f / cap;  // Gemma 2's c = 50, in base-2 units
    const double cap_ns = ns_per_score(scores, [&](VecF s) { return vsoftcap(s, cap, inv_cap); });
    reset();
    const double rcp_ns = ns_per_score(scores, [&](VecF s) { return vsoftcap<true>(s, cap, inv_cap); });
    const char* cpu = argc > 1 ? argv[1] : "unknown";
    std::printf("{\"bench\": \"softcap_cost\", \"exp2_ns_per_score\": %.4f, \"softcap_ns_per_score\": %.4f, "
                "\"softcap_over_exp2\": %.3f, \"softcap_rcp14_ns_per_score\": %.4f, \"cpu\": \"%s\"}\n",
                exp_ns, cap_ns, cap_ns / exp_ns, rcp_ns, cpu);
    std::printf("one thread, AVX-512: exp2 %.4f ns/score, softcap c*tanh(s/c) %.4f ns/score, ratio %.3f; "
                "with rcp14 + Newton in place of the division %.4f ns/score (%s)\n",
                exp_ns, cap_ns, cap_ns / exp_ns, rcp_ns, cpu);
    return 0;
}
