// Fused dropout on blocks of probabilities, for both lane layouts: the keep
// flags of a run of consecutive elements (one query row, consecutive keys)
// come from graphattn/philox.hpp and become multipliers 1 / (1 - p) or 0.
#pragma once

#include <cstdint>

#include "graphattn/philox.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

struct DropoutPlan {
    bool active = false;
    DropoutParams params{};
    float kept_scale = 1.0f;
    int64_t seq_q = 0, seq_kv = 0;
    uint64_t first_element = 0;

    explicit DropoutPlan(const SdpaForwardArgs& a)
        : seq_q(a.seq_q), seq_kv(a.seq_kv), first_element(a.dropout_first_element) {
        active = a.dropout_p > 0.0f;
        params = {dropout_threshold(a.dropout_p), a.dropout_seed, a.dropout_offset};
        kept_scale = active ? 1.0f / (1.0f - a.dropout_p) : 1.0f;
    }

    // Element index of (flat batch fb, query row i, key 0).
    uint64_t row_base(int64_t flat_batch, int64_t i) const { return row_element(first_element, seq_q, seq_kv, flat_batch, i); }
    // The same for a call's arguments (SdpaForwardArgs' dropout rule), where no plan is at hand.
    static uint64_t row_base(const SdpaForwardArgs& a, int64_t flat_batch, int64_t i) {
        return row_element(a.dropout_first_element, a.seq_q, a.seq_kv, flat_batch, i);
    }

private:
    static uint64_t row_element(uint64_t first, int64_t seq_q, int64_t seq_kv, int64_t flat_batch, int64_t i) {
        return first + uint64_t(flat_batch * seq_q + i) * uint64_t(seq_kv);
    }

public:

    // out[x * stride] = multiplier of key j0 + x of the row starting at element `base`, for x < count.
    void multipliers(uint64_t base, int64_t j0, int count, float* out, int64_t stride, uint8_t* keep_scratch) const {
        dropout_keep_run(params, base + uint64_t(j0), count, keep_scratch);
        for (int x = 0; x < count; ++x) out[x * stride] = keep_scratch[x] ? kept_scale : 0.0f;
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
