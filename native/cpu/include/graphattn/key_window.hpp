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

// How query rows align to keys, for the window and ALiBi alike: as_given
// takes the window's row_shift as it is; top_left is i' = i; bottom_right is
// i' = i + Skv - Sq, with the lengths of the row's own sequence (each
// sequence of a packed call has its own).
enum class RowAlignment : int32_t { as_given = 0, top_left = 1, bottom_right = 2 };

// i' - i for a sequence of seq_q query rows and seq_kv keys.
inline int64_t aligned_row_shift(RowAlignment alignment, int64_t seq_q, int64_t seq_kv) {
    return alignment == RowAlignment::bottom_right ? seq_kv - seq_q : 0;
}

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

    // Visible (row, key) pairs of rows [0, seq_q) against keys [0, seq_kv):
    // the work a sequence holds, in closed form (a planner's measure).
    int64_t visible_pairs(int64_t seq_q, int64_t seq_kv) const {
        if (seq_q <= 0 || seq_kv <= 0) return 0;
        const int64_t lo = clamp(lowest_diagonal(), -seq_q - 1, seq_kv + 1);
        const int64_t hi = clamp(highest_diagonal(), -seq_q - 1, seq_kv + 1);
        if (hi < lo) return 0;
        // sum over rows of key_end - key_begin, each a clamped line in i
        return clamped_line_sum(hi + 1, seq_q, seq_kv) - clamped_line_sum(lo, seq_q, seq_kv);
    }

    static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

private:
    // sum of clamp(i + c, 0, n) over i in [0, rows).
    static int64_t clamped_line_sum(int64_t c, int64_t rows, int64_t n) {
        const int64_t zero_until = clamp(-c, 0, rows);      // rows whose value is 0
        const int64_t full_from = clamp(n - c, 0, rows);    // rows from which the value is n
        const int64_t a = zero_until, b = full_from > a ? full_from : a;  // rows [a, b) rise linearly
        const int64_t rising = (b - a) * c + (a + b - 1) * (b - a) / 2;
        return rising + (rows - b) * n;
    }
};

}  // namespace graphattn
