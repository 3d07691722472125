// FlashAttention-2 forward on AMX tiles for bf16 inputs, and for f16 and f32
// inputs split into two or three bf16 parts (amx_split.hpp); flags set in
// CMakeLists.txt, chosen by dispatch.cpp only where the CPU has AMX-BF16 and
// the OS granted the tile state.
//
// Per work item (one batch index, up to kBlockQ query rows): Q is packed once as
// bf16 rows; per key block, K is packed into VNNI pairs (a 16 x 16 word
// transpose), V rows are interleaved pairwise, S = Q K^T is computed on
// tiles in f32, the online softmax runs row by row in AVX-512 (base 2, one
// exp2 per score) and writes P as bf16, and O += P V accumulates on tiles
// straight into the f32 output accumulator.  Row tiles go in pairs, one
// pair's scores and probabilities at a time: the tile unit and the vector
// units did not overlap on these cores (a pipeline across pairs measured no
// faster), and one pair's buffers stay small.  Scale and masks are applied to
// S in f32, as in the reference.  With split inputs each packed operand holds
// its parts in planes of their own, and each tile product runs over every
// kept part product.  Where the items are fewer than the threads, each also
// takes only a range of the keys, and the range finished last merges them by
// their log-sum-exp (key_splits.hpp).
#define GRAPHATTN_ISA_NS isa_amx
#define GRAPHATTN_LANES 16

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "amx_packing.hpp"
#include "amx_split.hpp"
#include "amx_tiles.hpp"
#include "block_io.hpp"
#include "isa_entry_points.hpp"
#include "key_splits.hpp"
#include "kv_reader.hpp"
#include "lane_masks.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace isa_amx {
namespace {

constexpr int kBlockQ = 512;  // query rows per item at most
// Item sizes tried in turn: the largest that still gives every thread a few
// items (each item packs every K/V block it reads, so larger items pack less).
// Packing each block once per call instead, shared by all items, was slower:
// the items then load their tiles from blocks other cores packed, not from
// their own L1/L2.
constexpr int kItemRows[] = {kBlockQ, 256, 128, 64};
constexpr int kLargeItemRows = 256;  // see plan_items
constexpr int kPairRows = 32;  // a pair of row tiles
// Rows per piece of the last wave of items (work_order.hpp).
constexpr int kLastWavePieceRows = 128;
// 512 keys per block: each O accumulator tile pair is loaded and stored once
// per 16 reduction steps of P V (tile loads and stores cost about as much as
// a product on these cores), and each row's softmax bookkeeping covers more
// keys.  Scores are computed only up to the keys a pair of row tiles can see
// (causal cut, partial blocks).
constexpr int kBlockKV = 512;
// Row strides of the tile operands and results, padded by one cache line: at
// 2^n bytes, the 16 rows of a tile would share a few L1 sets.  Constants:
// as runtime values (sized to short key blocks) they cost a lone bf16 item
// of 17 rows and 768 keys 3-7% (this 2-core machine).
constexpr int kKeyPairsLd = kBlockKV + 16;  // packed K rows, in pair words
constexpr int kScoresLd = kBlockKV + 16;    // S rows, in floats

// Row stride of packed V in pair words, for dvp columns (Dv padded to whole
// tiles): one cache line more, as kKeyPairsLd.
int packed_v_ld(int dvp) { return dvp + 16; }

// 32-bit words of one packed key block of K (dp: D padded to whole tiles)
// and of V, `parts` planes each: what pack_k and pack_v write.
int64_t packed_k_block_words(int dp, int parts) { return int64_t(parts) * dp / 2 * kKeyPairsLd; }
int64_t packed_v_block_words(int dvp, int parts) { return int64_t(parts) * kBlockKV / 2 * packed_v_ld(dvp); }

// Per-thread buffers; bf16 data is kept as uint16_t and pairs as uint32_t.
// Split operands keep `parts` planes (1 for bf16).  Q and O hold the call's
// item rows, not kBlockQ: scratch past the ThreadBlockCache's bounds comes
// from the OS afresh on every call, page faults included.
struct Scratch {
    int dp, dvp;      // head sizes padded to whole tiles
    int parts;
    int item_rows;    // query rows per item at most: a multiple of kPairRows
    int p_ld, v_ld, o_ld;  // row strides of P (words), packed V (pair words) and O (floats)
    // Packed K/V block slots.  More than one (kept_kv_blocks): every key block of one K/V batch index, each
    // packed by the first of this thread's items that reads it; else one, packed per item and block.
    // k() and v() point at block `slot`.
    int64_t k_block_words, v_block_words;
    std::vector<uint8_t> slot_packed;  // one per slot
    int slot = 0;
    int64_t slots_k_base = -1, slots_v_base = -1;  // K's and V's batch offsets whose blocks the slots hold
    AlignedFloats q_store, k_store, v_store, s_store, p_store, mask_store, o_store, out_store;
    AlignedFloats wide_store;  // split inputs with strided columns only: a block as f32 (split_source)
    KvStage kv_stage;          // a K or V block where its layout keeps the rows apart (kv_reader.hpp)
    Scratch(int D, int Dv, int parts, int64_t rows, int kv_slots)
        : dp(int(round_up(D, kTileBf16Cols))),
          dvp(int(round_up(Dv, kTileBf16Cols))),
          parts(parts),
          item_rows(int(round_up(std::min<int64_t>(rows, kBlockQ), kPairRows))),
          p_ld(parts * kBlockKV + 32),
          v_ld(packed_v_ld(dvp)),
          o_ld(dvp + 16),
          k_block_words(packed_k_block_words(dp, parts)),
          v_block_words(packed_v_block_words(dvp, parts)),
          slot_packed(size_t(kv_slots), 0),
          q_store(AlignedFloats::uninitialized(size_t(item_rows) * parts * dp / 2)),
          k_store(AlignedFloats::uninitialized(size_t(kv_slots) * k_block_words)),
          v_store(AlignedFloats::uninitialized(size_t(kv_slots) * v_block_words)),
          s_store(AlignedFloats::uninitialized(size_t(kPairRows) * kScoresLd)),
          p_store(AlignedFloats::uninitialized(size_t(kPairRows) * p_ld / 2)),
          mask_store(AlignedFloats::uninitialized(size_t(kPairRows) * kScoresLd)),
          o_store(AlignedFloats::uninitialized(size_t(item_rows) * o_ld)),
          out_store(AlignedFloats::uninitialized(size_t(dvp))),
          wide_store(AlignedFloats::uninitialized(parts > 1 ? size_t(std::max(item_rows, kBlockKV)) * std::max(D, Dv)
                                                            : 0)) {}
    uint16_t* q() const { return reinterpret_cast<uint16_t*>(q_store.get()); }
    uint32_t* k() const { return reinterpret_cast<uint32_t*>(k_store.get()) + slot * k_block_words; }
    uint32_t* v() const { return reinterpret_cast<uint32_t*>(v_store.get()) + slot * v_block_words; }
    uint16_t* p() const { return reinterpret_cast<uint16_t*>(p_store.get()); }
    bool keeps_blocks() const { return slot_packed.size() > 1; }
    __mmask16 infinite = 0;  // lanes of split inputs that held an infinity
    float row_max[kBlockQ];
    VecF row_sums[kBlockQ];  // per-lane partial sums, reduced once per row at the end
    int64_t query_index[kBlockQ], mask_offset[kBlockQ];
};

const uint16_t* bf16_at(const TensorView& t, int64_t offset) { return static_cast<const uint16_t*>(t.data) + offset; }

// Where the split packings read `rows` rows of `cols` values of Q from
// element `base`, or of K or V from row j0 of their batch element at `base`:
// in place where the columns are contiguous, else an f32 copy in sc.wide_store.
SplitRows split_source(const TensorView& q, int64_t base, int rows, int cols, Scratch& sc) {
    const RowBlock in = view_rows(q, base);
    if (in.col_stride == 1) return {in.data, in.dtype, in.row_stride, rows, cols};
    float* wide = sc.wide_store.get();
    load_block(in.data, in.dtype, in.row_stride, in.col_stride, rows, cols, wide, cols, 1);
    return {wide, DType::f32, cols, rows, cols};
}
SplitRows split_source(const KvReader& kv, int64_t base, int64_t j0, int rows, int cols, Scratch& sc) {
    if (kv.rows_in_place()) {
        const RowBlock in = kv.block(base, j0, rows, sc.kv_stage);
        return {in.data, in.dtype, in.row_stride, rows, cols};
    }
    float* wide = sc.wide_store.get();
    kv.load_f32(base, j0, rows, cols, wide, cols);
    return {wide, DType::f32, cols, rows, cols};
}

// Row r of the packed Q holds, for each term t, the part a_part(t) of q[r]
// (dp values each); zeros up to the row tiles' rows (a multiple of 32).
template <int Parts>
void pack_q(const TensorView& q, int64_t base, int rows, int D, Scratch& sc) {
    uint16_t* dst = sc.q();
    const int ld = sc.parts * sc.dp, height = int(round_up(rows, 32));
    if constexpr (Parts == 1) {
        std::memset(dst, 0, size_t(height) * ld * 2);
        for (int r = 0; r < rows; ++r) {
            const uint16_t* src = bf16_at(q, base + r * q.strides[3]);
            for (int d = 0; d < D; ++d) dst[r * ld + d] = src[d * q.strides[4]];
        }
    } else {
        pack_rows_split<Parts>(split_source(q, base, rows, D, sc), sc.dp, dst, ld, sc.infinite);
        std::memset(dst + size_t(rows) * ld, 0, size_t(height - rows) * ld * 2);
    }
}

// k[p][j] = (K[j][2p], K[j][2p + 1]) for the key block's first
// round_up(kv_rows, 32) keys (all that scores_on_tiles reads); zeros past
// kv_rows and D.  Split: term t's dp / 2 pair rows hold part b_part(t).
template <int Parts>
void pack_k(const KvReader& k, int64_t base, int64_t j0, int kv_rows, int D, Scratch& sc) {
    const int width = int(round_up(kv_rows, 32));
    if constexpr (Parts == 1) {
        const RowBlock in = k.block(base, j0, kv_rows, sc.kv_stage);
        pack_column_pairs({in.words(), in.row_stride, in.col_stride, kv_rows, D}, width, sc.dp, sc.k(), kKeyPairsLd);
    } else {
        pack_column_pairs_split<Parts>(split_source(k, base, j0, kv_rows, D, sc), width, sc.dp, sc.k(), kKeyPairsLd,
                                       sc.infinite);
    }
}

// v[jp][c] = (V[2jp][c], V[2jp + 1][c]) for the key block's first
// round_up(kv_rows, 32) keys (all that accumulate_on_tiles reads); zeros past
// kv_rows and Dv.  Split: term t's pair rows, kBlockKV / 2 apart, hold part b_part(t).
template <int Parts>
void pack_v(const KvReader& v, int64_t base, int64_t j0, int kv_rows, int Dv, Scratch& sc) {
    const int height = int(round_up(kv_rows, 32));
    if constexpr (Parts == 1) {
        const RowBlock in = v.block(base, j0, kv_rows, sc.kv_stage);
        pack_row_pairs({in.words(), in.row_stride, in.col_stride, kv_rows, Dv}, height, sc.dvp, sc.v(), sc.v_ld);
    } else {
        pack_row_pairs_split<Parts>(split_source(v, base, j0, kv_rows, Dv, sc), height, sc.dvp, sc.v(), sc.v_ld,
                                    kBlockKV / 2, sc.infinite);
    }
}

// s[r - 16 m][j] = sum_d q[r][d] k[j][d] for the 32 rows r of row tiles m, m + 1
// and the first `cols` keys (a multiple of 32), over every term, on tiles 0-7.
template <int Parts>
void scores_on_tiles(const Scratch& sc, int m, int cols, float* s) {
    const int ld = Parts * sc.dp;
    const int64_t k_plane = int64_t(sc.dp / 2) * kKeyPairsLd;
    for (int n = 0; n < cols / 16; n += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        tiles_2x2_split_product<Parts>(sc.q() + (m * 16) * ld, ld * 2, 16 * ld, sc.dp, sc.k() + n * 16,
                                       kKeyPairsLd * 4, k_plane, sc.dp / kTileBf16Cols);
        store_tiles_2x2(s + n * 16, kScoresLd * 4);
    }
}

// o[r][c] += sum_j p[r - 16 m][j] v[j][c] for the 32 rows r of row tiles m, m + 1
// and keys < kv_rows, over every term.
template <int Parts>
void accumulate_on_tiles(const Scratch& sc, int m, const uint16_t* p, int kv_rows, float* o) {
    const int ld = sc.p_ld;
    const int key_chunks = (kv_rows + kTileBf16Cols - 1) / kTileBf16Cols;
    for (int c = 0; c < sc.dvp / 16; c += 2) {
        float* acc = o + (m * 16) * sc.o_ld + c * 16;
        load_tiles_2x2(acc, sc.o_ld * 4);
        tiles_2x2_split_product<Parts>(p, ld * 2, 16 * ld, kBlockKV, sc.v() + c * 16, sc.v_ld * 4,
                                       int64_t(kBlockKV / 2) * sc.v_ld, key_chunks);
        store_tiles_2x2(acc, sc.o_ld * 4);
    }
}

// Updates the running max and sum of rows r0 .. r0 + R - 1 with their scores
// in base-2 units (the raw scores times load_scale > 0, so the max is taken
// on the raw values and the scale enters the exponent's FMA), writes their
// probabilities as bf16 (parts) and rescales their accumulator rows where
// the max grew; only the first `vecs` vectors (an even count) of each row are
// read.  R rows at once: each row's max is a chain of dependent
// reductions, and R of them side by side keep the vector units busy.  The
// probabilities are rounded to bf16, or split into two parts good to 2^-17,
// so the coarse exp2 serves; three parts (f32) take the full-precision one.
// Scores are rows kScoresLd apart, P rows p_ld and accumulator rows o_ld.
// Capped: the softcap (base-2 units, taking the raw scores: its input scale
// is load_scale) is taken here, so that a softcap alone needs no pass of its
// own; -inf (a hidden key) stays -inf, and as the softcap is monotonic the
// max is the softcap of the raw max.
template <int Parts, int R, bool Capped = false>
void softmax_rows(Scratch& sc, const float* s_rows, int vecs, int r0, float load_scale, uint16_t* p_rows,
                  float* o_rows, const Softcap& raw_cap = Softcap()) {
    constexpr bool kCoarseExp = Parts < 3;
    float new_max[R], base[R], old_max[R];
    for (int i = 0; i < R; ++i) {
        VecF m = splat(-__builtin_inff());
        for (int v = 0; v < vecs; ++v) m = max_ignoring_nan(load(s_rows + i * kScoresLd + v * kLanes), m);
        old_max[i] = sc.row_max[r0 + i];
        const float raw_max = _mm512_reduce_max_ps((__m512)m);
        float block_max = raw_max * load_scale;
        if (Capped && block_max != -__builtin_inff()) block_max = raw_cap(splat(raw_max))[0];
        new_max[i] = block_max > old_max[i] ? block_max : old_max[i];
        base[i] = new_max[i] == -__builtin_inff() ? 0.0f : new_max[i];  // no finite score yet: 2^-inf = 0
    }
    // P = 2^(s * scale - base), in one FMA per vector, where the base (the
    // rounded s_max * scale) is under 2^24: the FMA's exact product then
    // leaves the row's largest score a residual of at most 1/2.  From 2^24 on
    // that residual grows with the base (+-128 near 2^32: P overflows or
    // vanishes), so such rows round s * scale first, as the max was, and
    // their largest score gives exactly 2^0.  The embedded rounding keeps the
    // compiler from contracting that product and difference into an FMA.
    constexpr float kExactFmaBase = 0x1p24f;
    const __m512 scale = _mm512_set1_ps(load_scale);
    auto exponents = [&](auto rounded_product, const float* x, __m512 b) {
        if constexpr (Capped) {
            const VecF raw = (VecF)_mm512_loadu_ps(x);
            return (raw == -__builtin_inff() ? raw : raw_cap(raw)) - (VecF)b;
        } else if constexpr (decltype(rounded_product)::value)
            return (VecF)_mm512_sub_ps(
                _mm512_mul_round_ps(_mm512_loadu_ps(x), scale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), b);
        else
            return (VecF)_mm512_fmsub_ps(_mm512_loadu_ps(x), scale, b);
    };
    for (int i = 0; i < R; ++i) {
        const __m512 shift = _mm512_set1_ps(base[i]);
        const float* s_row = s_rows + i * kScoresLd;
        uint16_t* p_row = p_rows + size_t(i) * sc.p_ld;
        VecF sum{};
        auto row = [&](auto rounded_product) {
            for (int v = 0; v < vecs; v += 2) {
                const VecF p0 = vexp2<kCoarseExp>(exponents(rounded_product, s_row + v * kLanes, shift));
                const VecF p1 = vexp2<kCoarseExp>(exponents(rounded_product, s_row + (v + 1) * kLanes, shift));
                sum += p0 + p1;
                __m512i parts[Parts];
                split_32<Parts>((__m512)p0, (__m512)p1, parts);
                for (int part = 0; part < Parts; ++part)
                    _mm512_storeu_si512(p_row + part * kBlockKV + v * kLanes, parts[part]);
            }
        };
        if (Capped || std::fabs(base[i]) < kExactFmaBase)  // capped scores are under the cap
            row(std::false_type{});
        else
            row(std::true_type{});
        const int r = r0 + i;
        const float correction = new_max[i] == old_max[i] ? 1.0f : std::exp2(old_max[i] - base[i]);
        sc.row_sums[r] = sc.row_sums[r] * correction + sum;
        sc.row_max[r] = new_max[i];
        if (correction != 1.0f) {
            float* o_row = o_rows + size_t(i) * sc.o_ld;
            for (int c = 0; c < sc.dvp; c += kLanes) store(o_row + c, load(o_row + c) * correction);
        }
    }
}

// Writes output row i of batch index b from its unnormalised accumulator row
// o_row, the row's running max (base 2) and its sum; `out` holds one row.
void write_output_row(const SdpaForwardArgs& a, const int64_t b[kBatchDims], int64_t i, const float* o_row,
                      float row_max, float sum, int Dv, float* out) {
    float out_scale = 1.0f;
    if (a.sinks.data) fold_row_sink(sink_log2(a, b), row_max, sum, out_scale);
    const float factor = row_factor(a, sum) * out_scale;
    for (int c = 0; c < Dv; ++c) out[c] = o_row[c] * factor;
    const TensorView& o = a.output;
    store_view_row(out, Dv, o, view_batch_offset(o, b) + i * o.strides[3]);
    if (a.stats.data) {
        float* stats = static_cast<float*>(const_cast<void*>(a.stats.data));
        stats[view_batch_offset(a.stats, b) + i * a.stats.strides[3]] = row_lse(a, row_max, sum);
    }
}

// Split keys (run_forward): one (item, split)'s results for items of up to
// `rows` rows, per row its unnormalised accumulator row (Dv floats), then
// every row's max, then every row's sum.
struct PartialLayout {
    int64_t rows, Dv;
    size_t floats() const { return size_t(rows * (Dv + 2)); }
    int64_t row(int r) const { return r * Dv; }
    int64_t max_of(int r) const { return rows * Dv + r; }
    int64_t sum_of(int r) const { return rows * (Dv + 1) + r; }
};

// Merges the splits of the item of rows i0 .. i0 + rows of batch index b by
// their log-sum-exp and writes it; `acc` holds one row.
void merge_and_write(const SdpaForwardArgs& a, const int64_t b[kBatchDims], int64_t i0, int rows,
                     const PartialLayout& layout, const float* partials, int64_t splits, float* acc, float* out) {
    const int Dv = int(a.head_dim_v);
    for (int r = 0; r < rows; ++r) {
        float row_max, row_sum;
        merge_split_row(partials + layout.row(r), 1, partials + layout.max_of(r), partials + layout.sum_of(r),
                        int64_t(layout.floats()), splits, Dv, acc, 1, row_max, row_sum);
        write_output_row(a, b, i0 + r, acc, row_max, row_sum, Dv, out);
    }
}

// Rows i0 .. i0 + rows of batch index b against keys [key_begin, key_end)
// (key_begin a multiple of kBlockKV): into the output, or (split keys) into
// `partial` as `layout` lays it out.
template <int Parts>
void run_item(const SdpaForwardArgs& a, Scratch& sc, const int64_t b[kBatchDims], int64_t i0, int rows,
              int64_t key_begin, int64_t key_end, bool skip_hidden_blocks, const PartialLayout& layout,
              float* partial) {
    const int D = int(a.head_dim_qk), Dv = int(a.head_dim_v);
    const int row_tiles = int(round_up(rows, 32) / 16);  // tiles go in pairs
    const float scale = score_scale(a);
    const float scale_log2 = scale * kLog2e;
    const TensorView& q = a.query;
    const KvReader k(a.key), v(a.value);
    for (int r = 0; r < rows; ++r) {
        sc.query_index[r] = i0 + r;
        sc.mask_offset[r] = view_batch_offset(a.mask, b) + (i0 + r) * a.mask.strides[3];
    }
    pack_q<Parts>(q, view_batch_offset(q, b) + i0 * q.strides[3], rows, D, sc);
    std::fill(sc.o_store.get(), sc.o_store.get() + size_t(row_tiles) * 16 * sc.o_ld, 0.0f);  // the rows tiles touch
    std::fill(sc.row_max, sc.row_max + rows, -__builtin_inff());
    std::fill(sc.row_sums, sc.row_sums + rows, VecF{});

    const KeyWindow& window = a.window;
    const float slope = slope_log2(a, b);
    const ScoreMods mods(a);
    const int64_t kv_end = skip_hidden_blocks ? std::min(key_end, window.key_end(i0 + rows - 1, a.seq_kv)) : key_end;
    const int64_t k_base = k.batch_offset(b), v_base = v.batch_offset(b);
    const bool keeps = sc.keeps_blocks();
    // The first key some row of the item sees; kept blocks go by their index, so they stay whole.
    const int64_t first_key = window.key_begin(i0, a.seq_kv);
    const int64_t kv_begin =
        skip_hidden_blocks ? std::max(key_begin, keeps ? first_key / kBlockKV * kBlockKV : first_key) : key_begin;
    if (keeps && (k_base != sc.slots_k_base || v_base != sc.slots_v_base)) {
        std::fill(sc.slot_packed.begin(), sc.slot_packed.end(), 0);
        sc.slots_k_base = k_base;
        sc.slots_v_base = v_base;
    }
    // Kept blocks hold the keys that any row of the call sees, for the items that read them after this one;
    // keys this item's rows do not see score -inf here and weigh 0, as the padding would.
    const int64_t pack_end = keeps ? visible_keys_of(a) : kv_end;
    // Without a mask or ALiBi, with a positive scale and hidden keys at
    // -inf (if any), scores only need -inf outside each row's visible keys
    // (window, padding) and keep the scale (and any softcap) for the
    // softmax; the other calls' scores are scaled and masked first.
    const bool only_cut = !needs_score_pass(a) && scale_log2 > 0.0f && (!window.limited() || skip_hidden_blocks);
    const float load_scale = only_cut ? scale_log2 : 1.0f;
    const bool capped_softmax = only_cut && mods.capped;
    const Softcap raw_cap = capped_softmax ? Softcap(mods.softcap.cap, load_scale) : Softcap();
    for (int64_t j0 = kv_begin; j0 < kv_end; j0 += kBlockKV) {
        const int kv_rows = int(std::min<int64_t>(kBlockKV, kv_end - j0));
        sc.slot = keeps ? int(j0 / kBlockKV) : 0;
        if (!keeps || !sc.slot_packed[sc.slot]) {
            const int pack_rows = int(std::min<int64_t>(kBlockKV, pack_end - j0));
            pack_k<Parts>(k, k_base, j0, pack_rows, D, sc);
            pack_v<Parts>(v, v_base, j0, pack_rows, Dv, sc);
            sc.slot_packed[sc.slot] = 1;
        }
        // Keys of this block that rows of the pair at row tile m can see: past them
        // every score is -inf (hidden by the window) or padding.
        auto pair_keys = [&](int m) {
            if (!skip_hidden_blocks) return kv_rows;
            const int64_t last_row = i0 + std::min(rows, m * 16 + kPairRows) - 1;
            if (window.key_begin(i0 + m * 16, a.seq_kv) >= j0 + kv_rows) return 0;  // keys before the window
            return int(std::clamp<int64_t>(window.key_end(last_row, a.seq_kv) - j0, 0, kv_rows));
        };
        float* s = sc.s_store.get();
        uint16_t* p = sc.p();
        for (int m = 0; m < row_tiles; m += 2) {
            const int keys = pair_keys(m), cols = int(round_up(keys, 32));
            if (keys == 0) continue;  // no key of this block is visible to these rows
            const int r0 = m * 16, r1 = std::min(rows, r0 + kPairRows);
            scores_on_tiles<Parts>(sc, m, cols, s);
            if (only_cut) {
                for (int r = 0; r < r1 - r0; ++r) {
                    float* row = s + r * kScoresLd;
                    const int64_t i = i0 + r0 + r;
                    const int64_t end = std::clamp<int64_t>(window.key_end(i, a.seq_kv) - j0, 0, kv_rows);
                    const int64_t begin = std::clamp<int64_t>(window.key_begin(i, a.seq_kv) - j0, 0, end);
                    std::fill(row, row + begin, -__builtin_inff());
                    std::fill(row + end, row + cols, -__builtin_inff());
                }
            } else {
                mask_key_lanes<kScoresLd / kLanes>(a, s, sc.mask_store.get(), sc.mask_offset + r0, sc.query_index + r0,
                                                   r1 - r0, keys, j0, KeyLaneMods{slope}, cols / kLanes, scale_log2);
            }
            auto softmax_at = [&](auto rows, int r) {
                uint16_t* p_rows = p + size_t(r - r0) * sc.p_ld;
                float* o_rows = sc.o_store.get() + size_t(r) * sc.o_ld;
                if (capped_softmax)
                    softmax_rows<Parts, rows.value, true>(sc, s + (r - r0) * kScoresLd, cols / kLanes, r, load_scale,
                                                          p_rows, o_rows, raw_cap);
                else
                    softmax_rows<Parts, rows.value>(sc, s + (r - r0) * kScoresLd, cols / kLanes, r, load_scale, p_rows,
                                                    o_rows);
            };
            int r = r0;
            for (; r + 4 <= r1; r += 4) softmax_at(std::integral_constant<int, 4>{}, r);
            for (; r < r1; ++r) softmax_at(std::integral_constant<int, 1>{}, r);
            accumulate_on_tiles<Parts>(sc, m, p, keys, sc.o_store.get());
        }
    }
    for (int r = 0; r < rows; ++r) {
        const float* o_row = sc.o_store.get() + size_t(r) * sc.o_ld;
        const float sum = horizontal_sum(sc.row_sums[r]);
        if (!partial) {
            write_output_row(a, b, i0 + r, o_row, sc.row_max[r], sum, Dv, sc.out_store.get());
            continue;
        }
        std::copy(o_row, o_row + Dv, partial + layout.row(r));
        partial[layout.max_of(r)] = sc.row_max[r];
        partial[layout.sum_of(r)] = sum;
    }
}

// Whether large items split their keys before smaller items are tried (see
// plan_items): f16, and f32 from head size 96 on, where f32's six products
// per product make the tiles worth their per-item packing (at D = 64 and 80
// the vector build runs near its FMA peak).
bool splits_keys_first(const SdpaForwardArgs& a, int parts) {
    return parts == 2 || (parts == 3 && a.head_dim_qk >= 96);
}

// Query rows per work item and key splits per item.  Larger items pack each
// K/V block for more query rows; smaller ones keep every thread busy on
// small N*H.  Under a causal mask items differ in work, so the largest size
// also needs twice the items, to even out the threads' last ones.  Where
// even the smallest items leave threads idle, their keys are split too
// (about two pieces of work per thread) and merged by their log-sum-exp;
// where threads stay idle even then (keys too few to split), items shrink to
// one pair of row tiles.
// split_keys_first: where no item of kLargeItemRows rows or more gives the
// threads enough work alone, such items with their keys split are taken
// before smaller ones (f16, whose per-item packing splits each K/V value in
// two; f32 see splits_keys_first).  Not under a causal mask: there 256-row
// items with split keys ran slower than the smaller whole items.
struct ItemPlan {
    int64_t rows;
    KeySplits splits;
};

// Under a window with a left limit an item visits its rows' keys, its own
// row count more than a row sees: items of at most 1/kWindowKeysPerItemRow
// of the window keep that excess small.
constexpr int64_t kWindowKeysPerItemRow = 8;

ItemPlan plan_items(int64_t batch, int64_t seq_q, int64_t visible_keys, int64_t threads, bool uneven,
                    bool split_keys_first, int64_t max_rows) {
    const int64_t wanted = 4 * threads;  // pieces of work
    auto items_of = [&](int64_t rows) { return batch * ((seq_q + rows - 1) / rows); };
    for (const int rows : kItemRows) {
        if (rows > max_rows && rows != kItemRows[std::size(kItemRows) - 1]) continue;
        const int64_t items = items_of(rows);
        if (items >= (rows == kBlockQ && uneven ? 2 : 1) * wanted)
            return {rows, plan_key_splits(items, threads, 2, visible_keys, kBlockKV)};
        if (rows != kLargeItemRows || !split_keys_first || uneven) continue;
        for (const int large : {kBlockQ, kLargeItemRows}) {  // the large sizes again, now with split keys
            const int64_t n = items_of(large), splits = key_split_count(wanted, n, visible_keys, kMinKeysPerSplit);
            if (n * splits >= wanted) return {large, even_key_splits(splits, visible_keys, kBlockKV)};
        }
    }
    const int64_t smallest = kItemRows[std::size(kItemRows) - 1];
    const KeySplits splits = plan_key_splits(items_of(smallest), threads, 2, visible_keys, kBlockKV);
    if (items_of(smallest) * splits.count < threads)  // threads idle even so: items of one row-tile pair
        return {kPairRows, plan_key_splits(items_of(kPairRows), threads, 2, visible_keys, kBlockKV)};
    return {smallest, splits};
}

// How a call's work goes to threads: items of plan.rows query rows, each
// with its keys in plan.splits, handed out as the units of `wave` (whole
// items, then the last wave's pieces) times the splits, on `team` threads,
// home first (HomeFirstUnits) where `home`.
struct ForwardWork {
    int64_t batch, q_blocks, items;
    ItemPlan plan;
    bool skip_hidden_blocks, uneven, by_rank;  // uneven: later rows see more keys (later_rows_see_more)
    LastWave wave;
    int team;
    bool home;
    int kv_slots;   // packed K/V blocks each thread keeps (kept_kv_blocks)
    int groups;     // causal items kept in groups of threads, one batch index each (0: no groups)
};

// Packed K/V blocks kept per thread, at most (bytes).
constexpr int64_t kKeptKvBytes = int64_t(4) << 20;
// Items of at most this many rows keep their packed K/V blocks.
constexpr int64_t kKeptKvMaxItemRows = 128;

// Packed K/V blocks each thread keeps for the call: every key block some row
// sees, for items of up to kKeptKvMaxItemRows rows with whole keys, where
// the blocks fit kKeptKvBytes; else one, packed per item and block.  Small
// items pack each block for few rows, so the packing weighed on them most.
// Larger items lost, as did items with split keys, which read each block
// once anyway.
int kept_kv_blocks(const SdpaForwardArgs& a, int parts, const ItemPlan& plan) {
    const int64_t blocks = (visible_keys_of(a) + kBlockKV - 1) / kBlockKV;
    const int dp = int(round_up(a.head_dim_qk, kTileBf16Cols)), dvp = int(round_up(a.head_dim_v, kTileBf16Cols));
    const int64_t block_bytes = 4 * (packed_k_block_words(dp, parts) + packed_v_block_words(dvp, parts));
    const bool small_whole_items = plan.rows <= kKeptKvMaxItemRows && plan.splits.count == 1;
    return small_whole_items && blocks > 1 && blocks * block_bytes <= kKeptKvBytes ? int(blocks) : 1;
}

ForwardWork forward_work(const SdpaForwardArgs& a, int parts) {
    ForwardWork w;
    const int64_t threads = omp_get_max_threads();
    w.batch = a.batch[0] * a.batch[1] * a.batch[2];
    w.skip_hidden_blocks = skips_hidden_blocks(a);
    w.uneven = later_rows_see_more(a);
    const int64_t band = a.window.band_keys();
    const int64_t max_rows = w.skip_hidden_blocks && band < kNoKeyLimit ? band / kWindowKeysPerItemRow : kBlockQ;
    w.plan = plan_items(w.batch, a.seq_q, visible_keys_of(a), threads, w.uneven, splits_keys_first(a, parts),
                        max_rows);
    w.q_blocks = (a.seq_q + w.plan.rows - 1) / w.plan.rows;
    w.items = w.batch * w.q_blocks;
    w.by_rank = longest_first(w.uneven, w.items, threads);
    // Key splits make small pieces of work already; the last wave goes in pieces otherwise.
    w.wave = last_wave_in_pieces(w.items, w.plan.rows, threads, kLastWavePieceRows,
                                 w.plan.splits.count == 1 && !w.uneven);
    w.team = team_for_items(w.items * w.plan.splits.count);
    w.home = !w.uneven && w.wave.pieces == 1;
    w.kv_slots = kept_kv_blocks(a, parts, w.plan);
    // Kept blocks pay off only where a thread's items share K/V.  Causal items go to groups of threads, a
    // batch index's items to each, longest first within the group: the blocks each thread packs serve its
    // later items, and the shortest items still come last.
    w.groups = w.kv_slots > 1 && w.uneven ? int(std::min<int64_t>(w.batch, w.team)) : 0;
    if (w.groups > 0) {
        w.by_rank = false;  // batch-major, so each group's units are one batch index's items
        w.home = true;
    }
    return w;
}

// False (output unfinished) when split inputs held an infinity.
template <int Parts>
bool run_forward(const SdpaForwardArgs& a) {
    const ForwardWork work = forward_work(a, Parts);
    const int64_t batch = work.batch, block_q = work.plan.rows, q_blocks = work.q_blocks, items = work.items;
    const int64_t splits = work.plan.splits.count, keys_per_split = work.plan.splits.keys;
    const bool skip_hidden_blocks = work.skip_hidden_blocks, uneven = work.uneven, by_rank = work.by_rank;
    const LastWave& wave = work.wave;
    const int team = work.team;
    const int Dv = int(a.head_dim_v);
    const PartialLayout layout{block_q, Dv};
    AlignedFloats partials =
        splits > 1 ? AlignedFloats::uninitialized(size_t(items * splits) * layout.floats()) : AlignedFloats();
    std::atomic<bool> saw_infinity{false};
    // An item's batch index and first query row (see work_order.hpp).
    auto item_origin = [&](int64_t item, int64_t b[kBatchDims]) {
        const WorkItem x = work_item(item, batch, q_blocks, by_rank);
        unflatten_batch(a.batch, x.batch, b);
        return (uneven ? q_blocks - 1 - x.rank : x.rank) * block_q;
    };
    HomeFirstUnits units(wave.units() * splits, team, work.home, work.groups);
    SplitsDone splits_done(items, splits);
    run_on_pool(team, [&] {
        Scratch scratch(int(a.head_dim_qk), Dv, Parts, std::min(block_q, a.seq_q), work.kv_slots);
        configure_tiles();
        units.for_each([&](int64_t w) {
            if (saw_infinity.load(std::memory_order_relaxed)) return;
            int64_t b[kBatchDims];
            const LastWave::Unit unit = wave.unit(w / splits);
            const int64_t split = w % splits, i0 = item_origin(unit.item, b) + unit.first_row;
            if (i0 >= a.seq_q) return;  // a piece past a short last item
            const int64_t key_begin = split * keys_per_split;
            const int rows = int(std::min<int64_t>(unit.rows, a.seq_q - i0));
            run_item<Parts>(a, scratch, b, i0, rows, key_begin, std::min(a.seq_kv, key_begin + keys_per_split),
                            skip_hidden_blocks, layout, splits > 1 ? partials.get() + w * layout.floats() : nullptr);
            if (scratch.infinite) saw_infinity.store(true, std::memory_order_relaxed);
            // With pieces there are no splits, so a unit is an item here.  After an infinity the vector
            // build rewrites the whole output, so an item merged regardless does no harm.
            if (splits > 1 && splits_done.finishes(unit.item))
                merge_and_write(a, b, i0, rows, layout, partials.get() + unit.item * splits * layout.floats(), splits,
                                scratch.o_store.get(), scratch.out_store.get());
        });
        _tile_release();
    });
    return !saw_infinity.load();
}

}  // namespace
}  // namespace isa_amx

int64_t sdpa_forward_amx_item_rows(const SdpaForwardArgs& a) {
    return std::min(isa_amx::forward_work(a, 3).plan.rows, a.seq_q);  // only f32 calls ask (dispatch.cpp)
}

std::string sdpa_forward_plan_amx(const SdpaForwardArgs& a, int parts) {
    const isa_amx::ForwardWork w = isa_amx::forward_work(a, parts);
    const std::string order = isa_amx::order_name(w.home, w.by_rank, w.groups > 0) +
                              (w.wave.pieces > 1 ? "+pieces" : "") + (w.kv_slots > 1 ? "+kept_kv" : "");
    return isa_amx::work_plan_text("tiles", std::min(w.plan.rows, a.seq_q), w.items, w.plan.splits.count,
                                   std::min(w.plan.splits.keys, a.seq_kv), w.team, order);
}

bool sdpa_forward_amx(const SdpaForwardArgs& a, int parts) {
    if (parts == 3) return isa_amx::run_forward<3>(a);
    return parts == 2 ? isa_amx::run_forward<2>(a) : isa_amx::run_forward<1>(a);
}

}  // namespace graphattn
