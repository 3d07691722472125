// FlashAttention-2 backward on AMX tiles for bf16 Q/K/V/dO, and for f16 ones
// split into bf16 parts (amx_split.hpp) (flags set in CMakeLists.txt; chosen
// by dispatch.cpp where the CPU has AMX-BF16 and both sequences are long
// enough for its blocks).  With split inputs every operand is kept as planes of
// its parts, P and dS included, and each product runs over every kept part
// product (tiles_2x2_split_product).
//
// First Q and dO are copied once into tile-friendly bf16 layouts (rows padded
// to whole tiles, and transposed), and D = rowsum(dO * O) is computed.  Each
// work item then owns one K/V batch index (all query heads of a GQA group)
// and walks its key blocks; per block of 64 keys and chunk of 64 query rows:
//   S = Q K^T and dP = dO V^T on tiles (K^T, V^T packed once per key block),
//   P = 2^(S - lse) and dS = P (dP Z - D) in AVX-512 (Z: dropout multipliers),
//   dV^T += dO^T (P Z), dK^T += Q^T dS and dQ += dS K on tiles.
// dK/dV leave each key block in K's and V's layout; dQ is summed in an f32
// buffer whose rows belong to one item, and written at the end.  With fewer
// K/V batch indices than threads, each index's key blocks are split among a
// few items, each summing dQ into a buffer of its own.  The last item per
// thread is handed out a key block at a time (KeyBlockWave, work_order.hpp).
#define GRAPHATTN_ISA_NS isa_amx
#define GRAPHATTN_LANES 16

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_packing.hpp"
#include "amx_split.hpp"
#include "amx_tiles.hpp"
#include "block_io.hpp"
#include "dropout.hpp"
#include "isa_entry_points.hpp"
#include "kv_grouping.hpp"
#include "kv_reader.hpp"
#include "lane_masks.hpp"
#include "scratch.hpp"
#include "simd.hpp"
#include "work_order.hpp"

namespace graphattn {
namespace isa_amx {
namespace {

constexpr int kKeys = 64;   // keys per block: the columns of S, dP and the dK^T/dV^T accumulators
constexpr int kRows = 64;   // query rows per chunk: four 16-row tile bands (dK/dV tiles reduce over 64 rows per load)
constexpr int kKeyVecs = kKeys / kLanes;

// bf16 storage in 64-byte aligned float buffers.
uint16_t* bf16s(AlignedFloats& a) { return reinterpret_cast<uint16_t*>(a.get()); }
uint32_t* pairs(AlignedFloats& a) { return reinterpret_cast<uint32_t*>(a.get()); }

// The bf16 parts of `count` (a multiple of 32) f32 values: part p to dst + p * plane.
// Inputs (not P and dS, which are finite or NaN anyway) pass `infinite`, which
// gathers the lanes that held an infinity (split parts cannot keep one).
template <int Parts>
void store_parts_row(const float* src, int count, uint16_t* dst, int64_t plane, __mmask16* infinite = nullptr) {
    __m512i parts[Parts];
    for (int c = 0; c < count; c += 32) {
        const __m512 lo = _mm512_loadu_ps(src + c), hi = _mm512_loadu_ps(src + c + 16);
        if (Parts > 1 && infinite) *infinite |= _mm512_fpclass_ps_mask(lo, 0x18) | _mm512_fpclass_ps_mask(hi, 0x18);
        split_32<Parts>(lo, hi, parts);
        for (int p = 0; p < Parts; ++p) _mm512_storeu_si512(dst + p * plane + c, parts[p]);
    }
}

template <int Parts>
struct Backward {
    const SdpaBackwardArgs& args;
    const SdpaForwardArgs& a;
    int D, Dv, Dp, Dvp;
    int64_t Sq, Skv, Sqp, batch_total;
    int64_t cols_ld;  // row stride of the transposed Q and dO: Sqp plus a cache line, so a tile's rows spread over L1 sets
    float scale, scale_log2;
    bool skip_hidden, zero_unkept;  // skip_hidden: key blocks and row chunks no row sees are skipped
    DropoutPlan dropout;
    KvGrouping kv;            // batch dims K and V ignore (their gradients sum over them)
    int64_t key_blocks = 0, splits = 1;
    int team = 1;  // threads of both parallel regions (team_for_items)
    // Per flat batch index: Q and dO as padded bf16 rows and transposed (one
    // plane per part, the *_plane words apart), D, lse in base 2.
    AlignedFloats q_rows, q_cols, do_rows, do_cols, delta, lse2, dq_sum;
    int64_t q_rows_plane = 0, q_cols_plane = 0, do_rows_plane = 0, do_cols_plane = 0;
    std::atomic<bool> saw_infinity{false};

    explicit Backward(const SdpaBackwardArgs& b)
        : args(b),
          a(b.forward),
          D(int(a.head_dim_qk)),
          Dv(int(a.head_dim_v)),
          Dp(int(round_up(D, kTileBf16Cols))),
          Dvp(int(round_up(Dv, kTileBf16Cols))),
          Sq(a.seq_q),
          Skv(a.seq_kv),
          Sqp(round_up(a.seq_q, kRows)),
          batch_total(a.batch[0] * a.batch[1] * a.batch[2]),
          cols_ld(Sqp + 32),
          scale(score_scale(a)),
          scale_log2(scale * kLog2e),
          skip_hidden(skips_hidden_blocks(a) && !b.grad_mask.data),  // dS of every score is written
          zero_unkept(needs_unkept_zeroing(a)),
          dropout(a),
          kv(a) {
        const KeyPassWork work = key_work(a, kv);
        key_blocks = work.key_blocks;
        splits = work.splits;
        team = work.team;
    }

    // Key splits for one item per thread (four per thread, as the lane
    // backward wants, was no steady gain here).
    static KeyPassWork key_work(const SdpaForwardArgs& a, const KvGrouping& kv) {
        return key_pass_work(kv, a.seq_kv, kKeys, 1, dq_plane_of(a));
    }

    // Floats per dQ buffer: rows padded to whole row chunks, D to whole tile columns.
    static int64_t dq_plane_of(const SdpaForwardArgs& a) {
        const int64_t batch = a.batch[0] * a.batch[1] * a.batch[2];
        return batch * round_up(a.seq_q, kRows) * round_up(a.head_dim_qk, kTileBf16Cols);
    }

    int64_t flat(const int64_t b[kBatchDims]) const { return (b[0] * a.batch[1] + b[1]) * a.batch[2] + b[2]; }

    // ---- preparation: tile layouts of Q and dO, D and lse ------------------------------
    void prepare() {
        q_rows_plane = round_up(batch_total * Sqp * Dp, 32);
        q_cols_plane = round_up(batch_total * Dp * cols_ld, 32);
        do_rows_plane = round_up(batch_total * Sqp * Dvp, 32);
        do_cols_plane = round_up(batch_total * Dvp * cols_ld, 32);
        q_rows = AlignedFloats::uninitialized(size_t(Parts * q_rows_plane) / 2 + 16);
        q_cols = AlignedFloats::uninitialized(size_t(Parts * q_cols_plane) / 2 + 16);
        do_rows = AlignedFloats::uninitialized(size_t(Parts * do_rows_plane) / 2 + 16);
        do_cols = AlignedFloats::uninitialized(size_t(Parts * do_cols_plane) / 2 + 16);
        delta = AlignedFloats::uninitialized(size_t(batch_total) * Sqp);
        lse2 = AlignedFloats::uninitialized(size_t(batch_total) * Sqp);
        dq_sum = AlignedFloats::uninitialized(size_t(splits) * batch_total * Sqp * Dp);
        run_on_team(team, [&] {
            AlignedFloats row{size_t(std::max(Dp, Dvp))}, o_row{size_t(Dvp)};
            __mmask16 infinite = 0;
#pragma omp for schedule(static)
            for (int64_t x = 0; x < batch_total * Sqp; ++x) {
                const int64_t fb = x / Sqp, i = x % Sqp;
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, fb, b);
                for (int64_t split = 0; split < splits; ++split) {
                    float* sum = dq_sum.get() + (split * batch_total * Sqp + x) * Dp;
                    std::fill(sum, sum + Dp, 0.0f);
                }
                const bool real = i < Sq;
                // Q row, padded with zeros (rows past Sq are all zero).
                std::fill(row.get(), row.get() + Dp, 0.0f);
                if (real) load_row(a.query, b, i, D, row.get());
                store_parts_row<Parts>(row.get(), Dp, bf16s(q_rows) + x * Dp, q_rows_plane, &infinite);
                for (int p = 0; p < Parts; ++p)
                    for (int d = 0; d < Dp; ++d)
                        bf16s(q_cols)[p * q_cols_plane + (fb * Dp + d) * cols_ld + i] =
                            bf16s(q_rows)[p * q_rows_plane + x * Dp + d];
                // dO row, and D = dO . O.
                std::fill(row.get(), row.get() + Dvp, 0.0f);
                float row_dot = 0.0f;
                if (real) {
                    load_row(args.grad_output, b, i, Dv, row.get());
                    load_row(a.output, b, i, Dv, o_row.get());
                    row_dot = dot(row.get(), o_row.get(), Dv);
                }
                store_parts_row<Parts>(row.get(), Dvp, bf16s(do_rows) + x * Dvp, do_rows_plane, &infinite);
                for (int p = 0; p < Parts; ++p)
                    for (int c = 0; c < Dvp; ++c)
                        bf16s(do_cols)[p * do_cols_plane + (fb * Dvp + c) * cols_ld + i] =
                            bf16s(do_rows)[p * do_rows_plane + x * Dvp + c];
                delta.get()[x] = row_dot;
                // lse in base 2; +inf (P = 0) for a fully masked row and for padding rows.
                float lse = __builtin_inff();
                if (real) {
                    const float l = static_cast<const float*>(a.stats.data)[view_batch_offset(a.stats, b) + i * a.stats.strides[3]];
                    lse = l == -__builtin_inff() ? __builtin_inff() : l * kLog2e;
                }
                lse2.get()[x] = lse;
            }
            if (infinite) saw_infinity.store(true, std::memory_order_relaxed);
        });
    }

    static void load_row(const TensorView& t, const int64_t b[kBatchDims], int64_t i, int cols, float* dst) {
        load_block(element_ptr(t.data, t.dtype, view_batch_offset(t, b) + i * t.strides[3]), t.dtype, 0, t.strides[4], 1,
                   cols, dst, cols, 1);
    }

    // ---- per thread ------------------------------------------------------------------------
    // Per thread; the packed and bf16 buffers hold one plane per part, each of
    // the sizes below (in 32-bit words: k_cols_plane, ...).
    struct Scratch {
        int64_t k_cols_plane, v_cols_plane, k_pairs_plane;
        static constexpr int64_t kChunkPlane = int64_t(kRows) * kKeys / 2;  // P, dS: bf16 rows or pairs
        AlignedFloats k_cols, v_cols, k_pairs, dk_t, dv_t, s, dp, mask_rows, z, p_bf16, ds_bf16, p_pairs, ds_pairs,
            out_rows, kv_wide, kv_parts, cap_grad;
        KvStage kv_stage;  // a K or V block where its layout keeps the rows apart (kv_reader.hpp)
        int64_t m_off[kRows], dm_off[kRows], qi[kRows];
        uint8_t keep[kKeys];
        __mmask16 infinite = 0;
        // capped: the call has a softcap, whose derivative per score cap_grad keeps.
        Scratch(int Dp, int Dvp, bool capped)
            : k_cols_plane(int64_t(Dp / 2) * kKeys),
              v_cols_plane(int64_t(Dvp / 2) * kKeys),
              k_pairs_plane(int64_t(kKeys / 2) * Dp),
              k_cols(size_t(Parts * k_cols_plane)),
              v_cols(size_t(Parts * v_cols_plane)),
              k_pairs(size_t(Parts * k_pairs_plane)),
              dk_t(size_t(Dp) * kKeys),
              dv_t(size_t(Dvp) * kKeys),
              s(size_t(kRows) * kKeys),
              dp(size_t(kRows) * kKeys),
              mask_rows(size_t(kRows) * kKeys),
              z(size_t(kRows) * kKeys),
              p_bf16(size_t(Parts * kChunkPlane)),
              ds_bf16(size_t(Parts * kChunkPlane)),
              p_pairs(size_t(Parts * kChunkPlane)),
              ds_pairs(size_t(Parts * kChunkPlane)),
              out_rows(size_t(kTransposedRowsAtOnce) * std::max(Dp, Dvp)),
              kv_wide(Parts > 1 ? size_t(kKeys) * std::max(Dp, Dvp) : 0),
              kv_parts(Parts > 1 ? size_t(Parts) * kKeys * std::max(Dp, Dvp) / 2 : 0),
              cap_grad(capped ? size_t(kRows) * kKeys : 0) {}
    };

    // C (rows x kKeys, f32) = A (rows padded, bf16, `cols` per row) x packed^T, for one chunk;
    // the parts of A are a_plane words apart, those of packed packed_plane.
    static void chunk_times_packed(const uint16_t* a_rows, int64_t a_plane, int cols, const uint32_t* packed,
                                   int64_t packed_plane, float* c) {
        for (int m = 0; m < kRows / 16; m += 2)
            for (int n = 0; n < kKeys / 16; n += 2) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                tiles_2x2_split_product<Parts>(a_rows + (m * 16) * cols, cols * 2, 16 * cols, a_plane, packed + n * 16,
                                               kKeys * 4, packed_plane, cols / kTileBf16Cols);
                store_tiles_2x2(c + (m * 16) * kKeys + n * 16, kKeys * 4);
            }
    }

    // acc_t (rows x kKeys, f32) += columns [i0, i0 + kRows) of a_cols (rows cols_ld apart, bf16) x row pairs.
    void accumulate_transposed(const uint16_t* a_cols, int64_t a_plane, int rows, int64_t i0, const uint32_t* row_pairs,
                               float* acc_t) {
        for (int m = 0; m < rows / 16; m += 2)
            for (int n = 0; n < kKeys / 16; n += 2) {
                float* c = acc_t + (m * 16) * kKeys + n * 16;
                load_tiles_2x2(c, kKeys * 4);
                tiles_2x2_split_product<Parts>(a_cols + (m * 16) * cols_ld + i0, cols_ld * 2, 16 * cols_ld, a_plane,
                                               row_pairs + n * 16, kKeys * 4, Scratch::kChunkPlane,
                                               kRows / kTileBf16Cols);
                store_tiles_2x2(c, kKeys * 4);
            }
    }

    void chunk(Scratch& sc, const int64_t b[kBatchDims], int64_t i0, int64_t j0, int kv_rows, float* dq_split,
               const DqTurn& turn) {
        const int64_t fb = flat(b);
        const int rows = int(std::min<int64_t>(kRows, Sq - i0));
        for (int r = 0; r < rows; ++r) {
            sc.qi[r] = i0 + r;
            sc.m_off[r] = view_batch_offset(a.mask, b) + (i0 + r) * a.mask.strides[3];
            sc.dm_off[r] = view_batch_offset(args.grad_mask, b) + (i0 + r) * args.grad_mask.strides[3];
        }
        float* s = sc.s.get();
        float* dp = sc.dp.get();
        chunk_times_packed(bf16s(q_rows) + (fb * Sqp + i0) * Dp, q_rows_plane, Dp, pairs(sc.k_cols), sc.k_cols_plane, s);
        chunk_times_packed(bf16s(do_rows) + (fb * Sqp + i0) * Dvp, do_rows_plane, Dvp, pairs(sc.v_cols), sc.v_cols_plane,
                           dp);

        // P = 2^(S scale log2(e) - lse) and dS = P (dP Z - D), row by row.
        for (int x = 0; x < kRows * kKeys; x += kLanes) store(s + x, load(s + x) * scale_log2);
        float* cap_grad = a.softcap > 0.0f ? sc.cap_grad.get() : nullptr;
        mask_key_lanes<kKeyVecs>(a, s, sc.mask_rows.get(), sc.m_off, sc.qi, rows, kv_rows, j0,
                                 KeyLaneMods{slope_log2(a, b), cap_grad});
        float* z = sc.z.get();
        if (dropout.active)
            for (int r = 0; r < rows; ++r)
                dropout.multipliers(dropout.row_base(fb, i0 + r), j0, kKeys, z + r * kKeys, 1, sc.keep);
        for (int r = 0; r < kRows; ++r) {
            const float lse = lse2.get()[fb * Sqp + i0 + r], d = delta.get()[fb * Sqp + i0 + r];
            for (int v = 0; v < kKeyVecs; ++v) {
                const int x = r * kKeys + v * kLanes;
                const VecF p = r < rows ? vexp2(load(s + x) - lse) : VecF{};
                const VecF zv = dropout.active && r < rows ? load(z + x) : splat(1.0f);
                store(dp + x, p * (load(dp + x) * zv - d));
                store(s + x, p * zv);  // the dropped probabilities, for dV
            }
        }
        if (args.grad_mask.data) {
            float* dmask = static_cast<float*>(const_cast<void*>(args.grad_mask.data));
            for (int r = 0; r < rows; ++r)
                for (int l = 0; l < kv_rows; ++l) dmask[sc.dm_off[r] + (j0 + l) * args.grad_mask.strides[4]] = dp[r * kKeys + l];
        }
        if (zero_unkept) zero_unkept_key_lanes<kKeyVecs>(a, dp, sc.mask_rows.get(), sc.qi, rows, j0);
        if (cap_grad) multiply_in_place(dp, cap_grad, size_t(rows) * kKeys);  // dS through the softcap
        // P and dS as bf16 (parts), each plane as rows and as row pairs.
        constexpr int64_t chunk_words = 2 * Scratch::kChunkPlane;  // a plane of bf16 rows, in bf16 words
        for (int r = 0; r < kRows; ++r) {
            store_parts_row<Parts>(s + r * kKeys, kKeys, bf16s(sc.p_bf16) + r * kKeys, chunk_words);
            store_parts_row<Parts>(dp + r * kKeys, kKeys, bf16s(sc.ds_bf16) + r * kKeys, chunk_words);
        }
        for (int p = 0; p < Parts; ++p) {
            pack_row_pairs({bf16s(sc.p_bf16) + p * chunk_words, kKeys, 1, kRows, kKeys}, kRows, kKeys,
                           pairs(sc.p_pairs) + p * Scratch::kChunkPlane, kKeys);
            pack_row_pairs({bf16s(sc.ds_bf16) + p * chunk_words, kKeys, 1, kRows, kKeys}, kRows, kKeys,
                           pairs(sc.ds_pairs) + p * Scratch::kChunkPlane, kKeys);
        }

        // dV^T += dO^T (P Z), dK^T += Q^T dS, dQ += dS K.
        accumulate_transposed(bf16s(do_cols) + fb * Dvp * cols_ld, do_cols_plane, Dvp, i0, pairs(sc.p_pairs),
                              sc.dv_t.get());
        accumulate_transposed(bf16s(q_cols) + fb * Dp * cols_ld, q_cols_plane, Dp, i0, pairs(sc.ds_pairs), sc.dk_t.get());
        float* dq = dq_split + (fb * Sqp + i0) * Dp;
        // Pieces of one item add in their blocks' order (DqTurns), a chunk's rows counted from its first.
        if (!turn.begin(fb * Sqp + i0, kRows, i0, 0)) return;
        for (int m = 0; m < kRows / 16; m += 2)
            for (int n = 0; n < Dp / 16; n += 2) {
                float* acc = dq + (m * 16) * Dp + n * 16;
                load_tiles_2x2(acc, Dp * 4);
                tiles_2x2_split_product<Parts>(bf16s(sc.ds_bf16) + (m * 16) * kKeys, kKeys * 2, 16 * kKeys, chunk_words,
                                               pairs(sc.k_pairs) + n * 16, Dp * 4, sc.k_pairs_plane,
                                               kKeys / kTileBf16Cols);
                store_tiles_2x2(acc, Dp * 4);
            }
        turn.end(fb * Sqp + i0, kRows, i0, 0);
    }

    // Rows j0 .. j0 + kv_rows of K or V (cols wide) as the packings' inputs,
    // one block per part: the bf16 rows in place (Parts = 1), or their parts
    // as kKeys x padded planes in sc.kv_parts (zeros past cols), which the
    // next call overwrites.
    void kv_part_blocks(Scratch& sc, const KvReader& t, const int64_t b[kBatchDims], int64_t j0, int kv_rows,
                        int cols, int padded, Bf16Block blocks[Parts]) {
        const int64_t base = t.batch_offset(b);
        if constexpr (Parts == 1) {
            (void)sc, (void)padded;
            const RowBlock in = t.block(base, j0, kv_rows, sc.kv_stage);
            blocks[0] = {in.words(), in.row_stride, in.col_stride, kv_rows, cols};
        } else {
            float* wide = sc.kv_wide.get();
            uint16_t* planes = bf16s(sc.kv_parts);
            const int64_t plane = int64_t(kKeys) * padded;
            std::fill(wide, wide + size_t(kv_rows) * padded, 0.0f);
            t.load_f32(base, j0, kv_rows, cols, wide, padded);
            for (int r = 0; r < kv_rows; ++r)
                store_parts_row<Parts>(wide + r * padded, padded, planes + r * padded, plane, &sc.infinite);
            for (int p = 0; p < Parts; ++p) blocks[p] = {planes + p * plane, padded, 1, kv_rows, cols};
        }
    }

    void key_block(Scratch& sc, const int64_t outer_b[kBatchDims], int64_t j0, float* dq_split,
                   const DqTurn& turn) {
        const int kv_rows = int(std::min<int64_t>(kKeys, Skv - j0));
        Bf16Block blocks[Parts];
        kv_part_blocks(sc, KvReader(a.key), outer_b, j0, kv_rows, D, Dp, blocks);
        for (int p = 0; p < Parts; ++p) {
            pack_column_pairs(blocks[p], kKeys, Dp, pairs(sc.k_cols) + p * sc.k_cols_plane, kKeys);
            pack_row_pairs(blocks[p], kKeys, Dp, pairs(sc.k_pairs) + p * sc.k_pairs_plane, Dp);
        }
        kv_part_blocks(sc, KvReader(a.value), outer_b, j0, kv_rows, Dv, Dvp, blocks);
        for (int p = 0; p < Parts; ++p)
            pack_column_pairs(blocks[p], kKeys, Dvp, pairs(sc.v_cols) + p * sc.v_cols_plane, kKeys);
        std::fill(sc.dk_t.get(), sc.dk_t.get() + size_t(Dp) * kKeys, 0.0f);
        std::fill(sc.dv_t.get(), sc.dv_t.get() + size_t(Dvp) * kKeys, 0.0f);

        // Query rows outside [first_row, row_end) see none of these keys through the window.
        const int64_t first_row = skip_hidden ? a.window.row_begin(j0, Sq) / kRows * kRows : 0;
        const int64_t row_end = skip_hidden ? a.window.row_end(j0 + kv_rows - 1, Sq) : Sq;
        for (int64_t g = 0; g < kv.group; ++g) {
            int64_t b[kBatchDims];
            kv.member(outer_b, g, b);
            for (int64_t i0 = first_row; i0 < row_end; i0 += kRows) chunk(sc, b, i0, j0, kv_rows, dq_split, turn);
        }

        store_transposed_rows(sc.dk_t.get(), kKeys, kv_rows, D, scale, args.grad_key, outer_b, j0, sc.out_rows.get());
        store_transposed_rows(sc.dv_t.get(), kKeys, kv_rows, Dv, 1.0f, args.grad_value, outer_b, j0, sc.out_rows.get());
    }

    // False (gradients unfinished) when split inputs held an infinity.
    bool run() {
        prepare();
        if (saw_infinity.load()) return false;
        // The last wave in KeyBlockWave's pieces (work_order.hpp).
        const KeyBlockWave work(kv.outer_items * splits, splits, key_blocks, omp_get_max_threads(),
                                splits * batch_total * Sqp);
        run_on_team(team, [&] {
            Scratch sc(Dp, Dvp, a.softcap > 0.0f);
            configure_tiles();
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < work.units(); ++u) {
                if (saw_infinity.load(std::memory_order_relaxed)) continue;
                const KeyBlockWave::Unit unit = work.unit(u);
                int64_t b[kBatchDims];
                kv.outer_index(unit.item / splits, b);
                float* dq_split = dq_sum.get() + unit.item % splits * batch_total * Sqp * Dp;
                const int64_t split = unit.item % splits;
                for (int64_t kb = unit.first; kb < unit.end; kb += splits)
                    key_block(sc, b, kb * kKeys, dq_split,
                              DqTurn{unit.turns, split * batch_total * Sqp, unit.ordinal(kb, splits),
                                     UnseenBlocks{a.window, Skv, kKeys, split, splits, skip_hidden}});
                if (sc.infinite) {
                    saw_infinity.store(true, std::memory_order_relaxed);
                    work.abandon();  // later units are skipped: no piece may wait on them
                }
            }
            _tile_release();
#pragma omp barrier
            const TensorView& dq = args.grad_query;
            float* out = sc.out_rows.get();
            // After the barrier every thread sees the same flag, so all skip the loop or none.
            const int64_t dq_rows = saw_infinity.load() ? 0 : batch_total * Sq;
#pragma omp for schedule(static)
            for (int64_t x = 0; x < dq_rows; ++x) {
                int64_t b[kBatchDims];
                unflatten_batch(a.batch, x / Sq, b);
                const int64_t i = x % Sq;
                const int64_t row = (x / Sq) * Sqp + i;
                sum_split_row(dq_sum.get() + row * Dp, batch_total * Sqp * Dp, splits, D, scale, out);
                store_view_row(out, D, dq, view_batch_offset(dq, b) + i * dq.strides[3]);
            }
        });
        return !saw_infinity.load();
    }
};

}  // namespace
}  // namespace isa_amx

bool sdpa_backward_amx(const SdpaBackwardArgs& args, int parts) {
    return parts == 2 ? isa_amx::Backward<2>(args).run() : isa_amx::Backward<1>(args).run();
}

std::string sdpa_backward_plan_amx(const SdpaBackwardArgs& args) {
    using Plan = isa_amx::Backward<1>;  // the parts do not change the plan
    const SdpaForwardArgs& a = args.forward;
    const isa_amx::KvGrouping kv(a);
    const isa_amx::KeyPassWork work = Plan::key_work(a, kv);
    return isa_amx::key_pass_text("tiles", isa_amx::kKeys, kv.outer_items, work.splits,
                                  work.splits * Plan::dq_plane_of(a), work.team);
}

}  // namespace graphattn
