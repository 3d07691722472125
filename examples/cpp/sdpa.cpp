// Inference SDPA in f32 through native/cpu's C++ API: Q, K, V and the output
// in (batch, heads, seq, head_dim) layout, a scale, and an additive mask
// broadcast over heads by giving its head dimension stride 0.
#include <cstdio>
#include <vector>

#include "example_check.hpp"
#include "graphattn/sdpa.hpp"

int main() {
    const int64_t N = 2, H = 4, S = 256, D = 64;
    const std::vector<float> q = example::random_floats(N * H * S * D, 1);
    const std::vector<float> k = example::random_floats(N * H * S * D, 2);
    const std::vector<float> v = example::random_floats(N * H * S * D, 3);
    std::vector<float> mask(N * S * S, 0.0f);  // (N, 1, S, S): the last 10 keys padded out
    for (int64_t b = 0; b < N; ++b)
        for (int64_t i = 0; i < S; ++i)
            for (int64_t j = S - 10; j < S; ++j) mask[(b * S + i) * S + j] = -1e9f;
    std::vector<float> out(N * H * S * D);

    graphattn::SdpaForwardArgs args;
    args.batch[0] = 1, args.batch[1] = N, args.batch[2] = H;  // the kernel takes three batch dims
    args.seq_q = args.seq_kv = S;
    args.head_dim_qk = args.head_dim_v = D;
    auto bshd_view = [&](const float* data) {  // contiguous (N, H, S, D)
        graphattn::TensorView view;
        view.data = data;
        view.dtype = graphattn::DType::f32;
        const int64_t strides[5] = {0, H * S * D, S * D, D, 1};
        std::copy(strides, strides + 5, view.strides);
        view.buffer = {0, int64_t(sizeof(float)) * N * H * S * D};  // the bytes the checks let the view reach
        return view;
    };
    args.query = bshd_view(q.data());
    args.key = bshd_view(k.data());
    args.value = bshd_view(v.data());
    args.output = bshd_view(out.data());
    args.mask.data = mask.data();
    args.mask.buffer = {0, int64_t(sizeof(float) * mask.size())};
    const int64_t mask_strides[5] = {0, S * S, 0, S, 1};  // stride 0 over heads
    std::copy(mask_strides, mask_strides + 5, args.mask.strides);
    args.mask_kind = graphattn::MaskKind::additive;
    args.has_scale = true;
    args.scale = 0.125f;  // 1 / sqrt(D)

    double ms;
    if (!example::timed_forward(args, 5, ms)) return 1;
    const double gflops = 4.0 * N * H * S * S * D / (ms * 1e-3) / 1e9;
    std::printf("sdpa f32 (%lld,%lld,%lld,%lld) on %s: %.3f ms, %.1f GFLOP/s\n", (long long)N, (long long)H,
                (long long)S, (long long)D, graphattn::sdpa_forward_isa(), ms, gflops);

    double max_error = 0.0;
    for (int64_t b = 0; b < N; ++b)
        for (int64_t h = 0; h < H; ++h) {
            const int64_t head = (b * H + h) * S * D;
            const std::vector<double> want = example::attention_reference(
                q.data() + head, k.data() + head, v.data() + head, mask.data() + b * S * S, S, S, D, D, 0.125, false, 0);
            for (int64_t x = 0; x < S * D; ++x) max_error = std::max(max_error, std::abs(want[x] - out[head + x]));
        }
    return example::report("sdpa f32", max_error, 1e-4);
}
