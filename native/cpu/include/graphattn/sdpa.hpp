// graphattn C++ API: the fused scaled dot-product attention forward kernel.
//
// Every operand is described by a strided view over five logical dimensions
// (batch0, batch1, batch2, row, column).  Broadcast dimensions carry stride 0,
// so GQA/MQA (K/V shared across the query heads of a group), broadcast masks
// and reordered outputs are all expressed through strides: the kernel never
// copies or repeats a tensor.
#pragma once

#include <cstdint>
#include <string>

#include "graphattn/key_window.hpp"
#include "graphattn/kv_format.hpp"
#include "graphattn/kv_rows.hpp"
#include "graphattn/score_mods.hpp"
#include "graphattn/sequences.hpp"

namespace graphattn {

// u8: the bytes of a quantized K/V cache (KvQuant says how they decode).
enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2, boolean = 3, u8 = 4 };

// Bytes of one element of this dtype.
inline int64_t dtype_size(DType dt) {
    switch (dt) {
        case DType::f32: return 4;
        case DType::bf16:
        case DType::f16: return 2;
        case DType::boolean:
        case DType::u8: return 1;
    }
    return 0;
}

constexpr int kBatchDims = 3;

// The bytes a view's buffer holds around its data pointer: [begin, end),
// relative to data (begin <= 0 where negative strides reach back).  Left at
// its default (end < begin) the buffer's size is unknown and not checked.
struct BufferExtent {
    int64_t begin = 0;
    int64_t end = -1;
    bool known() const { return end >= begin; }
};

// The scales or zero points of a quantized K or V view, strides in elements:
// batch dims, row, group.  Per group (u8, s8, u4, s4) they are found like the
// rows they belong to (a paged view's walk the same block table, strides[0]
// from block to block); per batch element (fp8) the row and group strides
// are 0 and strides[0] steps from sequence to sequence, paged or not.
struct KvQuantParams {
    const void* data = nullptr;
    DType dtype = DType::f32;  // scales: f32, bf16 or f16; zero points: u8 (signed for s8 and s4)
    int64_t strides[kBatchDims + 2] = {0, 0, 0, 0, 0};
    BufferExtent buffer;
};

// A K or V view whose rows are stored quantized (graphattn/kv_format.hpp):
// the view's dtype is then u8 and its strides count bytes (a 4-bit row's D
// values lie in D / 2 adjacent bytes).  Kernels read its rows decoded to
// `decoded` (f32, bf16 or f16: the query's, so the kernel choice is the
// query dtype's), never the bytes.
struct KvQuant {
    KvFormat format = KvFormat::plain;
    int64_t group = 0;  // columns per scale (per group formats)
    DType decoded = DType::f32;
    KvQuantParams scales;
    KvQuantParams zero_points;  // data null: zero points 0
    bool quantized() const { return format != KvFormat::plain; }
};

// Strides are in elements, not bytes.  strides[0..2] are the batch dims,
// strides[3] the row (sequence) dim, strides[4] the column dim.  `buffer`,
// when given, is checked to hold every element the view reaches.
struct TensorView {
    const void* data = nullptr;
    DType dtype = DType::f32;
    int64_t strides[kBatchDims + 2] = {0, 0, 0, 0, 0};
    BufferExtent buffer;
    // K and V of calls with packed sequences only: rows found through a block
    // table (graphattn/kv_rows.hpp); strides[0] then steps from one block to
    // the next.  Not paged by default.
    KvPages pages;
    // K and V only: rows stored quantized; plain by default.
    KvQuant quant;
};

// The dtype kernels read a view's values in: a quantized K/V view's decoded
// one, else its own.
inline DType read_dtype(const TensorView& t) { return t.quant.quantized() ? t.quant.decoded : t.dtype; }

// How the rows of a K or V view are found (graphattn/kv_rows.hpp): its
// strides, batch, row and column.
inline KvRowLayout kv_row_layout(const TensorView& t) {
    KvRowLayout layout;
    for (int d = 0; d < kBatchDims; ++d) layout.batch_strides[d] = t.strides[d];
    layout.row_stride = t.strides[3];
    layout.col_stride = t.strides[4];
    layout.pages = t.pages;
    return layout;
}

// ALiBi (graphattn/score_mods.hpp): scores -= slope * |i' - j|, one slope
// per batch index (f32; strides[0..2] walk the batch, the row and column
// strides are unused).  slopes.data null: no ALiBi.
struct Alibi {
    TensorView slopes;
    bool bottom_right = false;  // i' = i + seq_kv - seq_q, else i' = i
    int64_t row_shift(int64_t seq_q, int64_t seq_kv) const {
        return aligned_row_shift(bottom_right ? RowAlignment::bottom_right : RowAlignment::top_left, seq_q, seq_kv);
    }
};

enum class MaskKind : int32_t {
    none = 0,
    additive = 1,  // scores + mask
    select = 2,    // boolean mask: keep the score where mask == keep_value, else fill
};

// Arguments of one forward call.  Shapes: Q (B, Sq, D), K (B, Skv, D),
// V (B, Skv, Dv), O (B, Sq, Dv), mask (B, Sq, Skv), stats (B, Sq, 1),
// where B is the 3-dim batch.  With packed sequences (graphattn/sequences.hpp)
// batch[0] counts the sequences, seq_q and seq_kv are their longest, and each
// sequence has its own lengths and rows; no mask is taken then.
struct SdpaForwardArgs {
    int64_t batch[kBatchDims] = {1, 1, 1};
    int64_t seq_q = 0;
    int64_t seq_kv = 0;
    int64_t head_dim_qk = 0;
    int64_t head_dim_v = 0;

    TensorView query, key, value;
    TensorView mask;     // used when mask_kind != none
    TensorView output;   // written
    TensorView stats;    // written when data != nullptr; always f32

    // scores = (Q K^T) * scale, or (Q K^T) / scale when scale_is_divisor.
    bool has_scale = false;
    bool scale_is_divisor = false;
    float scale = 1.0f;

    // Score modifiers, after the scale and before the mask, in this order
    // (graphattn/score_mods.hpp).  softcap > 0: scores = softcap *
    // tanh(scores / softcap); 0: none.  sinks: one f32 logit per batch index
    // (strides as the ALiBi slopes'), added to every row's softmax sum as
    // exp(sink) with no value; data null: none.  The stats include it.
    float softcap = 0.0f;
    Alibi alibi;
    TensorView sinks;

    MaskKind mask_kind = MaskKind::none;
    bool select_keep_value = true;   // keep where mask == this value
    float select_fill = -__builtin_inff();

    // The keys each query row sees (graphattn/key_window.hpp); the others
    // score window.fill.  All keys by default; causal is right = 0.
    KeyWindow window;
    // Where alignment is not as_given, window.row_shift and alibi.bottom_right
    // are set from it and each sequence's lengths before any kernel runs.
    RowAlignment alignment = RowAlignment::as_given;

    // Sequences of their own lengths packed along the rows; none by default.
    PackedSequences sequences;

    // SoftMax mode: false = "none" (a fully masked row gives NaN),
    // true = "inf_as_zero" (a fully masked row gives 0).
    bool inf_as_zero = false;

    // Dropout on the probabilities (after SoftMax, before the product with
    // V): element (b, i, j) is kept with probability 1 - p by the Philox
    // keep-mask of graphattn/philox.hpp, with b the row-major flat index of
    // the 3 batch dims, and kept values are scaled by 1 / (1 - p).  The stats
    // stay those of the softmax without dropout.  Element (b, i, j) is
    // Philox element dropout_first_element + (b * Sq + i) * Skv + j; packed
    // sequences lie one after another, sequence s from the sum over the ones
    // before it of heads * query_rows * key_rows (heads: batch[1] * batch[2]).
    float dropout_p = 0.0f;
    uint64_t dropout_seed = 0;
    uint64_t dropout_offset = 0;
    uint64_t dropout_first_element = 0;
};

// The factor the scores Q K^T are multiplied by: scale, 1 / scale
// (scale_is_divisor), or 1 without a scale.  Every kernel family takes it
// from here.
inline float score_scale(const SdpaForwardArgs& a) {
    return !a.has_scale ? 1.0f : (a.scale_is_divisor ? 1.0f / a.scale : a.scale);
}

// Arguments of one backward call.  `forward` describes the forward call
// whose gradients are wanted: its output and stats views are read here (the
// forward's O and its f32 log-sum-exp), never written.  Gradients: dQ has
// Q's layout, dK and dV K's and V's (where K and V carry stride 0 over a
// batch dim, as the heads of a GQA group do, their gradients are summed over
// it), dmask (optional, f32, (B, Sq, Skv)) receives dL/d(scores), the
// gradient of an additive mask before any broadcast reduction.
struct SdpaBackwardArgs {
    SdpaForwardArgs forward;
    TensorView grad_output;   // dO, O's shape
    TensorView grad_query;    // written
    TensorView grad_key;      // written
    TensorView grad_value;    // written
    TensorView grad_mask;     // written when data != nullptr
    // Written when data != nullptr (needs forward.sinks): f32, laid out as the
    // sinks, d sigma = -sum over rows of exp(sigma - stats_i) * rowsum(dO_i * O_i),
    // summed over the batch dims where its stride is 0.
    TensorView grad_sinks;
};

// Result of a kernel call: ok, or a message naming the offending argument.
struct Status {
    bool ok = true;
    std::string message;
    static Status success() { return {}; }
    static Status error(std::string msg) { return {false, std::move(msg)}; }
};

// Argument checks every kernel family runs first: shapes, dtypes, null
// pointers, each view's reach against its buffer (where given), written
// views that would put two elements in one place (stride 0 over a dim of two
// or more, or strides that fold), and, for the backward, the broadcast rules
// of the gradients.
Status check_forward_args(const SdpaForwardArgs& args);
Status check_backward_args(const SdpaBackwardArgs& args);

// Runs the fused forward kernel with OpenMP.  Thread-safe; allocates only
// per-thread scratch of O(block * head_dim) floats.
Status sdpa_forward(const SdpaForwardArgs& args);

// Runs the fused backward kernel (FlashAttention-2 style: P recomputed from
// the stats; one pass over key blocks for dK, dV and dQ, dQ summed in f32
// buffers per key split), in f32 whatever the input dtype.  Memory: dQ's f32
// buffers, B * Sq * D floats per key split (up to four splits; more only
// while all of them fit 16 MiB), plus per-thread blocks.
Status sdpa_backward(const SdpaBackwardArgs& args);

// Name of the kernel build sdpa_backward uses for inputs of this dtype (or
// dtype class, see sdpa_dtype_class), query length and key length.
const char* sdpa_backward_isa(DType input_dtype, int64_t seq_q, int64_t seq_kv);

// The backward's kernel choice for these arguments in words, for logs:
// comma-separated key=value fields: isa, why (the rule that chose it), then
// its key pass on this thread count: layout (lanes or tiles), key_block,
// kv_items (K/V batch indices), key_splits per index, dq_buffers_kib,
// threads and order.  Data addresses are not read.
std::string sdpa_backward_plan(const SdpaBackwardArgs& args);

// Partial attention results over disjoint key sets (a ring's hops), merged
// by their log-sum-exp, in place: rows of head_dim_v f32 values and one f32
// stat each.  Per row, with m = max(stats, part_stats) and
// w = e^(stats - m), w' = e^(part_stats - m):
//     out = (w out + w' part_out) / (w + w'),   stats = m + log(w + w').
// A part whose stat is -inf (no key seen) leaves the row as it is; a row whose
// stat is -inf takes the part.  The part may be a kernel's output as it was
// written (bf16 or f16): it is widened here, not rounded again.  Rows lie in
// runs of run_rows consecutive rows (a head's rows of a longer sequence, say):
// run k's first row at out + k * out_run_stride, stats + k * stats_run_stride
// and part + k * part_run_stride (elements).
struct MergeAttentionArgs {
    int64_t rows = 0;
    int64_t head_dim_v = 0;
    int64_t run_rows = 0;               // 0: all rows make one run
    float* out = nullptr;               // rows of head_dim_v, contiguous within a run; read and written
    int64_t out_run_stride = 0;
    float* stats = nullptr;             // read and written
    int64_t stats_run_stride = 0;
    const void* part_out = nullptr;     // of part_dtype, laid out as out
    int64_t part_run_stride = 0;
    DType part_dtype = DType::f32;      // f32, bf16 or f16
    const float* part_stats = nullptr;  // laid out as stats
    int64_t part_stats_run_stride = 0;
};
Status merge_attention(const MergeAttentionArgs& args);

// A part added into an f32 sum, in place: sum += part over `runs` runs of
// `run_length` contiguous values, run r at sum + r * sum_stride and at
// part + r * part_stride (elements).  The part is f32, bf16 or f16 (widened,
// not rounded): a ring's gradient parts, summed in f32 and rounded once.
struct AccumulateArgs {
    int64_t runs = 0;
    int64_t run_length = 0;
    float* sum = nullptr;
    int64_t sum_stride = 0;
    const void* part = nullptr;
    int64_t part_stride = 0;
    DType part_dtype = DType::f32;
};
Status accumulate(const AccumulateArgs& args);

// Testing aid: with poisoning on, kernel scratch that is not cleared starts
// as NaN in every later call, so that reading what was never written shows.
void set_scratch_poisoning(bool on);

// The dtype class the kernel choice goes by for inputs of these dtypes: bf16
// when every one is bf16, f16 when all are 16-bit floats with an f16 among
// them, else f32.
DType sdpa_dtype_class(const DType* dtypes, int count);

// Name of the kernel build sdpa_forward uses on this machine for inputs of
// this dtype, query length, key length, batch size (all batch dimensions
// together: N * Hq) and head size, with or without a top-left causal window
// and with no mask or dropout (for example "amx_bf16", "avx512" or
// "portable").
const char* sdpa_forward_isa(DType input_dtype = DType::f32, int64_t seq_q = 1 << 20, int64_t seq_kv = 1 << 20,
                             int64_t batch = 1, bool causal = false, int64_t head_dim = 64);

// Name of the kernel build sdpa_forward uses for these arguments (their
// dtypes, lengths, batch, causal mask and dropout, and the thread count;
// data addresses are not read).
const char* sdpa_forward_isa_for(const SdpaForwardArgs& args);

// The forward's kernel choice for these arguments in words, for logs:
// comma-separated key=value fields: isa, why (the rule that chose it), then
// the work layout on this thread count: layout (rows, lanes or tiles),
// item_rows, items, key_splits, keys_per_split, threads and order (how items
// go to threads).  Data addresses are not read.
std::string sdpa_forward_plan(const SdpaForwardArgs& args);

}  // namespace graphattn
