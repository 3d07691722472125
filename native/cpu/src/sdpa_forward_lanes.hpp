// FlashAttention-2 forward with query rows as vector lanes.
//
// Each work item (one batch index, one block of kBlockQ query rows) keeps
// Q^T, the score block S^T and the output accumulator O^T in the transposed
// layout of lane_gemm.hpp, so the online softmax (max, exp, sum, rescale)
// runs on whole vectors of rows with no horizontal reductions.  Scores are
// kept in base-2 units (log2(e) folded into the scale), so each probability
// costs one exp2.  Key blocks with no mask pass take the softmax inside the
// score product's register tiles instead (tile_softmax.hpp).  K and V rows
// are read in place when they are f32 with unit column stride; other dtypes
// or strides are converted block by block into f32 scratch.  The scale is
// folded into Q^T once per work item.  bf16 Q, K and V, where pairs pay off,
// take both products on bf16 pairs instead (lane_gemm_bf16.hpp): Q^T, P^T
// and V packed into pairs (V once per K/V batch index and thread where it
// fits, kVPairCacheBytes), K read in place, the scale applied to the scores.
//
// A lane is one (query row, batch index) pair.  Where K and V ignore a
// batch dimension (the query heads of a GQA/MQA group), the rows of all its
// indices share the lanes of one work item, so each K/V block is read once
// per group; decode (one query row per head) then fills lanes with the
// group's heads.  Work items are batch x row blocks x key splits: when there
// are fewer items than threads, the keys are split and the partial results
// merged by their log-sum-exp, so small N*H still uses every core.  Memory
// is O(block * head_dim) per thread, plus the partial rows of split items.
//
// Blocks whose rows would leave many lanes idle (decode; short query blocks,
// sdpa_forward_select.hpp) take the row layout instead (attend_rows): the
// same items, plan and merge, with the keys as the lanes of the scores.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "block_io.hpp"
#include "row_layout_blocks.hpp"
#include "dropout.hpp"
#include "graphattn/cpu_features.hpp"
#include "graphattn/sdpa.hpp"
#include "isa_namespace.hpp"
#include "key_splits.hpp"
#include "kv_reader.hpp"
#include "lane_gemm.hpp"
#include "lane_gemm_bf16.hpp"
#include "lane_masks.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "tile_softmax.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

// Which lanes of a call belong together: the batch dimension that K and V
// share (or -1), the row space of one work item, and the key splits.
struct LanePlan {
    int shared_dim = -1;
    int64_t group = 1;          // size of the shared dimension
    int64_t rows_total = 0;     // group * seq_q rows per outer batch index
    int64_t item_rows = 0;      // rows per item: the block's lanes, or fewer in the row layout (plan)
    int64_t row_blocks = 0;
    int64_t outer_items = 0;    // outer batch indices x row blocks
    int64_t splits = 1;
    int64_t keys_per_split = 0;
    // The row layout's heads in turn (LaneForward::turn_dim): the batch dimension whose indices one unit
    // takes key chunk by key chunk (-1: none), its size, and the outer items between two of its indices.
    int turn_dim = -1;
    int64_t turns = 1;
    int64_t turn_inner = 1;
    // Units of work handed out: (item, split) pairs, or with turns (items of every turn index, split).
    int64_t units() const { return outer_items / turns * splits; }
    // Outer item of turn index h of unit u's items.
    int64_t turn_item(int64_t u, int64_t h) const {
        const int64_t item = u / splits;
        return (item / turn_inner * turns + h) * turn_inner + item % turn_inner;
    }
};

// The batch dimension that K and V ignore (stride 0 in both), so that its
// indices can share lanes; -1 and group 1 when there is none.
inline int find_shared_dim(const SdpaForwardArgs& a, int64_t& group) {
    int shared = -1;
    group = 1;
    for (int d = 0; d < kBatchDims; ++d)
        if (a.batch[d] > group && KvReader(a.key).shared_over(d) && KvReader(a.value).shared_over(d)) {
            shared = d;
            group = a.batch[d];
        }
    return shared;
}

// Whether the row layout asks for the next key block's K/V rows ahead of their reading.  An item reading
// one head's adjacent rows waited on each block's first loads, which a block asked for ahead hides; where
// a unit takes the heads of token rows in turn, asking ahead was slower, so turns leave it to the
// hardware prefetchers.
enum class RowPrefetch { next_block, none };

// RV vectors of lanes per work item; NT broadcast operands per tile.
// RowLayout: the items' RV * kLanes query rows are computed as rows, with the
// keys as the lanes of the score vectors (attend_rows) instead.
template <int RV, int NT, bool RowLayout = (RV == 1)>
struct LaneForward {
    static constexpr int kBlockQ = RV * kLanes;
    static constexpr int kBlockKV = 128;
    // Keys per block where the softmax runs in the score product's tiles (f32 products, no mask pass,
    // no dropout): O^T's loads and stores and each block's steps are then shared by twice the keys.
    static constexpr int kTileBlockKV = 2 * kBlockKV;
    // Scratch::v_pairs keeps a K/V batch index's V pairs up to this size, packed once, not per item.
    static constexpr int64_t kVPairCacheBytes = int64_t(2) << 20;
    static constexpr int64_t kMinRowItemRows = 4;  // rows per row-layout item at least (see plan)

    // How the row layout reads K, decided once per call for its items' rows
    // (LanePlan::item_rows; only a K/V head's last item may have fewer).
    struct KeyReads {
        bool transposed = false;  // scores against K^T packed per key block (row_scores_from_k_t)
        bool bf16_dots = false;   // row-key partials on AVX512-BF16, from Q's and K's own bf16 rows
        bool copied = false;      // K rows through padded f32 copies (k_pad)
        bool pairs = false;       // both products on bf16 pairs (row_pairs_pay_off), in place of the above
        // Quantized rows decoded a vector at a time as the products read them (KvReader::decodes_lanes),
        // K's for the row-key partials, V's for P V: no decoded copy written and read again.
        bool lanes = false;
        bool v_lanes = false;
    };

    // Scratch of one thread, allocated once per parallel region.  Buffers
    // that every item writes before it reads them (Q^T with its padding lanes,
    // K/V rows, S^T, O^T, the row statistics and indices) are not cleared: on
    // small calls clearing them cost more than the work (f32 (1,1,1,17,17,256):
    // 370 KiB per thread and call).  The mask and dropout lanes past the last
    // row and the row layout's K/V copies with padding columns start at 0.
    // Buffers only some calls use are sized for those alone (the mask and
    // dropout lanes, the K/V copies, K^T): every call cleared 32-64 KiB of
    // lanes per thread (perf, f32 (2,16,16,17,17,64): memset 7% of the call,
    // with O^T's and Q^T's padding fills).
    struct Scratch {
        KeyReads keys;    // the row layout's; first, as the buffers below are sized by it
        bool pair_dots;   // the lane layout's products on bf16 pairs (uses_pair_dots)
        ScoreMods mods;   // the call's softcap and ALiBi (lane_masks.hpp)
        AlignedFloats q_t, k_rows, v_rows, s_t, mask_t, o_t, row_max, row_sum, query_index, out_rows, drop_t;
        // Per lane, in base-2 units: the ALiBi slope and the sink logit of its batch index (calls with them).
        AlignedFloats slope_lanes, sink_lanes;
        // Row layout (attend_rows): rows of Q and O padded to whole vectors (Q's padding cleared
        // per row), K/V rows likewise (padding zero); P rows, the row-key partials and K^T, each written
        // before it is read.
        AlignedFloats q_pad, o_pad, k_pad, v_pad, p_rows, mask_row, partials, k_t;
        // Row layout on bf16 pairs (keys.pairs), 32-bit words: Q's rows (bf16, Dp apart), K^T's pairs
        // along the head dim (keys as lanes), P's rows rounded to bf16, V's pairs along the keys.
        AlignedFloats row_q_bf16, row_kt_pairs, row_p_bf16, row_v_pairs;
        // pair_dots: Q^T, P^T and V as bf16 pairs, and K's where it is not read in place (32-bit words).
        // v_pairs holds one key block's V pairs, or, where the head's V fits kVPairCacheBytes, every key
        // block's: packed once for the items of one K/V batch index that follow each other on this thread.
        AlignedFloats q_pairs, p_pairs, v_pairs, k_pairs;
        KvStage k_stage, v_stage;  // K/V blocks where their layout keeps the rows apart (kv_reader.hpp)
        KvLanesBlock k_lanes, v_lanes;  // keys.lanes, keys.v_lanes: a block's quantized rows as they lie
        int64_t v_pairs_of = -1;                 // V's offset (batch index) whose blocks v_pairs caches
        std::vector<uint8_t> v_block_packed;     // per key block: packed for v_pairs_of
        int64_t q_off[kBlockQ], o_off[kBlockQ], m_off[kBlockQ], st_off[kBlockQ];
        uint64_t drop_base[kBlockQ];
        uint8_t keep[kBlockKV > kRowLayoutKeys ? kBlockKV : kRowLayoutKeys];
        // v_blocks: key blocks whose V pairs v_pairs keeps at once (cached_v_blocks, or 1).
        Scratch(const SdpaForwardArgs& a, int64_t item_rows, int64_t v_blocks)
            : keys(RowLayout ? key_reads(a, item_rows) : KeyReads{}),
              pair_dots(uses_pair_dots(a)),
              mods(a),
              q_t(AlignedFloats::uninitialized(f32_lanes() ? size_t(a.head_dim_qk) * kBlockQ : 0)),  // attend's
              k_rows(AlignedFloats::uninitialized(f32_lanes() ? size_t(kTileBlockKV) * a.head_dim_qk : 0)),
              v_rows(AlignedFloats::uninitialized(f32_lanes() ? size_t(kTileBlockKV) * a.head_dim_v : 0)),
              s_t(AlignedFloats::uninitialized(!RowLayout ? size_t(kTileBlockKV) * kBlockQ : 0)),
              mask_t(!RowLayout && a.mask_kind != MaskKind::none ? size_t(kBlockKV) * kBlockQ : 0),
              o_t(AlignedFloats::uninitialized(size_t(a.head_dim_v) * kBlockQ)),
              row_max(AlignedFloats::uninitialized(kBlockQ)),
              row_sum(AlignedFloats::uninitialized(kBlockQ)),
              query_index(AlignedFloats::uninitialized(kBlockQ)),
              out_rows(AlignedFloats::uninitialized(size_t(kTransposedRowsAtOnce) * a.head_dim_v)),
              drop_t(!RowLayout && DropoutPlan(a).active ? size_t(kBlockKV) * kBlockQ : 0),
              slope_lanes(AlignedFloats::uninitialized(a.alibi.slopes.data ? kBlockQ : 0)),
              sink_lanes(AlignedFloats::uninitialized(a.sinks.data ? kBlockQ : 0)),
              q_pad(AlignedFloats::uninitialized(RowLayout ? size_t(kBlockQ) * padded(a.head_dim_qk) : 0)),
              o_pad(AlignedFloats::uninitialized(RowLayout ? size_t(kBlockQ) * padded(a.head_dim_v) : 0)),
              k_pad(keys.copied ? size_t(kRowLayoutKeys) * padded(a.head_dim_qk) : 0),
              v_pad(RowLayout && !keys.pairs && !keys.v_lanes && !row_layout_reads_in_place(KvReader(a.value), int(a.head_dim_v))
                        ? size_t(kRowLayoutKeys) * padded(a.head_dim_v)
                        : 0),
              p_rows(AlignedFloats::uninitialized(RowLayout ? size_t(kBlockQ) * kRowLayoutKeys : 0)),
              mask_row(kRowLayoutKeys),
              partials(AlignedFloats::uninitialized(
                  RowLayout ? size_t(kPartialsRowBlock) * kRowLayoutKeys * kLanes : 0)),
              k_t(AlignedFloats::uninitialized(keys.transposed ? size_t(a.head_dim_qk) * kRowLayoutKeys : 0)),
              row_q_bf16(AlignedFloats::uninitialized(keys.pairs ? size_t(kBlockQ) * padded(a.head_dim_qk) / 2 : 0)),
              row_kt_pairs(AlignedFloats::uninitialized(keys.pairs ? size_t(a.head_dim_qk / 2) * kRowLayoutKeys : 0)),
              row_p_bf16(AlignedFloats::uninitialized(keys.pairs ? size_t(kBlockQ) * kRowLayoutKeys / 2 : 0)),
              row_v_pairs(keys.pairs ? size_t(kRowLayoutKeys / 2) * padded(a.head_dim_v) : 0),  // padding words 0
              q_pairs(AlignedFloats::uninitialized(pair_dots ? size_t(pairs(a.head_dim_qk)) * kBlockQ : 0)),
              p_pairs(AlignedFloats::uninitialized(pair_dots ? size_t(pairs(kBlockKV)) * kBlockQ : 0)),
              v_pairs(AlignedFloats::uninitialized(
                  pair_dots ? size_t(pairs(kBlockKV)) * padded(a.head_dim_v) * size_t(v_blocks) : 0)),
              k_pairs(AlignedFloats::uninitialized(
                  pair_dots && !pairs_in_place(KvReader(a.key), a.head_dim_qk) ? size_t(kBlockKV) * pairs(a.head_dim_qk) : 0)),
              v_block_packed(size_t(pair_dots ? v_blocks : 0), 0),
              k_lanes(lanes_block_for(keys.lanes, a.key, a.head_dim_qk)),
              v_lanes(lanes_block_for(keys.v_lanes, a.value, a.head_dim_v)) {}
        static KvLanesBlock lanes_block_for(bool used, const TensorView& t, int64_t cols) {
            return used ? KvReader(t).lanes_block_for(kRowLayoutKeys, int(cols)) : KvLanesBlock();
        }
        // Key blocks whose V pairs v_pairs keeps: all of them where they fit kVPairCacheBytes and a
        // thread takes several query blocks of one K/V batch index in a row (home-first units,
        // row_blocks > 1), else 1.
        static int64_t cached_v_blocks(const SdpaForwardArgs& a, const LanePlan& p, bool home_first) {
            const int64_t blocks = (a.seq_kv + kBlockKV - 1) / kBlockKV;
            const int64_t bytes = blocks * pairs(kBlockKV) * padded(a.head_dim_v) * 4;
            return home_first && p.row_blocks > 1 && bytes <= kVPairCacheBytes ? blocks : 1;
        }
        static int padded(int64_t n) { return int(round_up(n, kLanes)); }
        static int pairs(int64_t n) { return int((n + 1) / 2); }
        bool f32_lanes() const { return !RowLayout && !pair_dots; }
    };

    // Whether the lane layout's products run on bf16 pairs (lane_gemm_bf16.hpp): bf16 Q, K and V on a
    // CPU where they pay off.
    // Whether the row layout takes both products on bf16 pairs: bf16 Q, K and V, K's and V's rows
    // giving their pairs in place (unit column stride, even head dims), on a CPU where pairs pay off.
    static bool row_pairs_pay_off(const SdpaForwardArgs& a) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        return RowLayout && bf16_pairs_pay_off() && a.query.dtype == DType::bf16 && read_dtype(a.key) == DType::bf16 &&
               read_dtype(a.value) == DType::bf16 && pairs_in_place(KvReader(a.key), a.head_dim_qk) &&
               pairs_in_place(KvReader(a.value), a.head_dim_v);
#else
        (void)a;
        return false;
#endif
    }

    static bool uses_pair_dots(const SdpaForwardArgs& a) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        return !RowLayout && bf16_pairs_pay_off() && a.query.dtype == DType::bf16 &&
               read_dtype(a.key) == DType::bf16 && read_dtype(a.value) == DType::bf16;
#else
        (void)a;
        return false;
#endif
    }

    // Whether the row layout reads rows of K or V (cols wide) in place, in
    // their dtype: unit column stride and whole vectors, not decoded; else it
    // copies them into padded f32 rows.
    static bool row_layout_reads_in_place(const KvReader& kv, int cols) {
        return kv.rows_in_place() && !kv.rows_decoded() && Scratch::padded(cols) == cols;
    }

    // How the row layout reads K for items of this call's rows.  The row-key
    // partials run on AVX512-BF16 for bf16 Q and K read in place, rows of
    // whole 32-value steps, on a CPU that has it.  On AVX-512, from 5 rows
    // per item on (16 against AVX512-BF16 partials), the scores come from one
    // product with K^T packed per key block instead: below that the packing
    // costs more than the product saves.  The AVX2 build gained only from 16
    // rows on, more than its row layout takes.  K^T is packed from f32 rows,
    // so other dtypes are copied first.
    static constexpr int64_t kPackedKeyMinRows = 5, kPackedKeyMinRowsBf16Dots = 16;
    static KeyReads key_reads(const SdpaForwardArgs& a, int64_t item_rows) {
        const TensorView& q = a.query;
        const KvReader k(a.key);
        const int D = int(a.head_dim_qk);
        int64_t group;
        find_shared_dim(a, group);
        const int64_t rows = std::min<int64_t>(item_rows, group * a.seq_q);
        const bool in_place = row_layout_reads_in_place(k, D);
#if defined(__AVX512F__)
        const bool bf16_dots = cpu_features().avx512_bf16 && q.dtype == DType::bf16 && k.dtype() == DType::bf16 &&
                               q.strides[4] == 1 && in_place && Scratch::padded(D) % 32 == 0;
#else
        const bool bf16_dots = false;
        (void)q;
#endif
        KeyReads reads;
        // Pairs pack K^T per key block as the f32 product does, so they take the same least row count.
        if (row_pairs_pay_off(a) && rows >= kPackedKeyMinRows) {
            reads.pairs = true;
            return reads;
        }
        reads.v_lanes = KvReader(a.value).decodes_lanes(int(a.head_dim_v));
        reads.transposed = kLanes >= 16 && rows >= (bf16_dots ? kPackedKeyMinRowsBf16Dots : kPackedKeyMinRows);
        reads.bf16_dots = bf16_dots && !reads.transposed;
        reads.lanes = !reads.transposed && k.decodes_lanes(D);
        reads.copied = !reads.lanes && (!in_place || (reads.transposed && k.dtype() != DType::f32));
        return reads;
    }

    static LanePlan plan(const SdpaForwardArgs& a) {
        LanePlan p;
        p.shared_dim = find_shared_dim(a, p.group);
        p.rows_total = p.group * a.seq_q;
        const int64_t heads = a.batch[0] * a.batch[1] * a.batch[2] / p.group;  // outer batch indices
        const int64_t threads = omp_get_max_threads();
        auto take_item_rows = [&](int64_t item_rows) {
            p.item_rows = item_rows;
            p.row_blocks = (p.rows_total + item_rows - 1) / item_rows;
            p.outer_items = heads * p.row_blocks;
        };
        // About four items (or units) per thread, so that dynamic scheduling can balance them.  Only the
        // keys some row sees are split: under a top-left causal mask with far more keys than query rows,
        // splits of all keys were mostly empty, and each still cost a thread.
        auto split_keys = [&](int64_t items, int64_t min_keys) {
            const KeySplits splits = plan_key_splits(items, threads, 4, visible_keys_of(a), kBlockKV, min_keys);
            p.splits = splits.count;
            p.keys_per_split = splits.keys;
        };
        auto with_item_rows = [&](int64_t item_rows, int64_t min_keys) {
            take_item_rows(item_rows);
            split_keys(p.outer_items, min_keys);
        };
        take_item_rows(kBlockQ);
        if constexpr (RowLayout) {
            p.turn_dim = turn_dim(a, p);
            if (p.turn_dim >= 0) {  // the keys split for units of every turn index's items
                p.turns = a.batch[p.turn_dim];
                for (int d = p.turn_dim + 1; d < kBatchDims; ++d) p.turn_inner *= d == p.shared_dim ? 1 : a.batch[d];
                const int64_t units = p.outer_items / p.turns;
                split_keys(units, kMinKeysPerSplit);
                if (units * p.splits < threads) split_keys(units, kMinRowLayoutKeysPerSplit);
                return p;
            }
        }
        split_keys(p.outer_items, kMinKeysPerSplit);
        if constexpr (RowLayout) {
            // Where threads would idle even with the keys split, a K/V head's rows go in several items
            // (each reads the K/V again, from cache).
            if (p.outer_items * p.splits < threads && p.rows_total > kMinRowItemRows) {
                const int64_t blocks = (threads + heads * p.splits - 1) / (heads * p.splits);  // per K/V head
                with_item_rows(std::max<int64_t>(kMinRowItemRows, (p.rows_total + blocks - 1) / blocks),
                               kMinKeysPerSplit);
            }
            // Still idle: shorter key splits (key_splits.hpp); rows are split first, as splitting keys
            // first lost where the rows alone fill the threads.
            if (p.outer_items * p.splits < threads) with_item_rows(p.item_rows, kMinRowLayoutKeysPerSplit);
        }
        return p;
    }

    // Keys a row-layout unit with turns reads of one turn index before it takes the next: short enough that
    // the chunk's token rows of all of them stay in the core's cache, long enough that the per-chunk
    // set-up (Q's rows, the fold) stays small beside it.
    static constexpr int64_t kTurnKeys = 2 * kRowLayoutKeys;

    // The batch dimension whose indices a row-layout unit takes in turn, a key chunk (kTurnKeys) at a time,
    // or -1.  Where K's and V's rows of its indices lie side by side in each token row (a token-major
    // cache's heads, KvRowLayout::interleaves), items of one index read a stripe of every token row, which
    // streams at about half the rate whole rows do (docs/performance.md, decode); taken in turn, each chunk
    // of token rows is read whole, by one thread, within a short time.  Only for items of all the rows of
    // their index (one row block).
    static int turn_dim(const SdpaForwardArgs& a, const LanePlan& p) {
        if (p.row_blocks != 1) return -1;
        const KvRowLayout k = kv_row_layout(a.key), v = kv_row_layout(a.value);
        for (int d = 0; d < kBatchDims; ++d)
            if (d != p.shared_dim && k.interleaves(d, a.batch[d]) && v.interleaves(d, a.batch[d])) return d;
        return -1;
    }

    // Outer batch index (shared dimension at 0) and first row of item `outer`.
    static void item_origin(const SdpaForwardArgs& a, const LanePlan& p, int64_t outer, int64_t b[kBatchDims],
                            int64_t& row0) {
        row0 = (outer % p.row_blocks) * p.item_rows;
        int64_t rest = outer / p.row_blocks;
        for (int d = kBatchDims - 1; d >= 0; --d) {
            const int64_t size = d == p.shared_dim ? 1 : a.batch[d];
            b[d] = rest % size;
            rest /= size;
        }
    }

    // Per-lane element offsets of Q, O, mask and stats, and query indices.
    static int map_lanes(const SdpaForwardArgs& a, const LanePlan& p, Scratch& sc, const int64_t outer_b[kBatchDims],
                         int64_t row0) {
        const int rows = int(std::min<int64_t>(p.item_rows, p.rows_total - row0));
        int64_t b[kBatchDims] = {outer_b[0], outer_b[1], outer_b[2]};
        // Row i of group member g; the padding lanes repeat the last row.  The
        // batch offsets only change where a lane starts the next member.
        int64_t g = row0 / a.seq_q, i = row0 % a.seq_q;
        int64_t q_base = 0, o_base = 0, m_base = 0, st_base = 0, flat = 0;
        float slope = 0.0f, sink = 0.0f;
        auto enter_member = [&] {
            if (p.shared_dim >= 0) b[p.shared_dim] = g;
            q_base = view_batch_offset(a.query, b);
            o_base = view_batch_offset(a.output, b);
            m_base = view_batch_offset(a.mask, b);
            st_base = view_batch_offset(a.stats, b);
            flat = (b[0] * a.batch[1] + b[1]) * a.batch[2] + b[2];
            slope = slope_log2(a, b);
            sink = sink_log2(a, b);
        };
        enter_member();
        for (int r = 0; r < kBlockQ; ++r) {
            if (r > 0 && r < rows && ++i == a.seq_q) {
                i = 0;
                ++g;
                enter_member();
            }
            sc.q_off[r] = q_base + i * a.query.strides[3];
            sc.o_off[r] = o_base + i * a.output.strides[3];
            sc.m_off[r] = m_base + i * a.mask.strides[3];
            sc.st_off[r] = st_base + i * a.stats.strides[3];
            sc.query_index.get()[r] = float(i);
            if (a.alibi.slopes.data) sc.slope_lanes.get()[r] = slope;
            if (a.sinks.data) sc.sink_lanes.get()[r] = sink;
            sc.drop_base[r] = DropoutPlan::row_base(a, flat, i);
        }
        return rows;
    }

    // Online softmax over one key block: S^T becomes P^T relative to the new
    // running max; O^T is rescaled where the max grew (o_t null: the first block, no O^T yet).
    // p_pairs set (bf16 pair products): P^T goes straight to its pairs (exp2_to_lane_pairs), not to s_t.
    static void online_softmax(float* s_t, int kv_rows, float* row_max, float* row_sum, float* o_t, int Dv,
                               uint32_t* p_pairs = nullptr) {
        VecF correction[RV];
        bool rescale = false;
        for (int v = 0; v < RV; ++v) {
            const VecF old_max = load(row_max + v * kLanes);
            VecF m = old_max;
            for (int j = 0; j < kv_rows; ++j) m = max_ignoring_nan(load(s_t + j * kBlockQ + v * kLanes), m);
            const VecF base = softmax_base(m);
            VecF sum{};
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
            if (p_pairs)
                sum = exp2_to_lane_pairs(s_t + v * kLanes, kBlockQ, kv_rows, base, p_pairs + v * kLanes, kBlockQ);
#endif
            for (int j = 0; j < kv_rows && !p_pairs; ++j) {
                float* s = s_t + j * kBlockQ + v * kLanes;
                const VecF p = vexp2(load(s) - base);
                store(s, p);
                sum += p;
            }
            correction[v] = vexp2(old_max - base);
            store(row_sum + v * kLanes, load(row_sum + v * kLanes) * correction[v] + sum);
            store(row_max + v * kLanes, m);
            for (int i = 0; i < kLanes; ++i) rescale |= correction[v][i] != 1.0f;
        }
        if (rescale && o_t) rescale_lane_rows<RV>(o_t, correction, Dv);
    }

    // Normalises rows of o_t by row_sum into the output; stats = logsumexp.
    static void write_rows(const SdpaForwardArgs& a, Scratch& sc, const float* o_t, const float* row_max,
                           const float* row_sum, int rows, int Dv) {
        for (int r = 0; r < rows; ++r) {
            // O^T to rows, 16 at a time.
            float* out = sc.out_rows.get() + (r % kTransposedRowsAtOnce) * Dv;
            if (r % kTransposedRowsAtOnce == 0)
                transpose_f32(o_t + r, kBlockQ, Dv, std::min(kTransposedRowsAtOnce, rows - r), sc.out_rows.get(), Dv);
            write_row(a, sc, r, out, row_max[r], row_sum[r], Dv);
        }
    }

    // Output row r from its unnormalised f32 values `out` (scaled in place) and its running max and sum.
    static void write_row(const SdpaForwardArgs& a, const Scratch& sc, int r, float* out, float row_max,
                          float row_sum, int Dv) {
        float out_scale = 1.0f;
        if (a.sinks.data) fold_row_sink(sc.sink_lanes.get()[r], row_max, row_sum, out_scale);
        const float factor = row_factor(a, row_sum) * out_scale;
        for (int c = 0; c < Dv; ++c) out[c] *= factor;
        store_view_row(out, Dv, a.output, sc.o_off[r]);
        if (a.stats.data)
            static_cast<float*>(const_cast<void*>(a.stats.data))[sc.st_off[r]] = row_lse(a, row_max, row_sum);
    }

    // The row layout's rows (attend_rows leaves them in o_pad) written from there: through O^T,
    // the copy and transpose took an eighth of f32 (1,1,1,1,17,256) (perf: 12%).
    static void write_rows_from_o_pad(const SdpaForwardArgs& a, Scratch& sc, int rows, int Dv) {
        const int Dvp = Scratch::padded(Dv);
        for (int r = 0; r < rows; ++r)
            write_row(a, sc, r, sc.o_pad.get() + r * Dvp, sc.row_max.get()[r], sc.row_sum.get()[r], Dv);
    }

    // The row layout's rows moved to O^T, where the merge of key splits reads every item's partials.
    static void o_pad_rows_to_o_t(Scratch& sc, int rows, int Dv) {
        const int Dvp = Scratch::padded(Dv);
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < Dv; ++c) sc.o_t.get()[c * kBlockQ + r] = sc.o_pad.get()[r * Dvp + c];
    }

    // P^T[j][lanes] *= dropout multiplier (after the row sums took the undropped P).
    static void apply_dropout(const DropoutPlan& dropout, Scratch& sc, int rows, int kv_rows, int64_t j0) {
        float* drop_t = sc.drop_t.get();
        for (int r = 0; r < rows; ++r) dropout.multipliers(sc.drop_base[r], j0, kv_rows, drop_t + r, kBlockQ, sc.keep);
        for (int j = 0; j < kv_rows; ++j)
            for (int v = 0; v < RV; ++v) {
                float* p = sc.s_t.get() + j * kBlockQ + v * kLanes;
                store(p, load(p) * load(drop_t + j * kBlockQ + v * kLanes));
            }
    }

    // The scores' factor in log2 units (the softmax takes exp2).
    static float log2_score_scale(const SdpaForwardArgs& a) { return graphattn::score_scale(a) * kLog2e; }

    // The item's queries as the scores' lane operand, lanes past the last row 0: Q^T with the scale
    // (and log2(e)) folded in, or Q^T's bf16 pairs, the scale then applied to the scores.
    static void load_query_block(const SdpaForwardArgs& a, Scratch& sc, int rows) {
        const TensorView& q = a.query;
        const int D = int(a.head_dim_qk);
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (sc.pair_dots) {
            const uint16_t* q_data = static_cast<const uint16_t*>(q.data);
            uint32_t* q_pairs = sc.q_pairs.words();
            if (pairs_in_place(q, D)) {
                transpose_rows<uint32_t>([&](int r) { return reinterpret_cast<const uint32_t*>(q_data + sc.q_off[r]); },
                                         rows, Scratch::pairs(D), q_pairs, kBlockQ, 1.0f, kBlockQ);
            } else {
                for (int r = 0; r < kBlockQ; ++r)  // padding lanes: no columns, so zero pairs
                    pack_strided_pairs(q_data + sc.q_off[std::min(r, rows - 1)], 0, q.strides[4], 1, r < rows ? D : 0,
                                      Scratch::pairs(D), q_pairs + r, 0, kBlockQ);
            }
            return;
        }
#endif
        float* q_t = sc.q_t.get();
        const float scale = log2_score_scale(a);
        if (q.dtype == DType::f32 && q.strides[4] == 1) {
            const float* q_data = static_cast<const float*>(q.data);
            transpose_rows_f32([&](int r) { return q_data + sc.q_off[r]; }, rows, D, q_t, kBlockQ, scale, kBlockQ);
        } else {
            for (int r = 0; r < rows; ++r)
                load_block(element_ptr(q.data, q.dtype, sc.q_off[r]), q.dtype, 0, q.strides[4], 1, D, q_t + r, 1,
                           kBlockQ);
            if (rows < kBlockQ)
                for (int d = 0; d < D; ++d) std::fill(q_t + d * kBlockQ + rows, q_t + (d + 1) * kBlockQ, 0.0f);
            for (int x = 0; x < D * kBlockQ; x += kLanes) store(q_t + x, load(q_t + x) * scale);
        }
    }

    // S^T of keys [j0, j0 + kv_rows) into sc.s_t, scaled.
    static void score_block(const SdpaForwardArgs& a, Scratch& sc, int64_t k_base, int64_t j0, int kv_rows) {
        const KvReader k(a.key);
        const int D = int(a.head_dim_qk);
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (sc.pair_dots) {
            const RowBlock block = k.block(k_base, j0, kv_rows, sc.k_stage);
            const uint16_t* k_rows = block.words();
            int64_t k_stride = block.row_stride;
            if (!pairs_in_place(k, D)) {
                pack_strided_pairs(k_rows, block.row_stride, block.col_stride, kv_rows, D, Scratch::pairs(D),
                                   sc.k_pairs.words(), Scratch::pairs(D), 1);
                k_rows = reinterpret_cast<const uint16_t*>(sc.k_pairs.get());
                k_stride = 2 * Scratch::pairs(D);
            }
            pair_gemm<RV, NT, false>(sc.q_pairs.words(), Scratch::pairs(D), k_rows, k_stride, 2, kv_rows, sc.s_t.get(),
                                     log2_score_scale(a));
            return;
        }
#endif
        int64_t k_stride;
        const float* k_rows = k.rows_f32(k_base, j0, kv_rows, D, sc.k_rows.get(), D, k_stride);
        lane_gemm<RV, NT, false>(sc.q_t.get(), D, k_rows, k_stride, 1, kv_rows, sc.s_t.get());
    }

    // score_block and online_softmax in one pass (tile_softmax.hpp), for f32 lanes and blocks with no
    // mask pass: P^T into sc.s_t, the statistics into row_max / row_sum, O^T rescaled where needed.
    static void score_softmax_block(const SdpaForwardArgs& a, Scratch& sc, int64_t k_base, int64_t j0, int kv_rows,
                                    float* o_t, int Dv) {
        const int D = int(a.head_dim_qk);
        int64_t k_stride;
        const float* k_rows = KvReader(a.key).rows_f32(k_base, j0, kv_rows, D, sc.k_rows.get(), D, k_stride);
        if (a.softcap > 0.0f) {
            TileSoftmax<RV, true> softmax(sc.s_t.get(), sc.row_max.get(), sc.row_sum.get(), sc.mods.softcap);
            lane_gemm_to<RV, NT>(sc.q_t.get(), D, k_rows, k_stride, 1, kv_rows, softmax);
            softmax.finish(o_t, Dv);
            return;
        }
        TileSoftmax<RV> softmax(sc.s_t.get(), sc.row_max.get(), sc.row_sum.get());
        lane_gemm_to<RV, NT>(sc.q_t.get(), D, k_rows, k_stride, 1, kv_rows, softmax);
        softmax.finish(o_t, Dv);
    }

    // O^T (+)= V^T P^T for keys [j0, j0 + kv_rows), P^T in sc.s_t (or, p_paired, already in sc.p_pairs);
    // the first block sets O^T.
    static void accumulate_block(const SdpaForwardArgs& a, Scratch& sc, int64_t v_base, int64_t j0, int kv_rows,
                                 bool first, bool p_paired) {
        const KvReader v(a.value);
        const int Dv = int(a.head_dim_v);
        float* o_t = sc.o_t.get();
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (sc.pair_dots) {
            const int key_pairs = Scratch::pairs(kv_rows), ld = Scratch::padded(Dv);
            uint32_t* v_pairs = sc.v_pairs.words();
            int pack_rows = kv_rows;
            if (sc.v_block_packed.size() > 1) {  // v_pairs caches the blocks of V at v_pairs_of
                if (sc.v_pairs_of != v_base) {
                    std::fill(sc.v_block_packed.begin(), sc.v_block_packed.end(), uint8_t(0));
                    sc.v_pairs_of = v_base;
                }
                // A cached block holds all its keys: it serves any even count of them, or all of them
                // (an odd count takes its last pair's upper half as zero, which a cached block need not hold).
                const int block_rows = int(std::min<int64_t>(kBlockKV, a.seq_kv - j0));
                const int64_t block = j0 / kBlockKV;
                if (j0 % kBlockKV == 0 && (kv_rows % 2 == 0 || kv_rows == block_rows)) {
                    v_pairs += block * Scratch::pairs(kBlockKV) * ld;
                    pack_rows = sc.v_block_packed[size_t(block)] ? 0 : block_rows;
                    sc.v_block_packed[size_t(block)] = 1;
                } else {
                    sc.v_block_packed[0] = 0;  // packed below into block 0's place
                }
            }
            const RowBlock block = v.block(v_base, j0, pack_rows, sc.v_stage);
            if (pack_rows > 0 && v.rows_in_place()) {
                pack_row_pairs(block.words(), block.row_stride, pack_rows, Dv, v_pairs, ld);
            } else if (pack_rows > 0) {  // V^T's rows are V's columns
                for (int c = 0; c < Dv; ++c)
                    pack_strided_pairs(block.words() + c * block.col_stride, 0, block.row_stride, 1, pack_rows,
                                       Scratch::pairs(pack_rows), v_pairs + c, 0, ld);
            }
            if (!p_paired) pack_lane_pairs(sc.s_t.get(), kv_rows, kBlockQ, sc.p_pairs.words());
            const uint16_t* v_words = reinterpret_cast<const uint16_t*>(v_pairs);
            if (first)
                pair_gemm<RV, NT, false>(sc.p_pairs.words(), key_pairs, v_words, 2, 2 * ld, Dv, o_t);
            else
                pair_gemm<RV, NT, true>(sc.p_pairs.words(), key_pairs, v_words, 2, 2 * ld, Dv, o_t);
            return;
        }
#endif
        int64_t v_stride;
        const float* v_rows = v.rows_f32(v_base, j0, kv_rows, Dv, sc.v_rows.get(), Dv, v_stride);
        if (first)
            lane_gemm<RV, NT, false>(sc.s_t.get(), kv_rows, v_rows, 1, v_stride, Dv, o_t);
        else
            lane_gemm<RV, NT, true>(sc.s_t.get(), kv_rows, v_rows, 1, v_stride, Dv, o_t);
    }

    // Keys [key_begin, key_end) of one item into sc.o_t, row_max, row_sum.
    static void attend(const SdpaForwardArgs& a, Scratch& sc, const int64_t outer_b[kBatchDims], int rows,
                       int64_t key_begin, int64_t key_end, bool skip_hidden_blocks) {
        const int Dv = int(a.head_dim_v);
        const DropoutPlan dropout(a);

        load_query_block(a, sc, rows);
        std::fill(sc.row_max.get(), sc.row_max.get() + kBlockQ, -__builtin_inff());
        std::fill(sc.row_sum.get(), sc.row_sum.get() + kBlockQ, 0.0f);

        const float* qi = sc.query_index.get();
        const int64_t first_row = int64_t(*std::min_element(qi, qi + rows));
        const int64_t last_row = int64_t(*std::max_element(qi, qi + rows));
        if (skip_hidden_blocks) {  // the keys some row of the item sees, from a whole key block on
            const int64_t first_key = a.window.key_begin(first_row, a.seq_kv);
            key_begin = std::max(key_begin, key_begin + (first_key - key_begin) / kBlockKV * kBlockKV);
            key_end = std::min(key_end, a.window.key_end(last_row, a.seq_kv));
        }
        // Keys that every row of the item sees need no mask pass when there is no explicit mask or ALiBi; a
        // softcap is taken in the f32 lanes' tiles (score_softmax_block), the pair products' pass otherwise.
        const bool capped_pass = sc.mods.capped && sc.pair_dots;
        const int64_t unmasked_begin = a.window.key_begin(last_row, a.seq_kv);
        const int64_t unmasked_end =
            needs_score_pass(a) || capped_pass ? 0 : a.window.key_end(first_row, a.seq_kv);
        const int64_t k_base = KvReader(a.key).batch_offset(outer_b), v_base = KvReader(a.value).batch_offset(outer_b);
        // O^T is not cleared up front: the first key block sets it, unscaled, instead of clearing it,
        // rescaling the zeros and adding to them.
        float* o_t = sc.o_t.get();
        const bool wide_blocks = !sc.pair_dots && !dropout.active;  // kTileBlockKV where no mask pass either
        for (int64_t j0 = key_begin; j0 < key_end;) {
            int kv_rows = int(std::min<int64_t>(wide_blocks ? kTileBlockKV : kBlockKV, key_end - j0));
            const bool partly_hidden = j0 < unmasked_begin || j0 + kv_rows > unmasked_end;
            if (kv_rows > kBlockKV && partly_hidden) kv_rows = kBlockKV;
            const bool first = j0 == key_begin;
            const bool masked = j0 < unmasked_begin || j0 + kv_rows > unmasked_end;
            // Without dropout, the pair products' P^T goes to its pairs in the softmax pass.
            uint32_t* p_pairs = sc.pair_dots && !dropout.active ? sc.p_pairs.words() : nullptr;
            if (!sc.pair_dots && !masked) {
                score_softmax_block(a, sc, k_base, j0, kv_rows, first ? nullptr : o_t, Dv);
            } else {
                score_block(a, sc, k_base, j0, kv_rows);
                if (masked) mask_query_lanes<RV>(a, sc.s_t.get(), sc.mask_t.get(), sc.m_off, qi, sc.slope_lanes.get(), rows,
                                                 kv_rows, j0);
                online_softmax(sc.s_t.get(), kv_rows, sc.row_max.get(), sc.row_sum.get(), first ? nullptr : o_t, Dv,
                               p_pairs);
            }
            if (dropout.active) apply_dropout(dropout, sc, rows, kv_rows, j0);
            accumulate_block(a, sc, v_base, j0, kv_rows, first, p_pairs != nullptr);
            j0 += kv_rows;
        }
        if (key_begin >= key_end) std::fill(o_t, o_t + size_t(Dv) * kBlockQ, 0.0f);  // no keys: an all-zero O
    }

    // Narrows [key_begin, key_end) to the keys some of the item's rows (mapped in sc) sees, from a whole key
    // block on, for calls that skip hidden blocks.
    static void seen_keys(const SdpaForwardArgs& a, const Scratch& sc, int rows, int64_t& key_begin, int64_t& key_end) {
        const float* qi = sc.query_index.get();
        const int64_t first_key = a.window.key_begin(int64_t(*std::min_element(qi, qi + rows)), a.seq_kv);
        key_begin = std::max(key_begin, key_begin + (first_key - key_begin) / kRowLayoutKeys * kRowLayoutKeys);
        key_end = std::min(key_end, a.window.key_end(int64_t(*std::max_element(qi, qi + rows)), a.seq_kv));
    }

    // Row-layout form of attend (decode, short query blocks): the keys are
    // the lanes of the score vectors and P V runs over vectors of the head
    // dim, instead of idling the lanes a block's missing rows would fill in
    // attend.  Scores come from a product with K^T packed per key block where
    // the item has rows enough to share the packing, else from row-key dot
    // products reduced by one transposing sum per row and block; or, for bf16
    // where pairs pay off, both products on bf16 pairs (row_pair_products).
    // Each block's K and V rows are read adjacent (KvReader::adjacent_block:
    // copied where a token-major cache keeps them a stride apart), as the
    // products pass over them more than once.  With RowPrefetch::next_block,
    // the next block's rows are asked for as each block starts (rows the reader
    // decodes ask for their own).
    // Results land in sc.o_pad (rows) / row_max / row_sum.
    static void attend_rows(const SdpaForwardArgs& a, Scratch& sc, const int64_t outer_b[kBatchDims], int rows,
                            int64_t key_begin, int64_t key_end, RowPrefetch prefetch, bool skip_hidden_blocks) {
        const int D = int(a.head_dim_qk), Dv = int(a.head_dim_v);
        const int Dp = Scratch::padded(D), Dvp = Scratch::padded(Dv);
        const TensorView& q = a.query;
        const KvReader k(a.key), v(a.value);
        const DropoutPlan dropout(a);
        const float scale = log2_score_scale(a);
        float* q_pad = sc.q_pad.get();
        float* o_pad = sc.o_pad.get();
        const bool k_transposed = sc.keys.transposed, bf16_dots = sc.keys.bf16_dots, k_copied = sc.keys.copied;
        const bool row_pairs = sc.keys.pairs, k_lanes = sc.keys.lanes, v_lanes = sc.keys.v_lanes;
        const bool v_in_place = row_layout_reads_in_place(v, Dv);
        const DType k_type = k_copied ? DType::f32 : k.dtype(), v_type = v_in_place ? v.dtype() : DType::f32;
        // bf16_dots: the partials come straight from Q's bf16 rows, and the scores are scaled after.
        const float score_scale = bf16_dots ? scale : 1.0f;
        [[maybe_unused]] const uint16_t* q_bf16[kBlockQ];  // bf16_dots: Q's own rows
        const float* q_rows[kBlockQ];
        float* o_rows[kBlockQ];
        float* p_rows[kBlockQ];  // scores, then P in place
        for (int r = 0; r < rows; ++r) {
            q_rows[r] = q_pad + r * Dp;
            o_rows[r] = o_pad + r * Dvp;
            p_rows[r] = sc.p_rows.get() + r * kRowLayoutKeys;
            if (row_pairs) {  // Q's bf16 rows, Dp apart (the scale goes to the scores)
                uint16_t* q_row = reinterpret_cast<uint16_t*>(sc.row_q_bf16.get()) + r * Dp;
                const uint16_t* src = static_cast<const uint16_t*>(q.data) + sc.q_off[r];
                for (int d = 0; d < D; ++d) q_row[d] = src[d * q.strides[4]];
            } else if (bf16_dots) {
                q_bf16[r] = static_cast<const uint16_t*>(q.data) + sc.q_off[r];
            } else {  // Q as scaled f32 rows
                float* q_row = q_pad + r * Dp;
                load_block(element_ptr(q.data, q.dtype, sc.q_off[r]), q.dtype, 0, q.strides[4], 1, D, q_row, D, 1);
                std::fill(q_row + D, q_row + Dp, 0.0f);
                for (int d = 0; d < Dp; d += kLanes) store(q_row + d, load(q_row + d) * scale);
            }
            std::fill(o_pad + r * Dvp, o_pad + (r + 1) * Dvp, 0.0f);
            sc.row_max.get()[r] = -__builtin_inff();
            sc.row_sum.get()[r] = 0.0f;
        }
        if (skip_hidden_blocks) seen_keys(a, sc, rows, key_begin, key_end);
        const int64_t k_base = k.batch_offset(outer_b), v_base = v.batch_offset(outer_b);
        for (int64_t j0 = key_begin; j0 < key_end; j0 += kRowLayoutKeys) {
            const int kv = int(std::min<int64_t>(kRowLayoutKeys, key_end - j0));
            const int key_vectors = (kv + kLanes - 1) / kLanes;
            if (const int64_t ahead = j0 + kRowLayoutKeys; prefetch == RowPrefetch::next_block && ahead < key_end) {
                const int n = int(std::min<int64_t>(kRowLayoutKeys, key_end - ahead));
                if (!k.rows_decoded()) k.prefetch(k_base, ahead, n, D);
                if (!v.rows_decoded()) v.prefetch(v_base, ahead, n, Dv);
            }
            if (row_pairs) {  // K's and V's pairs from their adjacent rows (row_pairs_pay_off)
                row_pair_products(a, dropout, sc, rows, j0, kv, k.adjacent_block(k_base, j0, kv, D, sc.k_stage),
                                  v.adjacent_block(v_base, j0, kv, Dv, sc.v_stage), p_rows,
                                  o_rows, scale);
                continue;
            }
            const void* k_rows;
            const void* v_rows;
            int64_t k_stride, v_stride;
            if (k_copied) {  // the padding columns of k_pad stay 0
                k.load_f32(k_base, j0, kv, D, sc.k_pad.get(), Dp);
                k_rows = sc.k_pad.get();
                k_stride = Dp;
            } else if (k_lanes) {  // decoded as the partials read them
                k.lanes_block(k_base, j0, kv, D, sc.k_lanes);
                k_rows = nullptr;
                k_stride = 0;
            } else {
                const RowBlock block = k.adjacent_block(k_base, j0, kv, D, sc.k_stage);
                k_rows = block.data;
                k_stride = block.row_stride;
            }
            if (v_lanes) {  // decoded as P V reads them
                v.lanes_block(v_base, j0, kv, Dv, sc.v_lanes);
                v_rows = nullptr;
                v_stride = 0;
            } else if (!v_in_place) {
                v.load_f32(v_base, j0, kv, Dv, sc.v_pad.get(), Dvp);
                v_rows = sc.v_pad.get();
                v_stride = Dvp;
            } else {
                const RowBlock block = v.adjacent_block(v_base, j0, kv, Dv, sc.v_stage);
                v_rows = block.data;
                v_stride = block.row_stride;
            }
            if (k_transposed) {  // K^T, its lanes past kv in the last key vector zero
                const float* k_f32 = static_cast<const float*>(k_rows);
                transpose_rows_f32([&](int j) { return k_f32 + j * k_stride; }, kv, D, sc.k_t.get(), kRowLayoutKeys,
                                   1.0f, key_vectors * kLanes);
            }
            const int row_block = k_transposed ? kKeyTransposeRowBlock : kPartialsRowBlock;
            for (int r0 = 0; r0 < rows; r0 += row_block) {
                const int R = std::min(row_block, rows - r0);
                if (k_transposed) {
                    scores_from_k_t_in_row_blocks(R, kv, q_rows + r0, sc.k_t.get(), D, p_rows + r0);
                } else {
                    float* partials = sc.partials.get();
#if defined(__AVX512F__)
                    if (bf16_dots)
                        partials_bf16_in_row_blocks(R, q_bf16 + r0, static_cast<const uint16_t*>(k_rows), k_stride,
                                                    kv, Dp, partials);
                    else
#endif
                    if (k_lanes)
                        with_quant_lanes(sc.k_lanes, [&](const auto& keys) {
                            partials_in_row_blocks(R, q_rows + r0, keys, kv, Dp, partials);
                        });
                    else
                        partials_in_row_blocks(k_type, R, q_rows + r0, k_rows, k_stride, kv, Dp, partials);
                    for (int r = r0; r < r0 + R; ++r)
                        for (int t = 0; t < key_vectors; ++t) {
                            const float* row_key = partials + ((r - r0) * kRowLayoutKeys + t * kLanes) * kLanes;
                            store(p_rows[r] + t * kLanes, transposed_sums(row_key) * score_scale);
                        }
                }
                for (int r = r0; r < r0 + R; ++r)
                    row_softmax_step(a, dropout, sc, r, j0, kv, p_rows[r], o_rows[r], Dvp);
                if (v_lanes)
                    with_quant_lanes(sc.v_lanes, [&](const auto& values) {
                        accumulate_pv_in_row_blocks(R, p_rows + r0, values, kv, Dvp, o_rows + r0);
                    });
                else
                    accumulate_pv_in_row_blocks(v_type, R, p_rows + r0, v_rows, v_stride, kv, Dvp, o_rows + r0);
            }
        }
    }

    // One key block of attend_rows on bf16 pairs: S = Q K^T (scaled) from K^T's pairs, each row's softmax
    // step (masks, dropout), then O += P V from P rounded to bf16 and V's pairs along the keys.
    static void row_pair_products(const SdpaForwardArgs& a, const DropoutPlan& dropout, Scratch& sc, int rows,
                                  int64_t j0, int kv, const RowBlock& k_rows, const RowBlock& v_rows,
                                  float* const* p_rows, float* const* o_rows, float scale) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        const int D = int(a.head_dim_qk), Dv = int(a.head_dim_v);
        const int Dp = Scratch::padded(D), Dvp = Scratch::padded(Dv);
        const int key_vectors = (kv + kLanes - 1) / kLanes;
        transpose_rows<uint32_t>([&](int j) { return reinterpret_cast<const uint32_t*>(k_rows.word_row(j)); }, kv,
                                 D / 2, sc.row_kt_pairs.words(), kRowLayoutKeys, 1.0f, kRowLayoutKeys);
        pack_row_pairs(v_rows.words(), v_rows.row_stride, kv, Dv, sc.row_v_pairs.words(), Dvp);
        // p_rows and o_rows are kRowLayoutKeys and Dvp floats apart (Scratch).
        pair_gemm<kRowLayoutKeyVectors, kKeyTransposeRowBlock, false>(
            sc.row_kt_pairs.words(), D / 2, reinterpret_cast<const uint16_t*>(sc.row_q_bf16.get()), Dp, 2, rows,
            p_rows[0], scale);
        for (int r = 0; r < rows; ++r) row_softmax_step(a, dropout, sc, r, j0, kv, p_rows[r], o_rows[r], Dvp);
        uint16_t* p_bf16 = reinterpret_cast<uint16_t*>(sc.row_p_bf16.get());
        round_rows_to_bf16(p_rows[0], kRowLayoutKeys, rows, key_vectors * kLanes, kv, p_bf16, kRowLayoutKeys);
        pair_gemm_wide<kRowLayoutKeyVectors, kKeyTransposeRowBlock, true>(
            sc.row_v_pairs.words(), Dvp, (kv + 1) / 2, p_bf16, kRowLayoutKeys, 2, rows, o_rows[0], Dvp, Dvp);
#else
        (void)a, (void)dropout, (void)sc, (void)rows, (void)j0, (void)kv, (void)k_rows, (void)v_rows, (void)p_rows,
            (void)o_rows, (void)scale;
#endif
    }

    // Row r's scores of keys [j0, j0 + kv) in p_row, masked; its online
    // softmax step; P (with dropout) in their place.
    static void row_softmax_step(const SdpaForwardArgs& a, const DropoutPlan& dropout, Scratch& sc, int r, int64_t j0,
                                   int kv, float* p_row, float* o_row, int Dvp) {
        const int vectors = (kv + kLanes - 1) / kLanes;
        float* mask = sc.mask_row.get();
        const TensorView& m = a.mask;
        if (a.mask_kind != MaskKind::none)
            load_block(element_ptr(m.data, m.dtype, sc.m_off[r] + j0 * m.strides[4]), m.dtype, 0, m.strides[4], 1, kv,
                       mask, kv, 1);
        const KeyLaneRule rule(a, sc.mods, int64_t(sc.query_index.get()[r]), j0, kv, kv,
                               a.alibi.slopes.data ? sc.slope_lanes.get()[r] : 0.0f);
        VecF score[kRowLayoutKeyVectors];
        VecF block_max = splat(-__builtin_inff());
        for (int t = 0; t < vectors; ++t) {
            score[t] = rule.apply(load(p_row + t * kLanes), t, mask + t * kLanes, nullptr);
            block_max = max_ignoring_nan(score[t], block_max);
        }
        float* row_max = sc.row_max.get();
        float* row_sum = sc.row_sum.get();
        const float old_max = row_max[r];
        float new_max = horizontal_max(block_max);
        new_max = new_max > old_max ? new_max : old_max;
        const float base = new_max == -__builtin_inff() ? 0.0f : new_max;
        VecF sum{};
        for (int t = 0; t < vectors; ++t) {
            const VecF p = vexp2(score[t] - base);
            sum += p;
            store(p_row + t * kLanes, p);
        }
        const float correction = new_max == old_max ? 1.0f : std::exp2(old_max - base);
        row_sum[r] = row_sum[r] * correction + horizontal_sum(sum);
        row_max[r] = new_max;
        if (correction != 1.0f)
            for (int c = 0; c < Dvp; c += kLanes) store(o_row + c, load(o_row + c) * correction);
        if (dropout.active) {
            dropout.multipliers(sc.drop_base[r], j0, kv, mask, 1, sc.keep);
            for (int t = 0; t < vectors; ++t) store(p_row + t * kLanes, load(p_row + t * kLanes) * load(mask + t * kLanes));
        }
    }

    // Partial results of one (item, split): O^T unnormalised, then max and sum.
    static size_t partial_floats(int Dv) { return size_t(Dv + 2) * kBlockQ; }

    // Merges the splits of one item by their log-sum-exp and writes it.
    static void merge_and_write(const SdpaForwardArgs& a, const LanePlan& p, Scratch& sc, const float* partials,
                                int rows) {
        const int Dv = int(a.head_dim_v);
        float* o_t = sc.o_t.get();
        float* row_max = sc.row_max.get();
        float* row_sum = sc.row_sum.get();
        for (int r = 0; r < rows; ++r)
            merge_split_row(partials + r, kBlockQ, partials + Dv * kBlockQ + r, partials + (Dv + 1) * kBlockQ + r,
                            int64_t(partial_floats(Dv)), p.splits, Dv, o_t + r, kBlockQ, row_max[r], row_sum[r]);
        write_rows(a, sc, o_t, row_max, row_sum, rows, Dv);
    }

    // The work layout run() takes for these arguments (work_plan_text).
    static std::string describe(const SdpaForwardArgs& a) {
        const LanePlan p = plan(a);
        const char* layout = RowLayout ? (key_reads(a, p.item_rows).pairs ? "rows_bf16_pairs" : "rows")
                                       : (uses_pair_dots(a) ? "lanes_bf16_pairs" : "lanes");
        // "+turns": units take the turn dimension's items in turn (turn_dim).
        return work_plan_text(layout, std::min(p.item_rows, p.rows_total), p.outer_items,
                              p.splits, std::min(p.keys_per_split, a.seq_kv), team_for_items(p.units()),
                              order_name(!later_rows_see_more(a),
                                         longest_first(later_rows_see_more(a), p.outer_items, omp_get_max_threads())) +
                                  (p.turns > 1 ? "+turns" : ""));
    }

    // Item `outer`'s results of split `split` (in sc: o_pad rows or O^T, row_max, row_sum; sc mapping its
    // lanes) written: the output rows where the keys are not split, else its partial, and the merge of all
    // its splits by the split that finishes them.
    static void finish_item(const SdpaForwardArgs& a, const LanePlan& p, Scratch& sc, int64_t outer, int64_t split,
                            int rows, float* partials, SplitsDone& splits_done) {
        const int Dv = int(a.head_dim_v);
        if (p.splits == 1) {
            if constexpr (RowLayout)
                write_rows_from_o_pad(a, sc, rows, Dv);
            else
                write_rows(a, sc, sc.o_t.get(), sc.row_max.get(), sc.row_sum.get(), rows, Dv);
            return;
        }
        if constexpr (RowLayout) o_pad_rows_to_o_t(sc, rows, Dv);
        float* part = partials + (outer * p.splits + split) * partial_floats(Dv);
        std::copy(sc.o_t.get(), sc.o_t.get() + size_t(Dv) * kBlockQ, part);
        std::copy(sc.row_max.get(), sc.row_max.get() + kBlockQ, part + size_t(Dv) * kBlockQ);
        std::copy(sc.row_sum.get(), sc.row_sum.get() + kBlockQ, part + size_t(Dv + 1) * kBlockQ);
        if (splits_done.finishes(outer))  // sc still maps this item's lanes
            merge_and_write(a, p, sc, partials + outer * p.splits * partial_floats(Dv), rows);
    }

    // Running results of one item's rows while its unit takes the turn indices in turn: o (rows Dvp apart,
    // unnormalised), max (base 2) and sum, per turn index.
    struct TurnState {
        AlignedFloats values;
        int64_t per_item = 0;
        TurnState(const LanePlan& p, int Dvp)
            : values(AlignedFloats::uninitialized(p.turns > 1 ? size_t(p.turns) * (size_t(kBlockQ) * (Dvp + 2)) : 0)),
              per_item(int64_t(kBlockQ) * (Dvp + 2)) {}
        float* o(int64_t h) { return values.get() + h * per_item; }
        float* max(int64_t h, int Dvp) { return o(h) + int64_t(kBlockQ) * Dvp; }
        float* sum(int64_t h, int Dvp) { return max(h, Dvp) + kBlockQ; }
    };

    // Rows' results of one key chunk (sc: o_pad, row_max, row_sum) folded into their running ones by the
    // log-sum-exp (as merge_split_row); first: the running ones start from them.
    static void fold_chunk(const Scratch& sc, int rows, int Dvp, float* o, float* max, float* sum, bool first) {
        for (int r = 0; r < rows; ++r) {
            const float* chunk_o = sc.o_pad.get() + r * Dvp;
            float* run_o = o + r * Dvp;
            const float chunk_max = sc.row_max.get()[r], chunk_sum = sc.row_sum.get()[r];
            if (first) {
                std::copy(chunk_o, chunk_o + Dvp, run_o);
                max[r] = chunk_max;
                sum[r] = chunk_sum;
                continue;
            }
            const float m = std::max(max[r], chunk_max);
            const float base = m == -__builtin_inff() ? 0.0f : m;  // no finite score yet: both weights 0
            const float w_run = std::exp2(max[r] - base), w_chunk = std::exp2(chunk_max - base);
            sum[r] = sum[r] * w_run + chunk_sum * w_chunk;  // a NaN sum stays NaN
            max[r] = m;
            if (w_run == 0.0f)  // nothing seen before counts (merge_split_row skips such a split likewise)
                std::fill(run_o, run_o + Dvp, 0.0f);
            else if (w_run != 1.0f)
                for (int c = 0; c < Dvp; c += kLanes) store(run_o + c, load(run_o + c) * splat(w_run));
            if (w_chunk != 0.0f)
                for (int c = 0; c < Dvp; c += kLanes)
                    store(run_o + c, load(run_o + c) + load(chunk_o + c) * splat(w_chunk));
        }
    }

    // Unit u of a plan with turns: its split's keys a chunk at a time, each chunk for every turn index's item
    // in turn (turn_dim), then each item finished.  Quantized rows of a chunk's tokens are brought in whole
    // first (KvReader::bring_in_token_rows): their decoding otherwise waited on each block's first loads.
    // Plain rows are left to the block copies and the hardware prefetchers, which serve them as well.
    static void attend_in_turn(const SdpaForwardArgs& a, const LanePlan& p, Scratch& sc, TurnState& state, int64_t u,
                               bool skip_hidden_blocks, float* partials, SplitsDone& splits_done) {
        const int Dvp = Scratch::padded(a.head_dim_v);
        const int64_t split = u % p.splits;
        const KvReader k(a.key), v(a.value);
        const int64_t key_begin = split * p.keys_per_split;
        const int64_t key_end = std::min(a.seq_kv, key_begin + p.keys_per_split);
        int64_t b[kBatchDims], row0;
        int rows = 0;
        // At least one chunk, so that a split without keys gives each item its empty results too.
        const int64_t chunks = std::max<int64_t>(1, (key_end - key_begin + kTurnKeys - 1) / kTurnKeys);
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t c0 = key_begin + c * kTurnKeys, c1 = std::min(key_end, c0 + kTurnKeys);
            for (int64_t h = 0; h < p.turns; ++h) {
                item_origin(a, p, p.turn_item(u, h), b, row0);
                rows = map_lanes(a, p, sc, b, row0);
                if (h == 0 && (k.rows_decoded() || v.rows_decoded())) {  // the chunk's token rows the items see
                    int64_t seen_begin = c0, seen_end = c1;
                    if (skip_hidden_blocks) seen_keys(a, sc, rows, seen_begin, seen_end);
                    const int n = int(std::max<int64_t>(0, seen_end - seen_begin));
                    if (n > 0 && k.rows_decoded())
                        k.bring_in_token_rows(k.batch_offset(b), seen_begin, n, int(a.head_dim_qk), p.turn_dim, p.turns);
                    if (n > 0 && v.rows_decoded())
                        v.bring_in_token_rows(v.batch_offset(b), seen_begin, n, int(a.head_dim_v), p.turn_dim, p.turns);
                }
                attend_rows(a, sc, b, rows, c0, c1, RowPrefetch::none, skip_hidden_blocks);
                fold_chunk(sc, rows, Dvp, state.o(h), state.max(h, Dvp), state.sum(h, Dvp), c == 0);
            }
        }
        for (int64_t h = 0; h < p.turns; ++h) {
            const int64_t outer = p.turn_item(u, h);
            item_origin(a, p, outer, b, row0);
            rows = map_lanes(a, p, sc, b, row0);
            std::copy(state.o(h), state.o(h) + int64_t(rows) * Dvp, sc.o_pad.get());
            std::copy(state.max(h, Dvp), state.max(h, Dvp) + rows, sc.row_max.get());
            std::copy(state.sum(h, Dvp), state.sum(h, Dvp) + rows, sc.row_sum.get());
            finish_item(a, p, sc, outer, split, rows, partials, splits_done);
        }
    }

    static Status run(const SdpaForwardArgs& a) {
        const int Dv = int(a.head_dim_v);
        const LanePlan p = plan(a);
        const bool skip_hidden_blocks = skips_hidden_blocks(a), uneven = later_rows_see_more(a);
        const bool by_rank = longest_first(uneven, p.outer_items, omp_get_max_threads());
        // Every (item, split) writes its whole partial before the merge reads it.
        AlignedFloats partials =
            AlignedFloats::uninitialized(p.splits > 1 ? size_t(p.outer_items * p.splits) * partial_floats(Dv) : 0);

        const int team = team_for_items(p.units());
        HomeFirstUnits units(p.units(), team, !uneven);
        SplitsDone splits_done(p.outer_items, p.splits);
        const int64_t v_blocks = Scratch::cached_v_blocks(a, p, !uneven);
        run_on_pool(team, [&] {
            Scratch sc(a, p.item_rows, v_blocks);
            TurnState state(p, Scratch::padded(Dv));
            units.for_each([&](int64_t w) {
                if constexpr (RowLayout) {
                    if (p.turns > 1)
                        return attend_in_turn(a, p, sc, state, w, skip_hidden_blocks, partials.get(), splits_done);
                }
                const WorkItem x = work_item(w / p.splits, p.outer_items / p.row_blocks, p.row_blocks, by_rank);
                const int64_t outer = x.batch * p.row_blocks + (uneven ? p.row_blocks - 1 - x.rank : x.rank);
                const int64_t split = w % p.splits;
                int64_t b[kBatchDims], row0;
                item_origin(a, p, outer, b, row0);
                const int rows = map_lanes(a, p, sc, b, row0);
                const int64_t key_begin = split * p.keys_per_split;
                const int64_t key_end = std::min(a.seq_kv, key_begin + p.keys_per_split);
                if constexpr (RowLayout)
                    attend_rows(a, sc, b, rows, key_begin, key_end, RowPrefetch::next_block, skip_hidden_blocks);
                else
                    attend(a, sc, b, rows, key_begin, key_end, skip_hidden_blocks);
                finish_item(a, p, sc, outer, split, rows, partials.get(), splits_done);
            });
        });
        return Status::success();
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
