// SDPA forward, XMX variant: Q K^T and P V on joint_matrix tiles, for
// devices with the ext_intel_matrix aspect (Intel GPUs with XMX).  One
// sub-group of 16 work-items owns kTileRows = 8 query rows; keys come in
// blocks of 16.  Tiles (all row-major): A 8x16, B 16x16 (bf16 or f16), accumulator 8x16 f32,
// the shapes XMX takes with sub-group size 16.  K and V blocks are staged in
// local memory (zero-padded past the last key), so any strides work; the
// online softmax (base 2) runs on the score tile in local memory, one row per
// work-item, with the same mask and dropout helpers as the sub-group kernel.
// Q and K stay in their input dtype (exact); the scale is applied to the f32
// scores.  P is rounded to the input dtype for P V, as on XMX hardware.
// Build options: GA_INPUT_DTYPE (1 bf16, 2 f16), GA_QK_DIM and GA_V_DIM (the
// head sizes rounded up to multiples of 16, at most 512; columns past the
// real sizes are zero-filled and never stored).
#include <sycl/ext/oneapi/matrix/matrix.hpp>

#include "sdpa_device.hpp"

using namespace graphattn_sycl;
namespace jm = sycl::ext::oneapi::experimental::matrix;

namespace {

// The tiles' element type; its values are written through bit patterns (see sdpa_device.hpp).
#if GA_INPUT_DTYPE == 1
using TileT = sycl::ext::oneapi::bfloat16;
inline TileT to_tile(float x) { return sycl::bit_cast<TileT>(f32_to_bf16_bits(x)); }
#else
using TileT = sycl::half;
inline TileT to_tile(float x) { return sycl::half(x); }
#endif

constexpr int kTileRows = 8;
constexpr int kTileKeys = 16;
constexpr int kTileK = 16;
constexpr int D = GA_QK_DIM;
constexpr int Dv = GA_V_DIM;
constexpr int kKvCols = D > Dv ? D : Dv;
static_assert(D % kTileK == 0 && D <= 512, "GA_QK_DIM must be a multiple of 16, at most 512");
static_assert(Dv % kTileK == 0 && Dv <= 512, "GA_V_DIM must be a multiple of 16, at most 512");

template <typename T>
inline sycl::multi_ptr<T, sycl::access::address_space::local_space, sycl::access::decorated::no> local_ptr(T* p) {
    return sycl::address_space_cast<sycl::access::address_space::local_space, sycl::access::decorated::no>(p);
}

}  // namespace

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::nd_range_kernel<1>))
SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclex::sub_group_size<kSubGroup>))
void graphattn_sdpa_forward_xmx(ForwardParams p) {
    const sycl::nd_item<1> item = sycl::ext::oneapi::this_work_item::get_nd_item<1>();
    const sycl::sub_group sg = item.get_sub_group();
    const int lane = int(sg.get_local_linear_id());
    const int64_t tiles_per_batch = (p.seq_q + kTileRows - 1) / kTileRows;
    const int64_t tile = int64_t(item.get_group_linear_id());
    if (tile >= batch_count(p) * tiles_per_batch) return;
    const int64_t fb = tile / tiles_per_batch, i0 = (tile % tiles_per_batch) * kTileRows;
    const int rows = int(sycl::min<int64_t>(kTileRows, p.seq_q - i0));

    static syclex::work_group_static<TileT[kTileRows * D]> q_mem;
    static syclex::work_group_static<TileT[kTileKeys * kKvCols]> kv_mem;
    static syclex::work_group_static<float[kTileRows * kTileKeys]> s_mem;
    static syclex::work_group_static<TileT[kTileRows * kTileKeys]> p_mem;
    static syclex::work_group_static<float[kTileRows * Dv]> o_mem;
    TileT* q_tile = *(&q_mem);
    TileT* kv_tile = *(&kv_mem);
    float* s_tile = *(&s_mem);
    TileT* p_tile = *(&p_mem);
    float* o_tile = *(&o_mem);

    // Q rows (zero past the last row and column) and a zero output accumulator.
    const float score_scale = p.score_scale * kLog2e;  // scores in log2 units
    const int dim_qk = p.head_dim_qk, dim_v = p.head_dim_v;
    const int64_t q_base = batch_offset(p.query, p.batch, fb);
    for (int x = lane; x < kTileRows * D; x += kSubGroup) {
        const int r = x / D, d = x % D;
        q_tile[x] = to_tile(r < rows && d < dim_qk ? input_as_f32(p.query, q_base + (i0 + r) * p.query.strides[3] + d * p.query.strides[4]) : 0.0f);
    }
    for (int x = lane; x < kTileRows * Dv; x += kSubGroup) o_tile[x] = 0.0f;
    // Row r's online-softmax state lives in work-item r.
    float row_max = -kInf, row_sum = 0.0f;
    const int64_t my_row = i0 + lane;
    const int64_t m_off = p.mask_kind && lane < rows ? batch_offset(p.mask, p.batch, fb) + my_row * p.mask.strides[3] : 0;
    const int64_t k_base = batch_offset(p.key, p.batch, fb), v_base = batch_offset(p.value, p.batch, fb);
    const float slope = graphattn::alibi_slope_log2(per_index(p.alibi_slopes, p.batch, fb), kLog2e);
    const int64_t end = key_end(p, i0 + rows - 1);
    sycl::group_barrier(sg);

    for (int64_t j0 = key_begin(p, i0); j0 < end; j0 += kTileKeys) {
        const int keys = int(sycl::min<int64_t>(kTileKeys, end - j0));
        for (int x = lane; x < kTileKeys * D; x += kSubGroup) {  // K^T: kv_tile[d][n] = K[j0 + n][d]
            const int d = x / kTileKeys, n = x % kTileKeys;
            kv_tile[x] = to_tile(n < keys && d < dim_qk ? kv_as_f32(p.key, k_base, j0 + n, d) : 0.0f);
        }
        sycl::group_barrier(sg);
        // S = Q K^T on the transposed K tile.
        jm::joint_matrix<sycl::sub_group, float, jm::use::accumulator, kTileRows, kTileKeys> s_acc;
        jm::joint_matrix_fill(sg, s_acc, 0.0f);
        for (int k0 = 0; k0 < D; k0 += kTileK) {
            jm::joint_matrix<sycl::sub_group, TileT, jm::use::a, kTileRows, kTileK, jm::layout::row_major> a;
            jm::joint_matrix<sycl::sub_group, TileT, jm::use::b, kTileK, kTileKeys, jm::layout::row_major> b;
            jm::joint_matrix_load(sg, a, local_ptr(q_tile + k0), D);
            jm::joint_matrix_load(sg, b, local_ptr(kv_tile + k0 * kTileKeys), kTileKeys);
            jm::joint_matrix_mad(sg, s_acc, a, b, s_acc);
        }
        jm::joint_matrix_store(sg, s_acc, local_ptr(s_tile), kTileKeys, jm::layout::row_major);
        sycl::group_barrier(sg);
        // Online softmax on row `lane`; P (with dropout) goes to p_tile, O rows are rescaled.
        if (lane < kTileRows) {
            float scores[kTileKeys];
            float block_max = -kInf;
            for (int n = 0; n < kTileKeys; ++n) {
                const int64_t j = j0 + n;
                float s = -kInf;
                float cap_tanh;
                if (lane < rows && n < keys)
                    s = masked_score_log2(p, modified_score_log2(p, s_tile[lane * kTileKeys + n] * score_scale, slope,
                                                                 my_row, j, cap_tanh),
                                          mask_element(p, m_off, j), my_row, j);
                scores[n] = s;
                if (!sycl::isnan(s)) block_max = sycl::fmax(block_max, s);
            }
            const float new_max = sycl::fmax(row_max, block_max);
            const float subtract = new_max == -kInf ? 0.0f : new_max;
            const float rescale = sycl::exp2(row_max - subtract);
            float block_sum = 0.0f;
            const uint64_t drop_base = p.dropout_first_element + uint64_t((fb * p.seq_q + my_row) * p.seq_kv);
            for (int n = 0; n < kTileKeys; ++n) {
                const float prob = sycl::exp2(scores[n] - subtract);
                block_sum += n < keys ? prob : 0.0f;
                const float dropped = lane < rows && n < keys ? prob * dropout_multiplier(p, drop_base + uint64_t(j0 + n)) : 0.0f;
                p_tile[lane * kTileKeys + n] = to_tile(dropped);
            }
            row_sum = row_sum * rescale + block_sum;
            row_max = new_max;
            for (int d = 0; d < Dv; ++d) o_tile[lane * Dv + d] *= rescale;
        }
        for (int x = lane; x < kTileKeys * Dv; x += kSubGroup) {
            const int n = x / Dv, d = x % Dv;
            kv_tile[x] = to_tile(n < keys && d < dim_v ? kv_as_f32(p.value, v_base, j0 + n, d) : 0.0f);
        }
        sycl::group_barrier(sg);
        // O += P V, one 8x16 accumulator tile per 16 output columns.
        jm::joint_matrix<sycl::sub_group, TileT, jm::use::a, kTileRows, kTileKeys, jm::layout::row_major> pa;
        jm::joint_matrix_load(sg, pa, local_ptr(p_tile), kTileKeys);
        for (int d0 = 0; d0 < Dv; d0 += kTileK) {
            jm::joint_matrix<sycl::sub_group, float, jm::use::accumulator, kTileRows, kTileK> o_acc;
            jm::joint_matrix<sycl::sub_group, TileT, jm::use::b, kTileKeys, kTileK, jm::layout::row_major> vb;
            jm::joint_matrix_load(sg, o_acc, local_ptr(o_tile + d0), Dv, jm::layout::row_major);
            jm::joint_matrix_load(sg, vb, local_ptr(kv_tile + d0), Dv);
            jm::joint_matrix_mad(sg, o_acc, pa, vb, o_acc);
            jm::joint_matrix_store(sg, o_acc, local_ptr(o_tile + d0), Dv, jm::layout::row_major);
        }
        sycl::group_barrier(sg);
    }

    if (lane < rows) {
        const RowFinish finish = finish_row(p, fb, row_max, row_sum);
        const int64_t o_off = batch_offset(p.output, p.batch, fb) + my_row * p.output.strides[3];
        for (int d = 0; d < dim_v; ++d)
            store_f32_as(p.output, o_off + d * p.output.strides[4], o_tile[lane * Dv + d] * finish.factor);
        if (p.stats.data != nullptr) {
            float* stats = static_cast<float*>(const_cast<void*>(p.stats.data));
            stats[batch_offset(p.stats, p.batch, fb) + my_row * p.stats.strides[3]] = finish.lse;
        }
    }
}
