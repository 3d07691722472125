// The visibility rule of attention, in one place: which keys a query row
// sees.  Every CPU kernel and the SYCL device code take it from here, so the
// header holds plain arithmetic only (both compilers build it).
//
// Key j is visible to query row i iff
//     i' - left <= j <= i' + right,   i' = i + row_shift,
// where row_shift aligns the rows to the keys: 0 top-left, Skv - Sq
// bottom-right.  A side without a limit holds kNoKeyLimit.  Causal attention
// is right = 0; a sliding window of W keys is left = W - 1, right = 0.
// Hidden keys score `fill`; with -inf (the usual case) they drop out of the
// softmax and kernels skip key blocks no row of theirs sees.
#pragma once

#include <cstdint>

namespace graphattn {

// Far beyond any sequence, and small enough that i + shift + kNoKeyLimit
// cannot overflow.
constexpr int64_t kNoKeyLimit = int64_t(1) << 61;

struct KeyWindow {
    int64_t left = kNoKeyLimit;   // keys before the aligned row a row sees
    int64_t right = kNoKeyLimit;  // keys after it
    int64_t row_shift = 0;        // i' = i + row_shift
    float fill = -__builtin_inff();

    bool limits_left() const { return left < kNoKeyLimit; }
    bool limits_right() const { return right < kNoKeyLimit; }
    bool limited() const { return limits_left() || limits_right(); }
    // Hidden keys weigh 0 (a -inf fill), so blocks of them need no work.
    bool hidden_weigh_zero() const { return fill == -__builtin_inff(); }
    // Key blocks no row sees can be skipped.
    bool skips_blocks() const { return limited() && hidden_weigh_zero(); }

    // The most keys one row sees: the band's width where both sides are
    // limited, else kNoKeyLimit.
    int64_t band_keys() const { return limits_left() && limits_right() ? left + right + 1 : kNoKeyLimit; }

    // The band of visible diagonals: j - i in [lowest_diagonal, highest_diagonal].
    int64_t lowest_diagonal() const { return limits_left() ? row_shift - left : -2 * kNoKeyLimit; }
    int64_t highest_diagonal() const { return limits_right() ? row_shift + right : 2 * kNoKeyLimit; }

    bool sees(int64_t i, int64_t j) const {
        const int64_t d = j - i;
        return d >= lowest_diagonal() && d <= highest_diagonal();
    }
    // First key row i sees, clamped to [0, seq_kv].
    int64_t key_begin(int64_t i, int64_t seq_kv) const { return clamp(i + lowest_diagonal(), 0, seq_kv); }
    // One past the last key row i sees, clamped to [0, seq_kv].
    int64_t key_end(int64_t i, int64_t seq_kv) const { return clamp(i + highest_diagonal() + 1, 0, seq_kv); }
    // First row that sees key j, clamped to [0, seq_q].
    int64_t row_begin(int64_t j, int64_t seq_q) const { return clamp(j - highest_diagonal(), 0, seq_q); }
    // One past the last row that sees key j, clamped to [0, seq_q].
    int64_t row_end(int64_t j, int64_t seq_q) const { return clamp(j - lowest_diagonal() + 1, 0, seq_q); }

    // Rows [i0, i1) against keys [j0, j1), both non-empty.
    enum class Block { all_visible, all_hidden, partial };
    Block block(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
        const int64_t d_min = j0 - (i1 - 1), d_max = (j1 - 1) - i0;  // the block's diagonals
        if (d_max < lowest_diagonal() || d_min > highest_diagonal()) return Block::all_hidden;
        if (d_min >= lowest_diagonal() && d_max <= highest_diagonal()) return Block::all_visible;
        return Block::partial;
    }

    static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
};

}  // namespace graphattn
