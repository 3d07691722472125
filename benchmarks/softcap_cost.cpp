// The softcap's tanh against the softmax's exp2, per score, in the kernels'
// own AVX-512 vector code (native/cpu/src/simd.hpp) and compile flags: each
// pass reads a block of scores, transforms it and stores it, as the kernels'
// score passes do, on one thread over a block that stays in L1, each
// transform in a loop of its own (not inlined into a shared one, where the
// compiler schedules them unlike the kernels).  Prints one JSON line and a
// line of text: ns per score for exp2 and for c * tanh(s / c) (Softcap, at
// Gemma 2's c = 50: on scores within 0.625 c, its near fit; on scores near
// +-1.9 c, its clamped rational fit; and, on its fallback path, at c = 1e6),
// and their ratio to exp2 (the softcap costs no more than the exps where it
// is <= 1).  Build and run:
//
//   g++ -O3 -fno-math-errno -fno-trapping-math -mavx512f -mavx512dq -Inative/cpu/src -Inative/cpu/include
//       benchmarks/softcap_cost.cpp -o /tmp/softcap_cost     (one line)
//   /tmp/softcap_cost "$(lscpu | sed -n 's/Model name: *//p')"
#define GRAPHATTN_ISA_NS isa_bench
#define GRAPHATTN_LANES 16
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "simd.hpp"

using namespace graphattn::isa_bench;

namespace {

constexpr int kScores = 4096;  // 16 KiB: one score block of the lane kernels
constexpr int kRounds = 20000;

alignas(64) float scores[kScores];

void reset() {
    for (int i = 0; i < kScores; ++i) scores[i] = float((i * 37) % 200 - 100) * 0.05f;  // scores in [-5, 5)
}

// kRounds passes of `pass` over the scores, in a loop of this transform's own.
template <class Pass>
__attribute__((noinline)) void passes(Pass pass) {
    for (int round = 0; round < kRounds; ++round)
        for (int x = 0; x < kScores; x += kLanes) store(scores + x, pass(load(scores + x)));
}

// ns per score of one round of passes.
template <class Pass>
double ns_per_score(Pass pass) {
    reset();
    const auto start = std::chrono::steady_clock::now();
    passes(pass);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    return ns / (double(kRounds) * kScores);
}

}  // namespace

int main(int argc, char** argv) {
    const Softcap gemma(50.0f * kLog2e), huge(1e6f * kLog2e);  // in base-2 units, as the kernels take them
    // The best of 7 tries each, the three transforms taking turns, so that a change of the clock or of other
    // load on the machine reaches all three alike.
    double exp_ns = 1e30, cap_ns = 1e30, far_ns = 1e30, fallback_ns = 1e30;
    for (int attempt = 0; attempt < 7; ++attempt) {
        // exp2 of the score less a row max (0 here), as the softmax takes it; the result feeds the next
        // round, kept in range by subtracting 1
        exp_ns = std::min(exp_ns, ns_per_score([](VecF s) { return vexp2(s) - 1.0f; }));
        // scores in [-5, 5), base-2 units: within 0.07 c, the near fit
        cap_ns = std::min(cap_ns, ns_per_score([&](VecF s) { return gemma(s); }));
        // twice the softcap fed back: after a few rounds every score sits near +-1.9 c, past the near fit
        far_ns = std::min(far_ns, ns_per_score([&](VecF s) { return gemma(s) * 2.0f; }));
        fallback_ns = std::min(fallback_ns, ns_per_score([&](VecF s) { return huge(s); }));
    }
    const char* cpu = argc > 1 ? argv[1] : "unknown";
    std::printf("{\"bench\": \"softcap_cost\", \"exp2_ns_per_score\": %.4f, \"softcap_ns_per_score\": %.4f, "
                "\"softcap_over_exp2\": %.3f, \"softcap_far_ns_per_score\": %.4f, \"far_over_exp2\": %.3f, "
                "\"softcap_fallback_ns_per_score\": %.4f, \"fallback_over_exp2\": %.3f, "
                "\"scaled_path\": %s, \"fallback_path\": %s, \"cpu\": \"%s\"}\n",
                exp_ns, cap_ns, cap_ns / exp_ns, far_ns, far_ns / exp_ns, fallback_ns, fallback_ns / exp_ns,
                gemma.scaled ? "true" : "false", huge.scaled ? "false" : "true", cpu);
    std::printf("one thread, AVX-512: exp2 %.4f ns/score; softcap c*tanh(s/c), c = 50: %.4f ns/score, ratio %.3f; "
                "scores near +-1.9 c: %.4f ns/score, ratio %.3f; c = 1e6 (fallback path): %.4f ns/score, "
                "ratio %.3f (%s)\n",
                exp_ns, cap_ns, cap_ns / exp_ns, far_ns, far_ns / exp_ns, fallback_ns, fallback_ns / exp_ns, cpu);
    return 0;
}
