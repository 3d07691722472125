// Grouped-query attention in bf16 with the implicit causal mask, through
// native/cpu's C++ API.  Q has 8 heads and K/V 2: the kernel sees the heads
// as (kv_head, group_member) batch dims, and K/V carry stride 0 over the
// group member, so they are never repeated in memory.  The output is written
// in (batch, seq, heads * head_dim) order, the layout the next projection
// wants, by its strides alone.
#include <cstdio>
#include <vector>

#include "example_check.hpp"
#include "graphattn/sdpa.hpp"

int main() {
    const int64_t Hq = 8, Hkv = 2, G = Hq / Hkv, S = 200, D = 128;
    std::vector<float> qf = example::random_floats(Hq * S * D, 4);
    std::vector<float> kf = example::random_floats(Hkv * S * D, 5);
    std::vector<float> vf = example::random_floats(Hkv * S * D, 6);
    std::vector<uint16_t> q(qf.size()), k(kf.size()), v(vf.size()), out(S * Hq * D);
    for (size_t x = 0; x < qf.size(); ++x) qf[x] = example::from_bf16(q[x] = example::to_bf16(qf[x]));
    for (size_t x = 0; x < kf.size(); ++x) kf[x] = example::from_bf16(k[x] = example::to_bf16(kf[x]));
    for (size_t x = 0; x < vf.size(); ++x) vf[x] = example::from_bf16(v[x] = example::to_bf16(vf[x]));

    graphattn::SdpaForwardArgs args;
    args.batch[0] = 1, args.batch[1] = Hkv, args.batch[2] = G;
    args.seq_q = args.seq_kv = S;
    args.head_dim_qk = args.head_dim_v = D;
    auto view = [](const void* data, std::initializer_list<int64_t> strides) {
        graphattn::TensorView t;
        t.data = data;
        t.dtype = graphattn::DType::bf16;
        std::copy(strides.begin(), strides.end(), t.strides);
        return t;
    };
    args.query = view(q.data(), {0, G * S * D, S * D, D, 1});   // (Hkv, G, S, D)
    args.key = view(k.data(), {0, S * D, 0, D, 1});             // stride 0 over the group
    args.value = view(v.data(), {0, S * D, 0, D, 1});
    args.output = view(out.data(), {0, G * D, D, Hq * D, 1});   // (S, Hq * D)
    args.has_scale = true;
    args.scale = 1.0f / std::sqrt(float(D));
    args.window.right = 0;  // causal, top-left: query i sees key j when j <= i

    double ms;
    if (!example::timed_forward(args, 5, ms)) return 1;
    std::printf("gqa bf16 causal (Hq=%lld, Hkv=%lld, S=%lld, D=%lld) on %s: %.3f ms\n", (long long)Hq,
                (long long)Hkv, (long long)S, (long long)D, graphattn::sdpa_forward_isa(graphattn::DType::bf16, S), ms);

    double max_error = 0.0;
    for (int64_t h = 0; h < Hq; ++h) {
        const int64_t kv = h / G;
        const std::vector<double> want =
            example::attention_reference(qf.data() + h * S * D, kf.data() + kv * S * D, vf.data() + kv * S * D,
                                         nullptr, S, S, D, D, args.scale, true, 0);
        for (int64_t i = 0; i < S; ++i)
            for (int64_t c = 0; c < D; ++c)
                max_error = std::max(max_error, std::abs(want[i * D + c] - example::from_bf16(out[i * Hq * D + h * D + c])));
    }
    return example::report("gqa bf16 causal", max_error, 2e-2);
}
