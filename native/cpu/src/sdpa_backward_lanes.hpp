// FlashAttention-2 backward in f32 on the lane GEMMs of lane_gemm.hpp.
//
// P is recomputed from the forward's log-sum-exp, so nothing of size
// Sq x Skv is stored.  Three parallel passes:
//   1. D[i] = rowsum(dO[i] * O[i]) for every query row (O(B * Sq) floats).
//   2. dK and dV, parallel over (K/V batch index, key block): the keys are
//      the vector lanes, K^T and V^T are loaded once per item, and the item
//      walks every query row of every batch index that shares these K/V
//      (all heads of a GQA group), so the group reduction happens in
//      registers and no per-head dK/dV is ever materialised.
//   3. dQ, parallel over (batch index, query block): the query rows are the
//      lanes, as in the forward.
// When pass 2 has at least one item per thread without splitting the keys,
// its items take whole K/V batch indices instead and also accumulate dQ
// (dS K, in an f32 buffer of dQ's size that each item owns rows of), which
// saves pass 3's recomputation of S and dP.  With fewer than
// kItemsPerThread such items per thread, each K/V batch index is split
// further by key block (KvGrouping::key_splits), each item with a dQ
// buffer of its own, summed at the end: single items per thread
// left the threads' finishing times to chance.  Calls that skip causal
// blocks do half the work for the same buffers, and keep whole indices.
// Causal blocks that the mask removes entirely are skipped in passes 2 and 3.
// With fused dQ the last item per thread is handed out a key block at a time
// (KeyBlockWave, work_order.hpp).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>

#include "block_io.hpp"
#include "dropout.hpp"
#include "graphattn/sdpa.hpp"
#include "kv_grouping.hpp"
#include "isa_namespace.hpp"
#include "lane_gemm.hpp"
#include "lane_masks.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

template <int RV, int NT>
struct LaneBackward {
    static constexpr int kLaneBlock = RV * kLanes;  // keys (pass 2) or query rows (pass 3) per item
    static constexpr int kRowChunk = 64;           // query rows per step of pass 2
    static constexpr int kKeyBlock = 64;           // keys per step of pass 3
    static constexpr int64_t kItemsPerThread = 4;   // pass 2 items wanted per thread, fused dQ

    SdpaBackwardArgs args;  // the caller's, with Q, K, V and dO possibly redirected to f32 copies
    const SdpaForwardArgs& a;
    AlignedFloats f32_copies[4];
    int D, Dv;
    float scale;          // multiplies Q K^T
    bool skip_causal;     // causal blocks with a -inf fill can be skipped
    bool zero_unkept;
    DropoutPlan dropout;
    int64_t batch_total;
    KvGrouping kv;            // batch dims K and V ignore (their gradients sum over them)
    AlignedFloats row_delta;  // D[i] of pass 1, indexed by flat batch * Sq + i
    bool fused_dq = false;    // dQ accumulated by pass 2 (see above)
    int64_t dq_splits = 1;    // items (and dQ buffers) per K/V batch index when fused_dq
    int d_padded = 0;         // D rounded up to whole vectors: the row length of dq_sum
    int64_t dq_plane = 0;     // floats per dQ buffer
    AlignedFloats dq_sum;     // dq_splits buffers of f32 dQ / scale, rows (flat batch * Sq + i), when fused_dq
    int team = 1;             // threads of every parallel region of the call (team_for_items)

    explicit LaneBackward(const SdpaBackwardArgs& backward)
        : args(backward),
          a(args.forward),
          D(int(a.head_dim_qk)),
          Dv(int(a.head_dim_v)),
          scale(a.has_scale ? (a.scale_is_divisor ? 1.0f / a.scale : a.scale) : 1.0f),
          skip_causal(skips_causal_blocks(a)),
          zero_unkept(needs_unkept_zeroing(a)),
          dropout(a),
          batch_total(a.batch[0] * a.batch[1] * a.batch[2]),
          kv(a),
          row_delta(AlignedFloats::uninitialized(size_t(batch_total * a.seq_q))) {
        const int64_t threads = omp_get_max_threads();
        fused_dq = kv.outer_items >= threads;
        d_padded = int(round_up(D, kLanes));
        const int64_t key_blocks = (a.seq_kv + kLaneBlock - 1) / kLaneBlock;
        const int64_t query_blocks = (a.seq_q + kLaneBlock - 1) / kLaneBlock;
        team = team_for_items(std::max(kv.outer_items * key_blocks, batch_total * query_blocks));
        if (fused_dq) {
            dq_splits = kv.key_splits(threads, skip_causal ? 1 : kItemsPerThread, key_blocks);
            dq_plane = batch_total * a.seq_q * d_padded;
            dq_sum = AlignedFloats::uninitialized(size_t(dq_splits * dq_plane));
            float* sum = dq_sum.get();
            const int64_t rows = dq_splits * batch_total * a.seq_q, width = d_padded;
            run_on_team(team, [&] {
#pragma omp for schedule(static)
                for (int64_t x = 0; x < rows; ++x) std::fill(sum + x * width, sum + (x + 1) * width, 0.0f);
            });
        }
        // Every row of Q and dO is read once per key block and every row of K
        // and V once per query block: convert them to f32 once, up front.
        as_f32(args.forward.query, a.seq_q, D, f32_copies[0]);
        as_f32(args.forward.key, a.seq_kv, D, f32_copies[1]);
        as_f32(args.forward.value, a.seq_kv, Dv, f32_copies[2]);
        as_f32(args.grad_output, a.seq_q, Dv, f32_copies[3]);
    }

    // Row row0 of batch index b of Q, K, V or dO: f32 with unit column stride
    // once the constructor has run (rows are strides[3] apart).
    static const float* f32_rows(const TensorView& t, const int64_t b[kBatchDims], int64_t row0) {
        return static_cast<const float*>(t.data) + view_batch_offset(t, b) + row0 * t.strides[3];
    }

    // Redirects `t` to an f32 copy with unit column stride (broadcast batch
    // dims keep stride 0) unless it already is one.
    void as_f32(TensorView& t, int64_t rows, int cols, AlignedFloats& storage) const {
        if (t.dtype == DType::f32 && t.strides[4] == 1) return;
        int64_t strides[kBatchDims + 2] = {0, 0, 0, cols, 1};
        int64_t size = rows * cols;
        for (int d = kBatchDims - 1; d >= 0; --d) {
            if (a.batch[d] == 1 || t.strides[d] == 0) continue;
            strides[d] = size;
            size *= a.batch[d];
        }
        storage = AlignedFloats::uninitialized(size_t(size));
        float* dst = storage.get();
        const TensorView src = t;
        run_on_team(team, [&] {
#pragma omp for schedule(static)
            for (int64_t x = 0; x < batch_total * rows; ++x) {
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x / rows, b);
                const int64_t i = x % rows;
                const int64_t to = b[0] * strides[0] + b[1] * strides[1] + b[2] * strides[2] + i * cols;
                load_block(element_ptr(src.data, src.dtype, view_batch_offset(src, b) + i * src.strides[3]),
                           src.dtype, 0, src.strides[4], 1, cols, dst + to, cols, 1);
            }
        });
        t.data = dst;
        t.dtype = DType::f32;
        for (int d = 0; d < kBatchDims + 2; ++d) t.strides[d] = strides[d];
    }

    int64_t flat_batch(const int64_t b[kBatchDims]) const { return (b[0] * a.batch[1] + b[1]) * a.batch[2] + b[2]; }

    // log2-unit log-sum-exp of row i; +inf for a fully masked row (-inf), so that its P is 0.
    float lse_log2(const int64_t b[kBatchDims], int64_t i) const {
        const float lse = static_cast<const float*>(a.stats.data)[view_batch_offset(a.stats, b) + i * a.stats.strides[3]];
        return lse == -__builtin_inff() ? __builtin_inff() : lse * kLog2e;
    }

    // ---- pass 1 --------------------------------------------------------------------------
    void row_deltas() {
        const int64_t rows = batch_total * a.seq_q;
        run_on_team(team, [&] {
            AlignedFloats o_row{size_t(Dv)}, do_row{size_t(Dv)};
#pragma omp for schedule(static)
            for (int64_t x = 0; x < rows; ++x) {
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x / a.seq_q, b);
                const int64_t i = x % a.seq_q;
                const TensorView &o = a.output, &g = args.grad_output;
                load_block(element_ptr(o.data, o.dtype, view_batch_offset(o, b) + i * o.strides[3]), o.dtype, 0,
                           o.strides[4], 1, Dv, o_row.get(), Dv, 1);
                load_block(element_ptr(g.data, g.dtype, view_batch_offset(g, b) + i * g.strides[3]), g.dtype, 0,
                           g.strides[4], 1, Dv, do_row.get(), Dv, 1);
                row_delta.get()[x] = dot(o_row.get(), do_row.get(), Dv);
            }
        });
    }

    // ---- pass 2: dK, dV with keys as lanes -------------------------------------------------
    struct KeyScratch {
        AlignedFloats k_t, v_t, dk_t, dv_t, s, dp, mask_rows, out_rows, z, k_rows;
        float lse[kRowChunk], delta[kRowChunk];
        uint64_t drop_base[kRowChunk];
        uint8_t keep[kLaneBlock];
        int64_t m_off[kRowChunk], dm_off[kRowChunk], qi[kRowChunk];
        KeyScratch(int D, int Dv, int d_padded)
            : k_t(size_t(D) * kLaneBlock),
              v_t(size_t(Dv) * kLaneBlock),
              dk_t(size_t(D) * kLaneBlock),
              dv_t(size_t(Dv) * kLaneBlock),
              s(size_t(kRowChunk) * kLaneBlock),
              dp(size_t(kRowChunk) * kLaneBlock),
              mask_rows(size_t(kRowChunk) * kLaneBlock),
              out_rows(size_t(kTransposedRowsAtOnce) * std::max(D, Dv)),
              z(size_t(kRowChunk) * kLaneBlock),
              k_rows(size_t(kLaneBlock) * d_padded) {}
    };

    // Rows i0 .. i0 + rows of batch index b against the item's keys.
    void key_item_rows(KeyScratch& sc, const int64_t b[kBatchDims], int64_t i0, int rows, int64_t j0, int kv_rows,
                       float* dq_buffer, std::mutex* dq_lock) {
        const int64_t fb = flat_batch(b);
        const float* q_rows = f32_rows(a.query, b, i0);
        const float* do_rows = f32_rows(args.grad_output, b, i0);
        const int64_t q_stride = a.query.strides[3], do_stride = args.grad_output.strides[3];
        for (int r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            sc.lse[r] = lse_log2(b, i);
            sc.delta[r] = row_delta.get()[fb * a.seq_q + i];
            sc.qi[r] = i;
            sc.m_off[r] = view_batch_offset(a.mask, b) + i * a.mask.strides[3];
            sc.dm_off[r] = view_batch_offset(args.grad_mask, b) + i * args.grad_mask.strides[3];
            sc.drop_base[r] = dropout.row_base(fb, i);
        }
        float* s = sc.s.get();
        float* dp = sc.dp.get();
        // S (log2 units, K^T carries scale * log2 e), masked; then P = 2^(S - lse).
        lane_gemm<RV, NT, false>(sc.k_t.get(), D, q_rows, q_stride, 1, rows, s);
        mask_key_lanes<RV>(a, s, sc.mask_rows.get(), sc.m_off, sc.qi, rows, kv_rows, j0);
        for (int r = 0; r < rows; ++r)
            for (int v = 0; v < RV; ++v) store(s + r * kLaneBlock + v * kLanes, vexp2(load(s + r * kLaneBlock + v * kLanes) - sc.lse[r]));
        // dP = dO V^T (through the dropout mask Z when there is one), then dS = P (dP - D).
        lane_gemm<RV, NT, false>(sc.v_t.get(), Dv, do_rows, do_stride, 1, rows, dp);
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
        if (dropout.active)  // dV takes the dropped probabilities
            for (int r = 0; r < rows; ++r)
                for (int v = 0; v < RV; ++v) {
                    float* x = s + r * kLaneBlock + v * kLanes;
                    store(x, load(x) * load(z + r * kLaneBlock + v * kLanes));
                }
        // dV^T += P^T dO and dK^T += dS^T Q (the scale is applied once, at the end).
        lane_gemm<RV, NT, true>(s, rows, do_rows, 1, do_stride, Dv, sc.dv_t.get());
        lane_gemm<RV, NT, true>(dp, rows, q_rows, 1, q_stride, D, sc.dk_t.get());
        // dQ rows += dS K (K rows padded with zeros to d_padded); pieces of one item take turns.
        std::unique_lock<std::mutex> hold;
        if (dq_lock) hold = std::unique_lock<std::mutex>(*dq_lock);
        if (dq_buffer)
            lane_gemm_wide<RV, NT, true>(sc.k_rows.get(), d_padded, kv_rows, dp, kLaneBlock, 1, rows,
                                         dq_buffer + (fb * a.seq_q + i0) * d_padded, d_padded, d_padded);
    }

    // Key block j0 of K/V batch index outer_b; dq_buffer (fused dQ) receives dS K.
    void key_item(KeyScratch& sc, const int64_t outer_b[kBatchDims], int64_t j0, float* dq_buffer,
                  std::mutex* dq_lock = nullptr) {
        const int kv_rows = int(std::min<int64_t>(kLaneBlock, a.seq_kv - j0));
        const TensorView &k = a.key, &v = a.value;
        // K^T and V^T, lanes past kv_rows zero; K^T carries scale * log2(e).
        float* k_t = sc.k_t.get();
        float* v_t = sc.v_t.get();
        load_rows_transposed(k, view_batch_offset(k, outer_b), j0, kv_rows, D, k_t, kLaneBlock);
        load_rows_transposed(v, view_batch_offset(v, outer_b), j0, kv_rows, Dv, v_t, kLaneBlock);
        for (int x = 0; x < D * kLaneBlock; x += kLanes) store(k_t + x, load(k_t + x) * (scale * kLog2e));
        if (fused_dq)  // rows past kv_rows keep finite old values: their dS is 0
            load_block(element_ptr(k.data, k.dtype, view_batch_offset(k, outer_b) + j0 * k.strides[3]), k.dtype,
                       k.strides[3], k.strides[4], kv_rows, D, sc.k_rows.get(), d_padded, 1);
        std::fill(sc.dk_t.get(), sc.dk_t.get() + size_t(D) * kLaneBlock, 0.0f);
        std::fill(sc.dv_t.get(), sc.dv_t.get() + size_t(Dv) * kLaneBlock, 0.0f);

        // Query rows before first_row see none of these keys through the causal mask.
        const int64_t first_row = skip_causal ? std::max<int64_t>(0, j0 - a.causal_offset) : 0;
        for (int64_t gi = 0; gi < kv.group; ++gi) {
            int64_t b[kBatchDims];
            kv.member(outer_b, gi, b);
            for (int64_t i0 = first_row; i0 < a.seq_q; i0 += kRowChunk)
                key_item_rows(sc, b, i0, int(std::min<int64_t>(kRowChunk, a.seq_q - i0)), j0, kv_rows, dq_buffer,
                              dq_lock);
        }

        // dK = scale * dK^T, dV = dV^T, transposed back into their rows.
        store_transposed_rows(sc.dk_t.get(), kLaneBlock, kv_rows, D, scale, args.grad_key, outer_b, j0, sc.out_rows.get());
        store_transposed_rows(sc.dv_t.get(), kLaneBlock, kv_rows, Dv, 1.0f, args.grad_value, outer_b, j0, sc.out_rows.get());
    }

    void key_pass() {
        const int64_t key_blocks = (a.seq_kv + kLaneBlock - 1) / kLaneBlock;
        // Fused dQ: (K/V batch index, split) items, split s taking key blocks
        // s, s + dq_splits, ...; else (index, key block) items.
        const int64_t items = kv.outer_items * (fused_dq ? dq_splits : key_blocks);
        const bool by_rank = longest_first(skip_causal, items, omp_get_max_threads());
        // Fused dQ: KeyBlockWave's pieces.  16-core Xeon, in-process A/B against whole items: 1.06-1.12x
        // at (1,16,1024,64), (1,16,2048,128) and (4,32,512,64), 0.99-1.02x elsewhere; this machine
        // 1.00-1.08x.
        const KeyBlockWave fused(fused_dq ? items : 0, dq_splits, key_blocks, omp_get_max_threads());
        run_on_team(team, [&] {
            KeyScratch sc(D, Dv, d_padded);
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < (fused_dq ? fused.units() : items); ++u) {
                int64_t b[kBatchDims];
                if (fused_dq) {
                    const KeyBlockWave::Unit unit = fused.unit(u);
                    kv.outer_index(unit.item / dq_splits, b);
                    float* dq_buffer = dq_sum.get() + unit.item % dq_splits * dq_plane;
                    for (int64_t kb = unit.first; kb < unit.end; kb += dq_splits)
                        key_item(sc, b, kb * kLaneBlock, dq_buffer, unit.lock);
                    continue;
                }
                // Causal: the first key blocks are seen by the most query rows.
                const WorkItem x = work_item(u, kv.outer_items, key_blocks, by_rank);
                kv.outer_index(x.batch, b);
                key_item(sc, b, x.rank * kLaneBlock, nullptr);
            }
        });
        if (fused_dq) write_fused_dq();
    }

    // dQ = scale * (the sum of the dQ buffers), into the gradient's layout and dtype.
    void write_fused_dq() {
        const TensorView& dq = args.grad_query;
        run_on_team(team, [&] {
            AlignedFloats out{size_t(D)};
#pragma omp for schedule(static)
            for (int64_t x = 0; x < batch_total * a.seq_q; ++x) {
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x / a.seq_q, b);
                const int64_t i = x % a.seq_q;
                sum_split_row(dq_sum.get() + x * d_padded, dq_plane, dq_splits, D, scale, out.get());
                store_view_row(out.get(), D, dq, view_batch_offset(dq, b) + i * dq.strides[3]);
            }
        });
    }

    // ---- pass 3: dQ with query rows as lanes ---------------------------------------------
    struct QueryScratch {
        AlignedFloats q_t, do_t, dq_t, s_t, dp_t, mask_t, query_index, lse, delta, out_rows, z_t;
        int64_t m_off[kLaneBlock];
        uint64_t drop_base[kLaneBlock];
        uint8_t keep[kKeyBlock];
        QueryScratch(int D, int Dv)
            : q_t(size_t(D) * kLaneBlock),
              do_t(size_t(Dv) * kLaneBlock),
              dq_t(size_t(D) * kLaneBlock),
              s_t(size_t(kKeyBlock) * kLaneBlock),
              dp_t(size_t(kKeyBlock) * kLaneBlock),
              mask_t(size_t(kKeyBlock) * kLaneBlock),
              query_index(kLaneBlock),
              lse(kLaneBlock),
              delta(kLaneBlock),
              out_rows(size_t(kTransposedRowsAtOnce) * D),
              z_t(size_t(kKeyBlock) * kLaneBlock) {}
    };

    void query_item(QueryScratch& sc, const int64_t b[kBatchDims], int64_t i0) {
        const int rows = int(std::min<int64_t>(kLaneBlock, a.seq_q - i0));
        const TensorView &q = a.query, &g = args.grad_output, &k = a.key, &v = a.value;
        float* q_t = sc.q_t.get();
        float* do_t = sc.do_t.get();
        load_rows_transposed(q, view_batch_offset(q, b), i0, rows, D, q_t, kLaneBlock);
        load_rows_transposed(g, view_batch_offset(g, b), i0, rows, Dv, do_t, kLaneBlock);
        for (int x = 0; x < D * kLaneBlock; x += kLanes) store(q_t + x, load(q_t + x) * (scale * kLog2e));
        std::fill(sc.dq_t.get(), sc.dq_t.get() + size_t(D) * kLaneBlock, 0.0f);
        const int64_t fb = flat_batch(b);
        for (int r = 0; r < kLaneBlock; ++r) {
            const int64_t i = i0 + std::min(r, rows - 1);  // padding lanes repeat the last row
            sc.query_index.get()[r] = float(i);
            sc.lse.get()[r] = r < rows ? lse_log2(b, i) : __builtin_inff();
            sc.delta.get()[r] = r < rows ? row_delta.get()[fb * a.seq_q + i] : 0.0f;
            sc.m_off[r] = view_batch_offset(a.mask, b) + i * a.mask.strides[3];
            sc.drop_base[r] = dropout.row_base(fb, i);
        }

        const int64_t key_end = skip_causal ? causal_key_end(i0 + rows - 1, a.causal_offset, a.seq_kv) : a.seq_kv;
        float* s_t = sc.s_t.get();
        float* dp_t = sc.dp_t.get();
        for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
            const int kv_rows = int(std::min<int64_t>(kKeyBlock, key_end - j0));
            const float* k_rows = f32_rows(k, b, j0);
            const float* v_rows = f32_rows(v, b, j0);
            const int64_t k_stride = k.strides[3], v_stride = v.strides[3];
            lane_gemm<RV, NT, false>(q_t, D, k_rows, k_stride, 1, kv_rows, s_t);
            mask_query_lanes<RV>(a, s_t, sc.mask_t.get(), sc.m_off, sc.query_index.get(), rows, kv_rows, j0);
            lane_gemm<RV, NT, false>(do_t, Dv, v_rows, v_stride, 1, kv_rows, dp_t);
            if (dropout.active) {
                float* z_t = sc.z_t.get();
                for (int r = 0; r < rows; ++r)
                    dropout.multipliers(sc.drop_base[r], j0, kv_rows, z_t + r, kLaneBlock, sc.keep);
                multiply_in_place(dp_t, z_t, size_t(kv_rows) * kLaneBlock);
            }
            for (int j = 0; j < kv_rows; ++j)
                for (int v = 0; v < RV; ++v) {
                    const VecF p = vexp2(load(s_t + j * kLaneBlock + v * kLanes) - load(sc.lse.get() + v * kLanes));
                    float* x = dp_t + j * kLaneBlock + v * kLanes;
                    store(x, p * (load(x) - load(sc.delta.get() + v * kLanes)));
                }
            if (zero_unkept) zero_unkept_query_lanes<RV>(a, dp_t, sc.mask_t.get(), sc.query_index.get(), kv_rows, j0);
            lane_gemm<RV, NT, true>(dp_t, kv_rows, k_rows, 1, k_stride, D, sc.dq_t.get());
        }

        store_transposed_rows(sc.dq_t.get(), kLaneBlock, rows, D, scale, args.grad_query, b, i0, sc.out_rows.get());
    }

    void query_pass() {
        const int64_t query_blocks = (a.seq_q + kLaneBlock - 1) / kLaneBlock;
        const int64_t items = batch_total * query_blocks;
        const bool by_rank = longest_first(skip_causal, items, omp_get_max_threads());
        run_on_team(team, [&] {
            QueryScratch sc(D, Dv);
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < items; ++w) {
                const WorkItem x = work_item(w, batch_total, query_blocks, by_rank);
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x.batch, b);
                query_item(sc, b, (skip_causal ? query_blocks - 1 - x.rank : x.rank) * kLaneBlock);
            }
        });
    }

    static Status run(const SdpaBackwardArgs& backward) {
        LaneBackward pass(backward);
        pass.row_deltas();
        pass.key_pass();
        if (!pass.fused_dq) pass.query_pass();
        return Status::success();
    }
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
