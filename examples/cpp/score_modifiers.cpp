// The score modifiers through native/cpu's C++ API (graphattn/score_mods.hpp):
// a causal f32 call with a logit softcap, ALiBi slopes and attention sinks,
// one slope and one sink per head.  The slopes and sinks are views of one
// value per batch index: stride 1 over heads, 0 over the batch.
#include <cmath>
#include <cstdio>
#include <vector>

#include "example_check.hpp"
#include "graphattn/sdpa.hpp"

int main() {
    const int64_t N = 2, H = 4, S = 200, D = 64;
    const std::vector<float> q = example::random_floats(N * H * S * D, 1);
    const std::vector<float> k = example::random_floats(N * H * S * D, 2);
    const std::vector<float> v = example::random_floats(N * H * S * D, 3);
    std::vector<float> slopes(H), sinks(H), out(N * H * S * D);
    for (int64_t h = 0; h < H; ++h) {
        slopes[h] = float(std::pow(2.0, -8.0 * double(h + 1) / double(H)));  // BLOOM's geometric slopes
        sinks[h] = 0.5f * float(h) - 1.0f;
    }

    graphattn::SdpaForwardArgs args;
    args.batch[0] = 1, args.batch[1] = N, args.batch[2] = H;
    args.seq_q = args.seq_kv = S;
    args.head_dim_qk = args.head_dim_v = D;
    auto bhsd_view = [&](const float* data) {  // contiguous (N, H, S, D)
        graphattn::TensorView view;
        view.data = data;
        const int64_t strides[5] = {0, H * S * D, S * D, D, 1};
        std::copy(strides, strides + 5, view.strides);
        view.buffer = {0, int64_t(sizeof(float)) * N * H * S * D};
        return view;
    };
    auto per_head_view = [&](const float* data) {  // one value per head, shared by the batch
        graphattn::TensorView view;
        view.data = data;
        const int64_t strides[5] = {0, 0, 1, 0, 0};
        std::copy(strides, strides + 5, view.strides);
        view.buffer = {0, int64_t(sizeof(float)) * H};
        return view;
    };
    args.query = bhsd_view(q.data());
    args.key = bhsd_view(k.data());
    args.value = bhsd_view(v.data());
    args.output = bhsd_view(out.data());
    args.has_scale = true;
    args.scale = 0.125f;
    args.window.right = 0;  // causal
    args.softcap = 30.0f;
    args.alibi.slopes = per_head_view(slopes.data());
    args.sinks = per_head_view(sinks.data());

    double ms;
    if (!example::timed_forward(args, 5, ms)) return 1;
    std::printf("softcap + ALiBi + sinks f32 (%lld,%lld,%lld,%lld) causal on %s: %.3f ms\n", (long long)N,
                (long long)H, (long long)S, (long long)D, graphattn::sdpa_forward_isa(), ms);

    double max_error = 0.0;
    for (int64_t b = 0; b < N; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t head = (b * H + h) * S * D;
            example::Modifiers mods;
            mods.softcap = 30.0, mods.slope = slopes[h], mods.sink = sinks[h], mods.has_sink = true;
            const std::vector<double> want = example::attention_reference(
                q.data() + head, k.data() + head, v.data() + head, nullptr, S, S, D, D, 0.125, true, 0, mods);
            for (int64_t x = 0; x < S * D; ++x) max_error = std::max(max_error, std::abs(want[x] - out[head + x]));
        }
    return example::report("softcap + ALiBi + sinks f32", max_error, 1e-4);
}
