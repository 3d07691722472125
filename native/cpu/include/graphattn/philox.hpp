// Philox4x32-10 (Salmon et al., SC'11) and the dropout keep decision built on
// it, shared by every kernel (and written to compile as SYCL device code):
// element e of the attention-probability tensor, in row-major order over
// (batch..., Sq, Skv), uses word e % 4 of Philox(key = seed,
// counter = (e / 4, offset)) and is kept when that word >= p * 2^32.
// The decision depends on (seed, offset, e) only, so the forward and the
// backward, any thread count and any device regenerate the same mask; it
// matches graphattn/ops/philox.py, the reference.
#pragma once

#include <cstdint>

namespace graphattn {

struct PhiloxWords {
    uint32_t w[4];
};

inline PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
        const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
        const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
        const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
        const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return {{c0, c1, c2, c3}};
}

// Elements are kept when their word is >= this (p in [0, 1)).
inline uint32_t dropout_threshold(float p) {
    const double t = double(p) * 4294967296.0;
    return t >= 4294967295.0 ? 4294967295u : uint32_t(t);
}

struct DropoutParams {
    uint32_t threshold;
    uint64_t seed;
    uint64_t offset;
};

// keep[x] = 1 if element e0 + x is kept, else 0, for x < count.
inline void dropout_keep_run(const DropoutParams& d, uint64_t e0, int count, uint8_t* keep) {
    const uint32_t k0 = uint32_t(d.seed), k1 = uint32_t(d.seed >> 32);
    const uint32_t o0 = uint32_t(d.offset), o1 = uint32_t(d.offset >> 32);
    int x = 0;
    while (x < count) {
        const uint64_t e = e0 + uint64_t(x);
        const uint64_t block = e >> 2;
        const PhiloxWords r = philox4x32_10(uint32_t(block), uint32_t(block >> 32), o0, o1, k0, k1);
        for (int word = int(e & 3); word < 4 && x < count; ++word, ++x) keep[x] = r.w[word] >= d.threshold;
    }
}

}  // namespace graphattn
