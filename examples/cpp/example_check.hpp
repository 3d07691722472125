// Helpers shared by the C++ examples: random data, bf16 conversion, a plain
// double-precision attention to check against, and a wall-clock timer.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "graphattn/sdpa.hpp"

namespace example {

inline std::vector<float> random_floats(size_t count, uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(count);
    for (float& v : values) v = normal(gen);
    return values;
}

inline uint16_t to_bf16(float f) {  // round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits += 0x7fff + ((bits >> 16) & 1);
    return uint16_t(bits >> 16);
}

inline float from_bf16(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The score modifiers of one head (graphattn/score_mods.hpp), for the
// reference: softcap 0 and slope 0 for none, a sink only where has_sink.
struct Modifiers {
    double softcap = 0.0, slope = 0.0, sink = 0.0;
    bool has_sink = false;
};

// One head of attention in double: q (sq x d), k (skv x d), v (skv x dv),
// optional additive mask (sq x skv), keys j > i + causal_offset dropped when
// causal, the modifiers (ALiBi's rows aligned as the causal offset says).
// Fully masked rows give 0.
inline std::vector<double> attention_reference(const float* q, const float* k, const float* v, const float* mask,
                                               int sq, int skv, int d, int dv, double scale, bool causal,
                                               int64_t causal_offset, const Modifiers& mods = {}) {
    std::vector<double> out(size_t(sq) * dv, 0.0), scores(skv);
    for (int i = 0; i < sq; ++i) {
        double max_score = mods.has_sink ? mods.sink : -std::numeric_limits<double>::infinity();
        for (int j = 0; j < skv; ++j) {
            double s = 0.0;
            for (int c = 0; c < d; ++c) s += double(q[i * d + c]) * k[j * d + c];
            s *= scale;
            if (mods.softcap > 0.0) s = mods.softcap * std::tanh(s / mods.softcap);
            s -= mods.slope * std::abs(double(i + causal_offset - j));
            if (mask) s += mask[i * skv + j];
            if (causal && j - i > causal_offset) s = -std::numeric_limits<double>::infinity();
            scores[j] = s;
            max_score = std::max(max_score, s);
        }
        if (std::isinf(max_score)) continue;
        double sum = mods.has_sink ? std::exp(mods.sink - max_score) : 0.0;
        for (int j = 0; j < skv; ++j) sum += scores[j] = std::exp(scores[j] - max_score);
        for (int j = 0; j < skv; ++j)
            for (int c = 0; c < dv; ++c) out[i * dv + c] += scores[j] / sum * v[j * dv + c];
    }
    return out;
}

class Timer {
public:
    Timer() : start_(std::chrono::steady_clock::now()) {}
    double ms() const {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
    }

private:
    std::chrono::steady_clock::time_point start_;
};

// Runs sdpa_forward once to warm up (threads, pages), then `reps` times;
// ms is the mean time of those.  False (with the message printed) on error.
inline bool timed_forward(const graphattn::SdpaForwardArgs& args, int reps, double& ms) {
    graphattn::Status status = graphattn::sdpa_forward(args);
    const Timer timer;
    for (int rep = 0; rep < reps && status.ok; ++rep) status = graphattn::sdpa_forward(args);
    ms = timer.ms() / reps;
    if (!status.ok) std::fprintf(stderr, "sdpa_forward failed: %s\n", status.message.c_str());
    return status.ok;
}

// Prints the result and returns the process exit code.
inline int report(const char* what, double max_error, double tolerance) {
    const bool ok = max_error <= tolerance;
    std::printf("%s: max abs error %.3g (tolerance %.3g) -> %s\n", what, max_error, tolerance,
                ok ? "matches the reference" : "MISMATCH");
    return ok ? 0 : 1;
}

}  // namespace example
