// merge_attention (graphattn/sdpa.hpp): partial results of disjoint key sets
// merged by their log-sum-exp, row by row, in parallel over rows.
#include <omp.h>

#include <cmath>

#include "graphattn/sdpa.hpp"

namespace graphattn {

Status merge_attention(const MergeAttentionArgs& a) {
    if (a.rows < 0 || a.head_dim_v < 1) return Status::error("merge_attention: rows must be >= 0, head_dim_v >= 1");
    if (a.rows > 0 && (!a.out || !a.stats || !a.part_out || !a.part_stats))
        return Status::error("merge_attention: a data pointer is null");
    const int64_t dv = a.head_dim_v;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
        const float part = a.part_stats[r];
        if (part == -INFINITY) continue;  // the part saw no key: nothing to add
        const float own = a.stats[r];
        float* out = a.out + r * dv;
        const float* part_out = a.part_out + r * dv;
        if (own == -INFINITY || std::isnan(part) || std::isnan(own)) {  // the row takes the part (NaN spreads)
            const bool nan = std::isnan(part) || std::isnan(own);
            for (int64_t c = 0; c < dv; ++c) out[c] = nan ? NAN : part_out[c];
            a.stats[r] = nan ? NAN : part;
            continue;
        }
        const float m = own > part ? own : part;
        const float w = std::exp(own - m), w_part = std::exp(part - m), total = w + w_part;
        const float keep = w / total, take = w_part / total;
        for (int64_t c = 0; c < dv; ++c) out[c] = keep * out[c] + take * part_out[c];
        a.stats[r] = m + std::log(total);
    }
    return Status::success();
}

}  // namespace graphattn
