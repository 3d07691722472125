// FlashAttention-2 backward in f32 on the lane GEMMs of lane_gemm.hpp, or,
// for bf16 where they pay off, on their bf16-pair forms (lane_gemm_bf16.hpp:
// P and dS rounded to bf16, sums in f32).
//
// P is recomputed from the forward's log-sum-exp, so nothing of size
// Sq x Skv is stored.  Two parallel passes:
//   1. D[i] = rowsum(dO[i] * O[i]) for every query row (O(B * Sq) floats).
//   2. Items of (K/V batch index, key split): the keys are the vector lanes,
//      K^T and V^T are loaded once per key block, and the item walks every
//      query row of every batch index that shares these K/V (all heads of a
//      GQA group), so the group reduction happens in registers and no
//      per-head dK/dV is ever materialised.  It takes kKeyBlocksAtOnce key
//      blocks at a time, so that each chunk of query rows (Q, dO and dQ, and
//      on bf16 pairs Q's and dO's packed pairs) serves them all.  dQ += dS K
//      goes to an f32 buffer of dQ's size per key split, summed at the end,
//      or, with one split and an f32 dQ whose rows the products can write
//      (dq_in_place), straight into dQ.
// A K/V batch index's key blocks are split among items (KvGrouping::key_splits)
// until every thread has kItemsPerThread of them (one under a causal mask,
// whose skipped blocks halve the work for the same buffers), as far as the
// buffers' memory budget allows.  A third pass that recomputed S and dP with
// query rows as lanes for dQ, taken where K/V batch indices were fewer than
// threads, was slower everywhere, most of all at few query rows, whose lanes
// it padded.  Causal blocks that the mask
// removes entirely are skipped.
// The last item per thread is handed out in pieces of one key block, or of
// kKeyBlocksAtOnce where there are enough of them (KeyBlockWave, work_order.hpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "block_io.hpp"
#include "dropout.hpp"
#include "graphattn/cpu_features.hpp"
#include "graphattn/sdpa.hpp"
#include "kv_grouping.hpp"
#include "isa_namespace.hpp"
#include "kv_reader.hpp"
#include "lane_gemm.hpp"
#include "lane_gemm_bf16.hpp"
#include "lane_masks.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <int RV, int NT>
struct LaneBackward {
    static constexpr int kLaneBlock = RV * kLanes;  // keys per key block
    static constexpr int kRowChunk = 64;           // query rows per step
    static constexpr int64_t kItemsPerThread = 4;   // items wanted per thread
    // Key blocks an item takes at once, reading each chunk of query rows once for them all
    // (key_items): GQA calls, whose rows are read for several heads, gain the most.
    static constexpr int kKeyBlocksAtOnce = 4;

    SdpaBackwardArgs args;  // the caller's, with Q and dO possibly redirected to f32 copies
    const SdpaForwardArgs& a;
    AlignedFloats f32_copies[2];
    int D, Dv;
    float scale;          // multiplies Q K^T
    bool skip_hidden;     // key blocks and rows no row or key of theirs sees are skipped (a -inf fill)
    bool zero_unkept;
    DropoutPlan dropout;
    int64_t batch_total;
    KvGrouping kv;            // batch dims K and V ignore (their gradients sum over them)
    AlignedFloats row_delta;  // D[i] of pass 1, indexed by flat batch * Sq + i
    int64_t dq_splits = 1;    // items (and dQ buffers) per K/V batch index
    int d_padded = 0;         // D rounded up to whole vectors: the row length of dq_sum
    int64_t dq_plane = 0;     // floats per dQ buffer
    bool dq_direct = false;   // dQ's sums go straight into the gradient (dq_in_place); no buffers
    AlignedFloats dq_sum;     // else dq_splits buffers of f32 dQ, rows (flat batch * Sq + i)
    int team = 1;             // threads of every parallel region of the call (team_for_items)
    bool pair_dots = false;   // the five products on bf16 pairs (uses_pair_dots); Q and dO then stay bf16

    explicit LaneBackward(const SdpaBackwardArgs& backward)
        : args(backward),
          a(args.forward),
          D(int(a.head_dim_qk)),
          Dv(int(a.head_dim_v)),
          scale(score_scale(a)),
          skip_hidden(skips_hidden_blocks(a) && !backward.grad_mask.data),  // dS of every score is written
          zero_unkept(needs_unkept_zeroing(a)),
          dropout(a),
          batch_total(a.batch[0] * a.batch[1] * a.batch[2]),
          kv(a),
          row_delta(AlignedFloats::uninitialized(size_t(batch_total * a.seq_q))),
          pair_dots(uses_pair_dots(backward)) {
        d_padded = int(round_up(D, kLanes));
        dq_plane = dq_plane_of(a);
        const KeyPassWork work = key_work(a, kv, dq_plane);
        team = work.team;
        dq_splits = work.splits;
        dq_direct = dq_in_place(backward, dq_splits);
        if (!dq_direct) dq_sum = AlignedFloats::uninitialized(size_t(dq_splits * dq_plane));  // cleared by row_deltas
        // Every row of Q and dO is read once per key block: convert them to f32
        // once, up front.  K and V blocks are converted as they are loaded: copies
        // of all K and V, fresh memory on every call, cost a small bf16 call
        // more than its arithmetic (page faults and conversions).
        if (pair_dots) return;  // read as they are
        const TensorView query = args.forward.query, grad_output = args.grad_output;
        const bool copy_q = redirect_to_f32(args.forward.query, a.seq_q, D, f32_copies[0]);
        const bool copy_do = redirect_to_f32(args.grad_output, a.seq_q, Dv, f32_copies[1]);
        if (copy_q || copy_do)
            run_on_team(team, [&] {  // both copies in one parallel region
                if (copy_q) copy_rows(query, args.forward.query, f32_copies[0].get(), a.seq_q, D);
                if (copy_do) copy_rows(grad_output, args.grad_output, f32_copies[1].get(), a.seq_q, Dv);
            });
    }

    // Whether the products run on bf16 pairs (lane_gemm_bf16.hpp): bf16 Q, K, V and dO whose rows give
    // their pairs in place (unit column stride, even head dims), on a CPU where pairs pay off.  Others are
    // converted to f32 as before.
    static bool uses_pair_dots(const SdpaBackwardArgs& backward) {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        const SdpaForwardArgs& f = backward.forward;
        auto bf16_pairs = [](const TensorView& t, int64_t cols) {
            return t.dtype == DType::bf16 && pairs_in_place(t, cols);
        };
        auto bf16_kv_pairs = [](const KvReader& kv, int64_t cols) {
            return kv.dtype() == DType::bf16 && pairs_in_place(kv, cols);
        };
        return bf16_pairs_pay_off() && bf16_pairs(f.query, f.head_dim_qk) &&
               bf16_kv_pairs(KvReader(f.key), f.head_dim_qk) && bf16_kv_pairs(KvReader(f.value), f.head_dim_v) &&
               bf16_pairs(backward.grad_output, f.head_dim_v);
#else
        (void)backward;
        return false;
#endif
    }

    // Whether dQ += dS K can sum straight into the gradient: one key split (no sum of buffers), f32 products
    // (K's rows carry the scale), dQ in f32 with unit column stride and D a whole number of vectors (the
    // products write whole vectors).  It spares a buffer of dQ's size, fresh memory on every call, and the
    // pass that copies it out.
    static bool dq_in_place(const SdpaBackwardArgs& backward, int64_t splits) {
        const TensorView& dq = backward.grad_query;
        return splits == 1 && !uses_pair_dots(backward) && dq.dtype == DType::f32 && dq.strides[4] == 1 &&
               backward.forward.head_dim_qk % kLanes == 0;
    }

    static const uint16_t* bf16_rows(const TensorView& t, const int64_t b[kBatchDims], int64_t row0) {
        return static_cast<const uint16_t*>(t.data) + view_batch_offset(t, b) + row0 * t.strides[3];
    }

    // Row row0 of batch index b of Q or dO (f32 with unit column stride once
    // the constructor has run); rows are strides[3] apart.
    static const float* f32_rows(const TensorView& t, const int64_t b[kBatchDims], int64_t row0) {
        return static_cast<const float*>(t.data) + view_batch_offset(t, b) + row0 * t.strides[3];
    }

    // Redirects `t` to an f32 copy with unit column stride (broadcast batch
    // dims keep stride 0) unless it already is one, and returns whether it
    // did; copy_rows then fills the copy.
    bool redirect_to_f32(TensorView& t, int64_t rows, int cols, AlignedFloats& storage) const {
        if (t.dtype == DType::f32 && t.strides[4] == 1) return false;
        int64_t strides[kBatchDims + 2] = {0, 0, 0, cols, 1};
        int64_t size = rows * cols;
        for (int d = kBatchDims - 1; d >= 0; --d) {
            if (a.batch[d] == 1 || t.strides[d] == 0) continue;
            strides[d] = size;
            size *= a.batch[d];
        }
        storage = AlignedFloats::uninitialized(size_t(size));
        t.data = storage.get();
        t.dtype = DType::f32;
        for (int d = 0; d < kBatchDims + 2; ++d) t.strides[d] = strides[d];
        return true;
    }

    // The rows of `src` into its f32 copy `dst`, laid out as the view `copy` (redirect_to_f32); a worksharing
    // loop with no barrier at its end, for a parallel region that only reads the copies after it closes.
    void copy_rows(const TensorView& src, const TensorView& copy, float* dst, int64_t rows, int cols) const {
#pragma omp for schedule(static) nowait
        for (int64_t x = 0; x < batch_total * rows; ++x) {
            int64_t b[kBatchDims];
            unflatten_batch(a.batch, x / rows, b);
            const int64_t i = x % rows;
            load_block(element_ptr(src.data, src.dtype, view_batch_offset(src, b) + i * src.strides[3]), src.dtype,
                       0, src.strides[4], 1, cols, dst + view_batch_offset(copy, b) + i * cols, cols, 1);
        }
    }

    int64_t flat_batch(const int64_t b[kBatchDims]) const { return (b[0] * a.batch[1] + b[1]) * a.batch[2] + b[2]; }

    // log2-unit log-sum-exp of row i; +inf for a fully masked row (-inf), so that its P is 0.
    float lse_log2(const int64_t b[kBatchDims], int64_t i) const {
        const float lse = static_cast<const float*>(a.stats.data)[view_batch_offset(a.stats, b) + i * a.stats.strides[3]];
        return lse == -__builtin_inff() ? __builtin_inff() : lse * kLog2e;
    }

    // ---- pass 1 --------------------------------------------------------------------------
    // D = rowsum(dO * O) per query row, and the row's dQ sums cleared, in one parallel region (each costs
    // a small call a few microseconds to open on 16 cores).
    void row_deltas() {
        const int64_t rows = batch_total * a.seq_q;
        run_on_team(team, [&] {
            AlignedFloats o_row{size_t(Dv)}, do_row{size_t(Dv)};
#pragma omp for schedule(static)
            for (int64_t x = 0; x < rows; ++x) {
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x / a.seq_q, b);
                const int64_t i = x % a.seq_q;
                if (dq_direct) {
                    float* row = dq_rows(b, i, nullptr);
                    std::fill(row, row + D, 0.0f);
                } else {
                    for (int64_t s = 0; s < dq_splits; ++s) {
                        float* sum = dq_sum.get() + s * dq_plane + x * d_padded;
                        std::fill(sum, sum + d_padded, 0.0f);
                    }
                }
                const TensorView &o = a.output, &g = args.grad_output;
                load_block(element_ptr(o.data, o.dtype, view_batch_offset(o, b) + i * o.strides[3]), o.dtype, 0,
                           o.strides[4], 1, Dv, o_row.get(), Dv, 1);
                load_block(element_ptr(g.data, g.dtype, view_batch_offset(g, b) + i * g.strides[3]), g.dtype, 0,
                           g.strides[4], 1, Dv, do_row.get(), Dv, 1);
                row_delta.get()[x] = dot(o_row.get(), do_row.get(), Dv);
            }
        });
    }

    // ---- pass 2: dK, dV and dQ with keys as lanes -------------------------------------------
    // One key block's operands as the products read them, and its dK^T, dV^T sums.
    struct KeyBlock {
        AlignedFloats k_t, v_t, dk_t, dv_t, k_rows;
        // pair_dots (32-bit words of bf16 pairs): K^T and V^T along the head dims, K's rows along the keys.
        AlignedFloats kt_pairs, vt_pairs, k_row_pairs;
        int64_t j0 = 0;  // its first key
        int64_t first_row = 0, row_end = 0;  // query rows outside [first_row, row_end) see none of its keys
        int kv_rows = 0;                // its keys
        // Only k_rows (its padding columns) must start as zeros; the rest is written before it is read.
        KeyBlock(int D, int Dv, int d_padded, bool pairs)
            : k_t(AlignedFloats::uninitialized(pairs ? 0 : size_t(D) * kLaneBlock)),
              v_t(AlignedFloats::uninitialized(pairs ? 0 : size_t(Dv) * kLaneBlock)),
              dk_t(AlignedFloats::uninitialized(size_t(D) * kLaneBlock)),
              dv_t(AlignedFloats::uninitialized(size_t(Dv) * kLaneBlock)),
              k_rows(pairs ? 0 : size_t(kLaneBlock) * d_padded),
              kt_pairs(AlignedFloats::uninitialized(pairs ? size_t(D / 2) * kLaneBlock : 0)),
              vt_pairs(AlignedFloats::uninitialized(pairs ? size_t(Dv / 2) * kLaneBlock : 0)),
              k_row_pairs(AlignedFloats::uninitialized(pairs ? size_t(kLaneBlock / 2) * d_padded : 0)) {}
    };

    struct KeyScratch {
        std::vector<KeyBlock> blocks;  // the key blocks taken at once
        AlignedFloats s, dp, mask_rows, out_rows, z, v_rows;
        AlignedFloats cap_grad;  // a softcap's derivative per score (rows x kLaneBlock), where the call has one
        // pair_dots: per row chunk P^T and dS^T along the rows, Q's and dO's rows along the rows, dS rows in bf16.
        AlignedFloats p_pairs, ds_pairs, q_pairs, do_pairs, ds_rows;
        KvStage k_stage, v_stage;  // K/V blocks where their layout keeps the rows apart (kv_reader.hpp)
        float lse[kRowChunk], delta[kRowChunk];
        uint64_t drop_base[kRowChunk];
        uint8_t keep[kLaneBlock];
        int64_t m_off[kRowChunk], dm_off[kRowChunk], qi[kRowChunk];
        // Only z (whose padding lanes multiply others) must start as zeros; the
        // rest is written before it is read, and clearing it took 6-7% of small
        // calls (perf, this machine: (1,8,8,1,17,80) bf16, (2,16,16,8,300,128) f32).
        KeyScratch(int D, int Dv, int d_padded, bool dropout, bool pairs, int key_blocks, bool capped)
            : s(AlignedFloats::uninitialized(size_t(kRowChunk) * kLaneBlock)),
              dp(AlignedFloats::uninitialized(size_t(kRowChunk) * kLaneBlock)),
              mask_rows(AlignedFloats::uninitialized(size_t(kRowChunk) * kLaneBlock)),
              out_rows(AlignedFloats::uninitialized(size_t(kTransposedRowsAtOnce) * std::max(D, Dv))),
              z(dropout ? size_t(kRowChunk) * kLaneBlock : 0),
              v_rows(AlignedFloats::uninitialized(pairs ? 0 : size_t(kLaneBlock) * Dv)),
              cap_grad(AlignedFloats::uninitialized(capped ? size_t(kRowChunk) * kLaneBlock : 0)),
              p_pairs(AlignedFloats::uninitialized(pairs ? size_t(kRowChunk / 2) * kLaneBlock : 0)),
              ds_pairs(AlignedFloats::uninitialized(pairs ? size_t(kRowChunk / 2) * kLaneBlock : 0)),
              q_pairs(AlignedFloats::uninitialized(pairs ? size_t(kRowChunk / 2) * d_padded : 0)),
              do_pairs(AlignedFloats::uninitialized(pairs ? size_t(kRowChunk / 2) * round_up(Dv, kLanes) : 0)),
              ds_rows(AlignedFloats::uninitialized(pairs ? size_t(kRowChunk) * kLaneBlock / 2 : 0)) {
            blocks.reserve(size_t(key_blocks));
            for (int g = 0; g < key_blocks; ++g) blocks.emplace_back(D, Dv, d_padded, pairs);
        }
    };

    // Rows i0 .. i0 + rows of batch index b against the item's keys.
    // On bf16 pairs, Q's and dO's rows from chunk_row0 on are in sc.q_pairs and sc.do_pairs
    // (pack_row_chunk), i0 - chunk_row0 even.
    // rows_cold: the first key block of the chunk, which brings its rows of Q, dO and dQ from L3 (an
    // item's rows outgrow L2); its f32 products then hint each next tile's rows (lane_gemm.hpp): S's and
    // dP's where they run in register tiles (unmasked_f32_block), and dQ's.
    void key_item_rows(KeyScratch& sc, KeyBlock& kb, const int64_t b[kBatchDims], int64_t chunk_row0, int64_t i0,
                       int rows, float* dq_buffer, const DqTurn& turn, bool rows_cold) {
        const int64_t fb = flat_batch(b);
        for (int r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            sc.lse[r] = lse_log2(b, i);
            sc.delta[r] = row_delta.get()[fb * a.seq_q + i];
            sc.qi[r] = i;
            sc.m_off[r] = view_batch_offset(a.mask, b) + i * a.mask.strides[3];
            sc.dm_off[r] = view_batch_offset(args.grad_mask, b) + i * args.grad_mask.strides[3];
            sc.drop_base[r] = dropout.row_base(fb, i);
        }
        if (unmasked_f32_block(kb, i0, rows))
            tile_probs_and_grad_scores(sc, kb, b, i0, rows, rows_cold);
        else
            probs_and_grad_scores(sc, kb, b, i0, rows);
        // dV^T += P^T dO and dK^T += dS^T Q (the scale is applied once, at the end).
        key_grads(sc, kb, b, i0, rows, int((i0 - chunk_row0) / 2));
        // dQ rows += dS K; pieces of one item add in their key blocks' order (DqTurns).
        if (!turn.begin(fb * a.seq_q + i0, rows, i0, 1)) return;
        query_grads(sc, kb, rows, dq_rows(b, i0, dq_buffer), dq_row_stride(), rows_cold);
        turn.end(fb * a.seq_q + i0, rows, i0, 1);
    }

    // Row i of batch index b of dQ's sums: in the gradient itself (dq_direct), else in `buffer`; rows
    // dq_row_stride() floats apart.
    float* dq_rows(const int64_t b[kBatchDims], int64_t i, float* buffer) const {
        const TensorView& dq = args.grad_query;
        if (dq_direct)
            return static_cast<float*>(const_cast<void*>(dq.data)) + view_batch_offset(dq, b) + i * dq_row_stride();
        return buffer + (flat_batch(b) * a.seq_q + i) * dq_row_stride();
    }
    int64_t dq_row_stride() const { return dq_direct ? args.grad_query.strides[3] : d_padded; }

    // P into sc.s and dS into sc.dp for rows i0.. against key block kb, in passes between the products.
    void probs_and_grad_scores(KeyScratch& sc, const KeyBlock& kb, const int64_t b[kBatchDims], int64_t i0,
                               int rows) {
        const int64_t j0 = kb.j0;
        const int kv_rows = kb.kv_rows;
        float* s = sc.s.get();
        float* dp = sc.dp.get();
        // S (log2 units, scale * log2 e applied), masked; then P = 2^(S - lse).
        scores(sc, kb, b, i0, rows);
        float* cap_grad = a.softcap > 0.0f ? sc.cap_grad.get() : nullptr;
        mask_key_lanes<RV>(a, s, sc.mask_rows.get(), sc.m_off, sc.qi, rows, kv_rows, j0,
                           KeyLaneMods{slope_log2(a, b), cap_grad});
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < RV; ++v) store(s + r * kLaneBlock + v * kLanes, vexp2(load(s + r * kLaneBlock + v * kLanes) - sc.lse[r]));
        // dP = dO V^T (through the dropout mask Z when there is one), then dS = P (dP - D).
        grad_probs(sc, kb, b, i0, rows);
        float* z = sc.z.get();
        if (dropout.active) {
            for (int r = 0; r < rows; ++r) dropout.multipliers(sc.drop_base[r], j0, kv_rows, z + r * kLaneBlock, 1, sc.keep);
            multiply_in_place(dp, z, size_t(rows) * kLaneBlock);
        }
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < RV; ++v) {
                float* x = dp + r * kLaneBlock + v * kLanes;
                store(x, load(s + r * kLaneBlock + v * kLanes) * (load(x) - sc.delta[r]));
            }
        if (args.grad_mask.data) {
            float* dmask = static_cast<float*>(const_cast<void*>(args.grad_mask.data));
            for (int r = 0; r < rows; ++r)
                for (int l = 0; l < kv_rows; ++l)
                    dmask[sc.dm_off[r] + (j0 + l) * args.grad_mask.strides[4]] = dp[r * kLaneBlock + l];
        }
        if (zero_unkept) zero_unkept_key_lanes<RV>(a, dp, sc.mask_rows.get(), sc.qi, rows, j0);
        if (cap_grad) multiply_in_place(dp, cap_grad, size_t(rows) * kLaneBlock);  // dS through the softcap
        if (dropout.active)  // dV takes the dropped probabilities
            for (int r = 0; r < rows; ++r)
                for (int v = 0; v < RV; ++v) {
                    float* x = s + r * kLaneBlock + v * kLanes;
                    store(x, load(x) * load(z + r * kLaneBlock + v * kLanes));
                }
    }

    // The same in the products' register tiles (unmasked_f32_block).
    void tile_probs_and_grad_scores(KeyScratch& sc, const KeyBlock& kb, const int64_t b[kBatchDims], int64_t i0,
                                    int rows, bool rows_cold) const {
        ProbTiles probs{sc.s.get(), sc.lse};
        lane_gemm_to<RV, NT>(kb.k_t.get(), D, f32_rows(a.query, b, i0), a.query.strides[3], 1, rows, probs, rows_cold);
        GradScoreTiles grads{sc.s.get(), sc.dp.get(), sc.delta};
        const TensorView& g = args.grad_output;
        lane_gemm_to<RV, NT>(kb.v_t.get(), Dv, f32_rows(g, b, i0), g.strides[3], 1, rows, grads, rows_cold);
    }

    // Whether key block kb needs none of the passes between the products for rows from i0 on (f32
    // products, no mask, dropout or mask gradient, every key of the block visible to every row): P and
    // dS are then taken in the products' register tiles (ProbTiles, GradScoreTiles).
    bool unmasked_f32_block(const KeyBlock& kb, int64_t i0, int rows) const {
        if (pair_dots || needs_score_pass(a) || a.softcap > 0.0f || dropout.active || args.grad_mask.data)
            return false;
        if (kb.kv_rows != kLaneBlock) return false;  // padding lanes take -inf in the mask pass
        return !a.window.limited() ||
               a.window.block(i0, i0 + rows, kb.j0, kb.j0 + kb.kv_rows) == KeyWindow::Block::all_visible;
    }

    // P = 2^(S - lse) of rows n.. from their score tiles (lane_gemm_to's sink).
    struct ProbTiles {
        float* p;
        const float* lse;
        template <int NT_>
        __attribute__((always_inline)) void tile(const VecF (&acc)[NT_][RV], int n) {
#pragma GCC unroll 16
            for (int t = 0; t < NT_; ++t)
#pragma GCC unroll 16
                for (int v = 0; v < RV; ++v)
                    store(p + (n + t) * kLaneBlock + v * kLanes, vexp2(acc[t][v] - lse[n + t]));
        }
    };

    // dS = P (dP - D) of rows n.. from their dP tiles.
    struct GradScoreTiles {
        const float* p;
        float* ds;
        const float* delta;
        template <int NT_>
        __attribute__((always_inline)) void tile(const VecF (&acc)[NT_][RV], int n) {
#pragma GCC unroll 16
            for (int t = 0; t < NT_; ++t)
#pragma GCC unroll 16
                for (int v = 0; v < RV; ++v) {
                    const int at = (n + t) * kLaneBlock + v * kLanes;
                    store(ds + at, load(p + at) * (acc[t][v] - delta[n + t]));
                }
        }
    };

    // The five products of key_item_rows, in f32 or on bf16 pairs.
    // s = Q K^T * scale * log2(e) for rows i0.. of batch index b.
    void scores(KeyScratch& sc, const KeyBlock& kb, const int64_t b[kBatchDims], int64_t i0, int rows) const {
        const int64_t q_stride = a.query.strides[3];
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (pair_dots) {
            pair_gemm<RV, NT, false>(kb.kt_pairs.words(), D / 2, bf16_rows(a.query, b, i0), q_stride, 2, rows,
                                     sc.s.get(), scale * kLog2e);
            return;
        }
#endif
        lane_gemm<RV, NT, false>(kb.k_t.get(), D, f32_rows(a.query, b, i0), q_stride, 1, rows, sc.s.get());  // K^T scaled
    }

    // dp = dO V^T.
    void grad_probs(KeyScratch& sc, const KeyBlock& kb, const int64_t b[kBatchDims], int64_t i0, int rows) const {
        const TensorView& g = args.grad_output;
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (pair_dots) {
            pair_gemm<RV, NT, false>(kb.vt_pairs.words(), Dv / 2, bf16_rows(g, b, i0), g.strides[3], 2, rows, sc.dp.get());
            return;
        }
#endif
        lane_gemm<RV, NT, false>(kb.v_t.get(), Dv, f32_rows(g, b, i0), g.strides[3], 1, rows, sc.dp.get());
    }

    // dV^T += P^T dO (P in s) and dK^T += dS^T Q (dS in dp).
    void key_grads(KeyScratch& sc, KeyBlock& kb, const int64_t b[kBatchDims], int64_t i0, int rows,
                   int packed_pair0) const {
        const TensorView &q = a.query, &g = args.grad_output;
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (pair_dots) {
            const int row_pairs = (rows + 1) / 2;
            const int64_t dv_padded = round_up(Dv, kLanes);
            pack_lane_pairs(sc.s.get(), rows, kLaneBlock, sc.p_pairs.words());
            pack_lane_pairs(sc.dp.get(), rows, kLaneBlock, sc.ds_pairs.words());
            const uint32_t* do_pairs = sc.do_pairs.words() + packed_pair0 * dv_padded;
            const uint32_t* q_pairs = sc.q_pairs.words() + packed_pair0 * d_padded;
            pair_gemm<RV, NT, true>(sc.p_pairs.words(), row_pairs, reinterpret_cast<const uint16_t*>(do_pairs), 2,
                                    2 * dv_padded, Dv, kb.dv_t.get());
            pair_gemm<RV, NT, true>(sc.ds_pairs.words(), row_pairs, reinterpret_cast<const uint16_t*>(q_pairs), 2,
                                    2 * d_padded, D, kb.dk_t.get());
            return;
        }
#endif
        lane_gemm<RV, NT, true>(sc.s.get(), rows, f32_rows(g, b, i0), 1, g.strides[3], Dv, kb.dv_t.get());
        lane_gemm<RV, NT, true>(sc.dp.get(), rows, f32_rows(q, b, i0), 1, q.strides[3], D, kb.dk_t.get());
    }

    // Q's and dO's rows i0 .. i0 + rows of batch index b as pairs of rows (bf16 pair products only).
    void pack_row_chunk(KeyScratch& sc, const int64_t b[kBatchDims], int64_t i0, int rows) const {
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        const TensorView &q = a.query, &g = args.grad_output;
        pack_row_pairs(bf16_rows(g, b, i0), g.strides[3], rows, Dv, sc.do_pairs.words(), round_up(Dv, kLanes));
        pack_row_pairs(bf16_rows(q, b, i0), q.strides[3], rows, D, sc.q_pairs.words(), d_padded);
#else
        (void)sc, (void)b, (void)i0, (void)rows;
#endif
    }

    // dQ rows (ld apart) += dS K over the block's kv_rows keys (K's rows padded with zeros to d_padded).
    void query_grads(KeyScratch& sc, const KeyBlock& kb, int rows, float* dq_out, int64_t ld, bool rows_cold) const {
        const int kv_rows = kb.kv_rows;
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (pair_dots) {
            uint16_t* ds_rows = reinterpret_cast<uint16_t*>(sc.ds_rows.get());
            round_rows_to_bf16(sc.dp.get(), kLaneBlock, rows, kLaneBlock, kv_rows, ds_rows, kLaneBlock);
            pair_gemm_wide<RV, NT, true>(kb.k_row_pairs.words(), d_padded, (kv_rows + 1) / 2, ds_rows, kLaneBlock, 2,
                                         rows, dq_out, ld, d_padded);
            return;
        }
#endif
        lane_gemm_wide<RV, NT, true>(kb.k_rows.get(), d_padded, kv_rows, sc.dp.get(), kLaneBlock, 1, rows, dq_out,
                                     ld, d_padded, rows_cold);
    }

    // Key block j0 (kv_rows keys) of K/V batch index outer_b as the products read it: K's rows in f32
    // carrying the scale for dQ += dS K (columns past D zero), K^T and V^T with lanes past kv_rows zero,
    // K^T carrying scale * log2(e); or, on bf16 pairs, K^T and V^T pairs along the head dims and K's rows paired
    // along the keys.
    void load_key_block(KeyScratch& sc, KeyBlock& kb, const int64_t outer_b[kBatchDims]) const {
        const int64_t j0 = kb.j0;
        const int kv_rows = kb.kv_rows;
        const KvReader k(a.key), v(a.value);
        const int64_t k_base = k.batch_offset(outer_b), v_base = v.batch_offset(outer_b);
#if defined(__AVX512F__) && GRAPHATTN_LANES == 16
        if (pair_dots) {  // K and V in place (uses_pair_dots)
            const RowBlock k_rows = k.block(k_base, j0, kv_rows, sc.k_stage);
            const RowBlock v_rows = v.block(v_base, j0, kv_rows, sc.v_stage);
            auto word_rows = [](const RowBlock& rows) {
                return [=](int r) { return reinterpret_cast<const uint32_t*>(rows.word_row(r)); };
            };
            transpose_rows<uint32_t>(word_rows(k_rows), kv_rows, D / 2, kb.kt_pairs.words(), kLaneBlock, 1.0f,
                                     kLaneBlock);
            transpose_rows<uint32_t>(word_rows(v_rows), kv_rows, Dv / 2, kb.vt_pairs.words(), kLaneBlock, 1.0f,
                                     kLaneBlock);
            // Words from D to d_padded stay unwritten: they reach only dQ's padding columns, never read.
            pack_row_pairs(k_rows.words(), k_rows.row_stride, kv_rows, D, kb.k_row_pairs.words(), d_padded);
            return;
        }
#endif
        float* k_rows = kb.k_rows.get();
        k.load_f32(k_base, j0, kv_rows, D, k_rows, d_padded);
        for (int r = 0; r < kv_rows; ++r)
            for (int d = 0; d < D; ++d) k_rows[r * d_padded + d] *= scale;
        int64_t v_stride;
        const float* v_rows = v.rows_f32(v_base, j0, kv_rows, Dv, sc.v_rows.get(), Dv, v_stride);
        transpose_rows_f32([=](int r) { return k_rows + r * d_padded; }, kv_rows, D, kb.k_t.get(), kLaneBlock, kLog2e,
                           kLaneBlock);
        transpose_rows_f32([=](int r) { return v_rows + r * v_stride; }, kv_rows, Dv, kb.v_t.get(), kLaneBlock, 1.0f,
                           kLaneBlock);
    }

    // The unit's key blocks first, first + step, ... < end of K/V batch index
    // outer_b, up to sc.blocks.size() of them at once: each chunk of query rows
    // is read once for them all.  dq_buffer receives dS K, in the unit's turns.
    void key_items(KeyScratch& sc, const int64_t outer_b[kBatchDims], const KeyBlockWave::Unit& unit, int64_t step,
                   float* dq_buffer) {
        const int64_t first = unit.first, end = unit.end;
        const int64_t counter_base = unit.item % step * batch_total * a.seq_q;
        const int64_t at_once = int64_t(sc.blocks.size());
        for (int64_t kb0 = first; kb0 < end; kb0 += at_once * step) {
            int taken = 0;
            for (int64_t kb = kb0; kb < end && taken < at_once; kb += step, ++taken) {
                KeyBlock& blk = sc.blocks[size_t(taken)];
                blk.j0 = kb * kLaneBlock;
                blk.kv_rows = int(std::min<int64_t>(kLaneBlock, a.seq_kv - blk.j0));
                blk.first_row = skip_hidden ? a.window.row_begin(blk.j0, a.seq_q) : 0;
                blk.row_end = skip_hidden ? a.window.row_end(blk.j0 + blk.kv_rows - 1, a.seq_q) : a.seq_q;
                load_key_block(sc, blk, outer_b);
                std::fill(blk.dk_t.get(), blk.dk_t.get() + size_t(D) * kLaneBlock, 0.0f);
                std::fill(blk.dv_t.get(), blk.dv_t.get() + size_t(Dv) * kLaneBlock, 0.0f);
            }
            // The blocks' keys ascend, so the first block's first row is the lowest, the last one's end the highest.
            const int64_t first_row = sc.blocks[0].first_row, row_end = sc.blocks[size_t(taken - 1)].row_end;
            for (int64_t gi = 0; gi < kv.group; ++gi) {
                int64_t b[kBatchDims];
                kv.member(outer_b, gi, b);
                for (int64_t i0 = first_row; i0 < row_end; i0 += kRowChunk) {
                    const int64_t i_end = std::min<int64_t>(i0 + kRowChunk, row_end);
                    if (pair_dots) pack_row_chunk(sc, b, i0, int(i_end - i0));
                    for (int g = 0; g < taken; ++g) {
                        KeyBlock& blk = sc.blocks[size_t(g)];
                        // From an even row of the chunk, so that the packed pairs line up; rows
                        // outside [first_row, row_end) see none of the block's keys and add nothing.
                        const int64_t from = i0 + (std::max<int64_t>(0, blk.first_row - i0) & ~int64_t(1));
                        const int64_t to = std::min(i_end, blk.row_end);
                        const DqTurn turn{unit.turns, counter_base, unit.ordinal(blk.j0 / kLaneBlock, step),
                                          UnseenBlocks{a.window, a.seq_kv, kLaneBlock, unit.item % step, step,
                                                       skip_hidden}};
                        if (from < to) key_item_rows(sc, blk, b, i0, from, int(to - from), dq_buffer, turn, g == 0);
                    }
                }
            }
            // dK = scale * dK^T, dV = dV^T, transposed back into their rows.
            for (int g = 0; g < taken; ++g) {
                const KeyBlock& blk = sc.blocks[size_t(g)];
                store_transposed_rows(blk.dk_t.get(), kLaneBlock, blk.kv_rows, D, scale, args.grad_key, outer_b, blk.j0,
                                      sc.out_rows.get());
                store_transposed_rows(blk.dv_t.get(), kLaneBlock, blk.kv_rows, Dv, 1.0f, args.grad_value, outer_b,
                                      blk.j0, sc.out_rows.get());
            }
        }
    }

    void key_pass() {
        const int64_t key_blocks = (a.seq_kv + kLaneBlock - 1) / kLaneBlock;
        // (K/V batch index, split) items, split s taking key blocks s, s + dq_splits, ...,
        // the last wave in KeyBlockWave's pieces.
        const KeyBlockWave wave(kv.outer_items * dq_splits, dq_splits, key_blocks, omp_get_max_threads(),
                                dq_splits * batch_total * a.seq_q, max_piece_blocks(a));
        run_on_team(team, [&] {
            KeyScratch sc(D, Dv, d_padded, dropout.active, pair_dots, kKeyBlocksAtOnce, a.softcap > 0.0f);
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < wave.units(); ++u) {
                const KeyBlockWave::Unit unit = wave.unit(u);
                int64_t b[kBatchDims];
                kv.outer_index(unit.item / dq_splits, b);
                float* dq_buffer = dq_sum.get() + unit.item % dq_splits * dq_plane;
                key_items(sc, b, unit, dq_splits, dq_buffer);
            }  // the loop's barrier: every dQ sum is complete
            if (!dq_direct) write_dq();
        });
    }

    // dQ = the sum of the dQ buffers, times the scale on bf16 pairs (K's f32 rows carry it already, so that
    // dS K is dQ itself), into the gradient's layout and dtype; a worksharing loop
    // for the key pass's team, in the key pass's parallel region.
    void write_dq() {
        const TensorView& dq = args.grad_query;
        AlignedFloats out{size_t(D)};
#pragma omp for schedule(static)
        for (int64_t x = 0; x < batch_total * a.seq_q; ++x) {
            int64_t b[kBatchDims];
            unflatten_batch(a.batch, x / a.seq_q, b);
            const int64_t i = x % a.seq_q;
            sum_split_row(dq_sum.get() + x * d_padded, dq_plane, dq_splits, D, pair_dots ? scale : 1.0f, out.get());
            store_view_row(out.get(), D, dq, view_batch_offset(dq, b) + i * dq.strides[3]);
        }
    }

    // Floats per dQ buffer: rows of D rounded up to whole vectors.
    static int64_t dq_plane_of(const SdpaForwardArgs& a) {
        return a.batch[0] * a.batch[1] * a.batch[2] * a.seq_q * round_up(a.head_dim_qk, kLanes);
    }

    // Key blocks per piece of the last wave, at most: kKeyBlocksAtOnce, or one where later rows see more
    // keys (a causal window), since pieces of several blocks then hold unequal work.
    static int64_t max_piece_blocks(const SdpaForwardArgs& a) {
        return later_rows_see_more(a) ? 1 : kKeyBlocksAtOnce;
    }

    static KeyPassWork key_work(const SdpaForwardArgs& a, const KvGrouping& kv, int64_t dq_plane) {
        return key_pass_work(kv, a.seq_kv, kLaneBlock, later_rows_see_more(a) ? 1 : kItemsPerThread, dq_plane);
    }

    // The key pass's layout for these arguments (key_pass_text); nothing is allocated.
    static std::string describe(const SdpaBackwardArgs& backward) {
        const SdpaForwardArgs& a = backward.forward;
        const KvGrouping kv(a);
        const int64_t plane = dq_plane_of(a);
        const KeyPassWork work = key_work(a, kv, plane);
        const int64_t buffers = dq_in_place(backward, work.splits) ? 0 : work.splits * plane;
        const int64_t piece_blocks = KeyBlockWave::piece_blocks(kv.outer_items * work.splits, work.splits,
                                                                work.key_blocks, omp_get_max_threads(),
                                                                max_piece_blocks(a));
        return key_pass_text(uses_pair_dots(backward) ? "lanes_bf16_pairs" : "lanes", kLaneBlock, kv.outer_items,
                             work.splits, buffers, work.team, piece_blocks);
    }

    static Status run(const SdpaBackwardArgs& backward) {
        LaneBackward pass(backward);
        pass.row_deltas();
        pass.key_pass();
        return Status::success();
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
