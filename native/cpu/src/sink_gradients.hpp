// The gradient of the sinks (graphattn/score_mods.hpp), the same for every
// kernel family: with P = exp(S - stats) unchanged by a sink, only the sink's
// own weight exp(sigma - stats_i) needs it, per batch index b
//     d sigma_b = -sum_i exp(sigma_b - stats_bi) * D_bi,   D_bi = rowsum(dO_bi * O_bi),
// then summed into grad_sinks over the batch dims where its stride is 0.
#pragma once

#include <omp.h>

#include <cmath>
#include <map>
#include <vector>

#include "block_io.hpp"
#include "graphattn/score_mods.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "scratch.hpp"
#include "simd.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

inline void sink_gradients(const SdpaBackwardArgs& args) {
    const SdpaForwardArgs& a = args.forward;
    const int64_t batch = a.batch[0] * a.batch[1] * a.batch[2];
    const int Dv = int(a.head_dim_v);
    std::vector<double> per_index(size_t(batch), 0.0);
    const TensorView &o = a.output, &g = args.grad_output;
    const float* stats = static_cast<const float*>(a.stats.data);
    const float* sinks = static_cast<const float*>(a.sinks.data);
#pragma omp parallel
    {
        AlignedFloats o_row{size_t(Dv)}, do_row{size_t(Dv)};
#pragma omp for schedule(static)
        for (int64_t x = 0; x < batch; ++x) {
            int64_t b[kBatchDims];
            unflatten_batch(a.batch, x, b);
            const double sink = sinks[view_batch_offset(a.sinks, b)];
            double sum = 0.0;
            for (int64_t i = 0; i < a.seq_q; ++i) {
                load_block(element_ptr(o.data, o.dtype, view_batch_offset(o, b) + i * o.strides[3]), o.dtype, 0,
                           o.strides[4], 1, Dv, o_row.get(), Dv, 1);
                load_block(element_ptr(g.data, g.dtype, view_batch_offset(g, b) + i * g.strides[3]), g.dtype, 0,
                           g.strides[4], 1, Dv, do_row.get(), Dv, 1);
                const double lse = stats[view_batch_offset(a.stats, b) + i * a.stats.strides[3]];
                sum += sink_weight(sink, lse, [](double x) { return std::exp(x); }) * double(dot(o_row.get(), do_row.get(), Dv));
            }
            per_index[size_t(x)] = -sum;
        }
    }
    // Indices that share an element (stride 0) add into it, in index order.
    std::map<int64_t, double> totals;  // element offset -> sum
    for (int64_t x = 0; x < batch; ++x) {
        int64_t b[kBatchDims];
        unflatten_batch(a.batch, x, b);
        totals[view_batch_offset(args.grad_sinks, b)] += per_index[size_t(x)];
    }
    float* out = static_cast<float*>(const_cast<void*>(args.grad_sinks.data));
    for (const auto& [at, total] : totals) out[at] = float(total);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
