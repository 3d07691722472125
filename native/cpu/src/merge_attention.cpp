// Partial results of disjoint key sets (graphattn/sdpa.hpp): merge_attention
// merges outputs by their log-sum-exp, row by row, and accumulate sums
// gradient parts in f32; both in parallel, parts widened from bf16 or f16.
#include <omp.h>

#include <cmath>

#include "graphattn/sdpa.hpp"

#define GRAPHATTN_ISA_NS isa_portable
#include "half_types.hpp"

namespace graphattn {
namespace {

bool is_float(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

// body(load) with load(i) = element i of `data` (f32, bf16 or f16) as f32: the dtype is chosen once, outside
// the caller's loops, so that each of them compiles (and vectorises) for one dtype.
template <class Body>
void with_widening_load(const void* data, DType dt, Body body) {
    if (dt == DType::bf16) {
        const uint16_t* p = static_cast<const uint16_t*>(data);
        body([p](int64_t i) { return isa_portable::bf16_to_f32(p[i]); });
    } else if (dt == DType::f16) {
        const uint16_t* p = static_cast<const uint16_t*>(data);
        body([p](int64_t i) { return isa_portable::f16_to_f32(p[i]); });
    } else {
        const float* p = static_cast<const float*>(data);
        body([p](int64_t i) { return p[i]; });
    }
}

}  // namespace

Status merge_attention(const MergeAttentionArgs& a) {
    if (a.rows < 0 || a.head_dim_v < 1 || a.run_rows < 0)
        return Status::error("merge_attention: rows and run_rows must be >= 0, head_dim_v >= 1");
    if (a.rows > 0 && (!a.out || !a.stats || !a.part_out || !a.part_stats))
        return Status::error("merge_attention: a data pointer is null");
    if (!is_float(a.part_dtype)) return Status::error("merge_attention: part_out's dtype must be f32, bf16 or f16");
    const int64_t dv = a.head_dim_v, run_rows = a.run_rows > 0 ? a.run_rows : (a.rows > 0 ? a.rows : 1);
    with_widening_load(a.part_out, a.part_dtype, [&](auto part_value) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < a.rows; ++r) {
            const int64_t run = r / run_rows, within = r % run_rows;
            const float part = a.part_stats[run * a.part_stats_run_stride + within];
            if (part == -INFINITY) continue;  // the part saw no key: nothing to add
            float& own_stat = a.stats[run * a.stats_run_stride + within];
            const float own = own_stat;
            float* out = a.out + run * a.out_run_stride + within * dv;
            const int64_t part_row = run * a.part_run_stride + within * dv;
            if (own == -INFINITY || std::isnan(part) || std::isnan(own)) {  // the row takes the part (NaN spreads)
                const bool nan = std::isnan(part) || std::isnan(own);
                for (int64_t c = 0; c < dv; ++c) out[c] = nan ? NAN : part_value(part_row + c);
                own_stat = nan ? NAN : part;
                continue;
            }
            const float m = own > part ? own : part;
            const float w = std::exp(own - m), w_part = std::exp(part - m), total = w + w_part;
            const float keep = w / total, take = w_part / total;
            for (int64_t c = 0; c < dv; ++c) out[c] = keep * out[c] + take * part_value(part_row + c);
            own_stat = m + std::log(total);
        }
    });
    return Status::success();
}

Status accumulate(const AccumulateArgs& a) {
    if (a.runs < 0 || a.run_length < 0) return Status::error("accumulate: runs and run_length must be >= 0");
    if (a.runs > 0 && a.run_length > 0 && (!a.sum || !a.part)) return Status::error("accumulate: a data pointer is null");
    if (!is_float(a.part_dtype)) return Status::error("accumulate: part's dtype must be f32, bf16 or f16");
    const int64_t chunk = 4096;  // values per parallel item: runs may be few and long
    const int64_t pieces = (a.run_length + chunk - 1) / chunk;
    with_widening_load(a.part, a.part_dtype, [&](auto part_value) {
#pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < a.runs * pieces; ++item) {
            const int64_t run = item / pieces, begin = item % pieces * chunk;
            const int64_t end = begin + chunk < a.run_length ? begin + chunk : a.run_length;
            float* sum = a.sum + run * a.sum_stride;
            const int64_t part = run * a.part_stride;
            for (int64_t i = begin; i < end; ++i) sum[i] += part_value(part + i);
        }
    });
    return Status::success();
}

}  // namespace graphattn
