// Packed sequences run as dense calls, one per run of equal-length sequences
// that lie one after another (a dense batch through the packed layout is one
// run, so one dense call), balanced by their visible work:
//   - a run whose work the dense kernel's own planner can spread over every
//     thread (a share of the call's work, in enough items, or one head that
//     alone outweighs a thread's share) runs with the whole team, one run
//     after another;
//   - the others are cut into (sequence, K/V head) tasks, run one per thread
//     at once, largest first, so short sequences beside a long one keep every
//     thread busy without a parallel region each.
// Sequences that have no keys give their rows 0 (stats -inf, or the sink's
// logit; dQ 0); keys that no row of their sequence has get dK = dV = 0.
#include "graphattn/packed_sequences.hpp"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace graphattn {
namespace {

// Rows of the dense kernels' query blocks, for counting a run's items.
constexpr int64_t kItemRows = 64;

struct Task {
    int64_t first = 0, count = 1;       // sequences [first, first + count)
    int64_t head_begin = 0, heads = 0;  // K/V heads (batch[1]) [head_begin, head_begin + heads)
    int64_t work = 0;
};

int64_t heads_of(const SdpaForwardArgs& a) { return a.batch[1] * a.batch[2]; }

KeyWindow aligned_window(const SdpaForwardArgs& a, const SequenceSpan& s) {
    KeyWindow w = a.window;
    if (a.alignment != RowAlignment::as_given) w.row_shift = aligned_row_shift(a.alignment, s.query_rows, s.key_rows);
    return w;
}

// A sequence's work per head: its visible scores, plus a row's and a key's own costs.
int64_t sequence_work(const SdpaForwardArgs& a, const SequenceSpan& s) {
    const KeyWindow w = aligned_window(a, s);
    const int64_t pairs = w.hidden_weigh_zero() ? w.visible_pairs(s.query_rows, s.key_rows) : s.query_rows * s.key_rows;
    return pairs + s.query_rows + s.key_rows;
}

// The view moved to `first_row` (its row stride times it), with a batch-0
// stride of `run_rows` rows, and to batch index `first` of dim `dim`.
// A data pointer and its buffer moved by `elements` of `dtype`.
template <class View>
void move_data(View& v, int64_t elements) {
    if (!v.data || elements == 0) return;
    const int64_t bytes = elements * dtype_size(v.dtype);
    v.data = static_cast<const char*>(v.data) + bytes;
    if (v.buffer.known()) v.buffer.begin -= bytes, v.buffer.end -= bytes;
}

// A quantized view's scales and zero points move with its rows where they are per group (fp8's per batch
// element do not).
void move_rows(TensorView& v, int64_t first_row, int64_t run_rows) {
    if (!v.data) return;
    move_data(v, first_row * v.strides[3]);
    v.strides[0] = run_rows * v.strides[3];
    if (!v.quant.quantized() || kv_fp8(v.quant.format)) return;
    for (KvQuantParams* p : {&v.quant.scales, &v.quant.zero_points}) {
        move_data(*p, first_row * p->strides[3]);
        p->strides[0] = run_rows * p->strides[3];
    }
}

void move_batch(TensorView& v, int dim, int64_t first) {
    if (!v.data || first == 0) return;
    move_data(v, first * v.strides[dim]);
    if (v.quant.quantized())
        for (KvQuantParams* p : {&v.quant.scales, &v.quant.zero_points}) move_data(*p, first * p->strides[dim]);
}

// Philox elements before sequence s (SdpaForwardArgs' dropout rule), for s in [0, count].
std::vector<uint64_t> dropout_prefix(const SdpaForwardArgs& a) {
    std::vector<uint64_t> prefix(size_t(a.batch[0] + 1), a.dropout_first_element);
    for (int64_t s = 0; s < a.batch[0]; ++s) {
        const SequenceSpan& sp = a.sequences.spans[s];
        prefix[size_t(s + 1)] = prefix[size_t(s)] + uint64_t(heads_of(a) * sp.query_rows * sp.key_rows);
    }
    return prefix;
}

// The dense call of one task.
SdpaForwardArgs dense_forward(const SdpaForwardArgs& a, const Task& t, const std::vector<uint64_t>& prefix) {
    const SequenceSpan& s = a.sequences.spans[t.first];
    SdpaForwardArgs d = with_alignment_resolved([&] {
        SdpaForwardArgs x = a;
        x.seq_q = s.query_rows;
        x.seq_kv = s.key_rows;
        return x;
    }());
    d.sequences = {};
    d.batch[0] = t.count;
    d.batch[1] = t.heads;
    for (TensorView* v : {&d.query, &d.output, &d.stats}) move_rows(*v, s.query_begin, s.query_rows);
    for (TensorView* v : {&d.key, &d.value}) {
        // Scales per batch element step from sequence to sequence, not from block to block or row to row.
        if (kv_fp8(v->quant.format)) move_data(v->quant.scales, t.first * v->quant.scales.strides[0]);
        if (!v->pages.paged()) {
            move_rows(*v, s.key_begin, s.key_rows);
            continue;
        }
        // The run's table rows from its first sequence's, its keys from the logical row key_begin.
        v->pages.table += t.first * v->pages.table_stride;
        v->pages.first_row = s.key_begin;
        v->pages.rows = s.key_rows;
    }
    d.key.pages.cols = a.head_dim_qk;
    d.value.pages.cols = a.head_dim_v;
    for (TensorView* v : {&d.alibi.slopes, &d.sinks}) move_batch(*v, 0, t.first);
    for (TensorView* v : {&d.query, &d.key, &d.value, &d.output, &d.stats, &d.alibi.slopes, &d.sinks})
        move_batch(*v, 1, t.head_begin);
    d.dropout_first_element = prefix[size_t(t.first)] + uint64_t(t.head_begin * a.batch[2] * s.query_rows * s.key_rows);
    return d;
}

// grad_sinks of a task: f32 values of its own, broadcast where the caller's are (summed there), added into
// the caller's after every task has run.
struct SinkPart {
    std::vector<float> values;
    int64_t strides[kBatchDims] = {0, 0, 0};
};

SinkPart sink_part(const SdpaBackwardArgs& b, const Task& t) {
    SinkPart part;
    const int64_t dims[kBatchDims] = {t.count, t.heads, b.forward.batch[2]};
    int64_t size = 1;
    for (int d = kBatchDims - 1; d >= 0; --d) {
        part.strides[d] = b.grad_sinks.strides[d] == 0 ? 0 : size;
        if (b.grad_sinks.strides[d] != 0) size *= dims[d];
    }
    part.values.assign(size_t(size), 0.0f);
    return part;
}

SdpaBackwardArgs dense_backward(const SdpaBackwardArgs& b, const Task& t, const std::vector<uint64_t>& prefix,
                                SinkPart* sinks) {
    const SequenceSpan& s = b.forward.sequences.spans[t.first];
    SdpaBackwardArgs d = b;
    d.forward = dense_forward(b.forward, t, prefix);
    for (TensorView* v : {&d.grad_output, &d.grad_query}) move_rows(*v, s.query_begin, s.query_rows);
    for (TensorView* v : {&d.grad_key, &d.grad_value}) move_rows(*v, s.key_begin, s.key_rows);
    for (TensorView* v : {&d.grad_output, &d.grad_query, &d.grad_key, &d.grad_value})
        move_batch(*v, 1, t.head_begin);
    if (sinks) {
        d.grad_sinks.data = sinks->values.data();
        d.grad_sinks.buffer = {};
        for (int i = 0; i < kBatchDims; ++i) d.grad_sinks.strides[i] = sinks->strides[i];
    }
    return d;
}

// Writes 0 (its bit pattern, in every float dtype) over rows [first_row, first_row + rows) of every head
// (batch[1] x batch[2]) of a view with `cols` columns.
void zero_rows(const TensorView& v, const int64_t batch[kBatchDims], int64_t first_row, int64_t rows, int64_t cols) {
    if (!v.data || rows == 0) return;
    const int64_t size = dtype_size(v.dtype);
    char* base = static_cast<char*>(const_cast<void*>(v.data));
    for (int64_t h1 = 0; h1 < batch[1]; ++h1)
        for (int64_t h2 = 0; h2 < batch[2]; ++h2)
            for (int64_t r = first_row; r < first_row + rows; ++r)
                for (int64_t c = 0; c < cols; ++c)
                    std::memset(base + (h1 * v.strides[1] + h2 * v.strides[2] + r * v.strides[3] + c * v.strides[4]) * size,
                                0, size_t(size));
}

// The stats of sequence s's rows where it has no keys: the log-sum-exp of nothing, -inf, or with sinks the
// sink's logit alone (its weight is the row's whole sum).
void no_key_stats(const SdpaForwardArgs& a, int64_t s, int64_t first_row, int64_t rows) {
    if (!a.stats.data) return;
    float* stats = static_cast<float*>(const_cast<void*>(a.stats.data));
    const float* sinks = static_cast<const float*>(a.sinks.data);
    const int64_t* st = a.stats.strides;
    const int64_t* sk = a.sinks.strides;
    for (int64_t h1 = 0; h1 < a.batch[1]; ++h1)
        for (int64_t h2 = 0; h2 < a.batch[2]; ++h2) {
            const float value = sinks ? sinks[s * sk[0] + h1 * sk[1] + h2 * sk[2]] : -__builtin_inff();
            for (int64_t r = first_row; r < first_row + rows; ++r) stats[h1 * st[1] + h2 * st[2] + r * st[3]] = value;
        }
}

// The tasks of a call, in the order they run: the whole-team runs, then the pooled tasks largest first
// (`pooled` of them at the end).  A task's work is that of all its sequences and heads.
struct Plan {
    std::vector<Task> tasks;
    size_t pooled = 0;
    int threads = 1;
};

// How a call's sequences become tasks.
struct TaskRules {
    bool may_pool = false;        // small runs may be pooled, one task per thread
    bool with_empty = false;      // runs without keys or rows are tasks too
    bool heads_together = false;  // a pooled task takes a sequence's every K/V head, else one
};

// The forward's rules: a pooled task takes a sequence's heads together where K's and V's rows of its heads
// lie side by side in each token row (a token-major cache), so that the kernel reads whole token rows
// (the row layout's turns, sdpa_forward_lanes.hpp) rather than one head's stripe of each.
TaskRules forward_rules(const SdpaForwardArgs& a, const DenseForwardRunner& dense) {
    const bool interleaved = kv_row_layout(a.key).interleaves(1, a.batch[1]) &&
                             kv_row_layout(a.value).interleaves(1, a.batch[1]);
    return {dense.pooled, !dense.host_fills, interleaved};
}

// The backward's rules: a pooled task takes one K/V head (the backward takes no turns over heads).
TaskRules backward_rules(const DenseBackwardRunner& dense) { return {dense.pooled, !dense.host_fills, false}; }

Plan plan_tasks(const SdpaForwardArgs& a, const TaskRules& rules) {
    Plan plan;
    plan.threads = rules.may_pool ? omp_get_max_threads() : 1;
    const SequenceSpan* spans = a.sequences.spans;
    std::vector<Task> runs;
    int64_t total = 0;
    for (int64_t s = 0; s < a.batch[0];) {
        int64_t end = s + 1;
        while (end < a.batch[0] && continues_run(spans[end - 1], spans[end], a.key.pages.paged())) ++end;
        if (rules.with_empty ? spans[s].query_rows + spans[s].key_rows > 0 : spans[s].query_rows > 0 && spans[s].key_rows > 0) {
            Task run{s, end - s, 0, a.batch[1], (end - s) * heads_of(a) * sequence_work(a, spans[s])};
            total += run.work;
            runs.push_back(run);
        }
        s = end;
    }
    const int64_t share = total / std::max(plan.threads, 1);
    std::vector<Task> pooled;
    const int64_t heads = rules.heads_together ? a.batch[1] : 1;  // K/V heads of one pooled task
    for (const Task& run : runs) {
        const SequenceSpan& s = spans[run.first];
        const int64_t unit = run.work / std::max<int64_t>(run.count * a.batch[1], 1) * heads;  // one pooled task's
        const int64_t items = run.count * heads_of(a) * ((s.query_rows + kItemRows - 1) / kItemRows);
        const bool whole_team = plan.threads <= 1 || 2 * unit > share || (2 * run.work >= share && items >= plan.threads);
        if (whole_team) {
            plan.tasks.push_back(run);
            continue;
        }
        for (int64_t q = run.first; q < run.first + run.count; ++q)
            for (int64_t h = 0; h < a.batch[1]; h += heads) pooled.push_back({q, 1, h, heads, unit});
    }
    std::stable_sort(pooled.begin(), pooled.end(), [](const Task& x, const Task& y) { return x.work > y.work; });
    plan.pooled = pooled.size();
    plan.tasks.insert(plan.tasks.end(), pooled.begin(), pooled.end());
    return plan;
}

// Runs body(i) for every task: the whole-team ones in turn, then the pooled ones at once, one per thread
// (a thread's own kernel calls run on it alone).  The first error is returned.
template <class Body>
Status run_tasks(const Plan& plan, Body&& body) {
    const size_t whole = plan.tasks.size() - plan.pooled;
    for (size_t i = 0; i < whole; ++i) {
        Status s = body(i);
        if (!s.ok) return s;
    }
    if (plan.pooled == 0) return Status::success();
    Status first_error;
    const int team = int(std::min<size_t>(size_t(plan.threads), plan.pooled));
#pragma omp parallel num_threads(team)
    {
        omp_set_num_threads(1);  // the regions this thread starts get one thread: the kernels size their teams by it
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = int64_t(whole); i < int64_t(plan.tasks.size()); ++i) {
            Status s;
            // A region of its own: the kernels' worksharing loops bind to it, not to this team.
#pragma omp parallel num_threads(1)
            s = body(size_t(i));
            if (!s.ok) {
#pragma omp critical(graphattn_packed_error)
                if (first_error.ok) first_error = s;
            }
        }
    }
    return first_error;
}

std::string sequence_text(int64_t s) { return "sequence " + std::to_string(s) + ": "; }

// The table entries of the blocks that hold sequence s's keys (none past them is read) lie in [0, num_blocks).
Status check_table_row(const KvPages& p, int64_t s, const SequenceSpan& sp) {
    if (!p.paged() || sp.key_rows == 0) return Status::success();
    if (p.block_rows < 1) return Status::error("block_table: block size must be >= 1");
    const int64_t needed = (sp.key_begin + sp.key_rows + p.block_rows - 1) / p.block_rows;
    if (needed > p.table_stride)
        return Status::error("block_table: " + sequence_text(s) + "its keys reach block " + std::to_string(needed - 1) +
                             ", beyond its row of " + std::to_string(p.table_stride) + " entries");
    for (int64_t e = sp.key_begin / p.block_rows; e <= (sp.key_begin + sp.key_rows - 1) / p.block_rows; ++e) {
        const int64_t block = p.table[s * p.table_stride + e];
        if (block < 0 || block >= p.num_blocks)
            return Status::error("block_table: " + sequence_text(s) + "entry " + std::to_string(e) + " is " +
                                 std::to_string(block) + ", outside the cache's blocks [0, " +
                                 std::to_string(p.num_blocks) + ")");
    }
    return Status::success();
}

// Lengths within the call's longest, and written rows of their own: each sequence's `written` rows after the
// previous one's.
Status check_spans(const SdpaForwardArgs& a, bool keys_written) {
    if (a.mask_kind != MaskKind::none) return Status::error("mask: not taken with packed sequences");
    if (a.key.pages.paged() != a.value.pages.paged())
        return Status::error("block_table: key and value must both be paged caches, or neither");
    if (a.key.pages.paged() && keys_written)
        return Status::error("block_table: a paged K/V cache has no backward (as flash-attn's kvcache call)");
    const SequenceSpan* spans = a.sequences.spans;
    for (int64_t s = 0; s < a.batch[0]; ++s) {
        const SequenceSpan& sp = spans[s];
        if (sp.query_begin < 0 || sp.query_rows < 0 || sp.key_begin < 0 || sp.key_rows < 0)
            return Status::error("sequences: " + sequence_text(s) + "offsets and lengths must be >= 0");
        if (sp.query_rows > a.seq_q || sp.key_rows > a.seq_kv)
            return Status::error("sequences: " + sequence_text(s) + "longer than the call's longest (seq_q " +
                                 std::to_string(a.seq_q) + ", seq_kv " + std::to_string(a.seq_kv) + ")");
        for (const TensorView* v : {&a.key, &a.value}) {
            Status blocks = check_table_row(v->pages, s, sp);
            if (!blocks.ok) return blocks;
        }
        if (s == 0) continue;
        const SequenceSpan& prev = spans[s - 1];
        if (sp.query_begin < prev.query_begin + prev.query_rows)
            return Status::error("sequences: " + sequence_text(s) +
                                 "its query rows overlap the previous sequence's (each writes rows of its own)");
        if (keys_written && sp.key_begin < prev.key_begin + prev.key_rows)
            return Status::error("sequences: " + sequence_text(s) +
                                 "its key rows overlap the previous sequence's (the backward writes dK and dV)");
    }
    return Status::success();
}

// The packed views as one dense call of a single batch index whose rows reach every sequence's, for the
// checks of dtypes, pointers, buffers and written rows that hold for the call as a whole.
SdpaForwardArgs envelope(const SdpaForwardArgs& a) {
    SdpaForwardArgs e = a;
    e.sequences = {};
    e.alignment = RowAlignment::as_given;
    e.batch[0] = 1;
    e.seq_q = e.seq_kv = 0;
    for (int64_t s = 0; s < a.batch[0]; ++s) {
        const SequenceSpan& sp = a.sequences.spans[s];
        e.seq_q = std::max(e.seq_q, sp.query_begin + sp.query_rows);
        e.seq_kv = std::max(e.seq_kv, sp.key_begin + sp.key_rows);
    }
    for (TensorView* v : {&e.query, &e.output, &e.stats}) v->strides[0] = 0;
    for (TensorView* v : {&e.key, &e.value}) {
        if (kv_fp8(v->quant.format)) v->quant.scales.strides[0] = 0;  // per sequence: each task checks its own
        if (v->pages.paged()) continue;  // a paged view's steps from block to block
        v->strides[0] = 0;
        for (KvQuantParams* p : {&v->quant.scales, &v->quant.zero_points}) p->strides[0] = 0;
    }
    e.key.pages.cols = a.head_dim_qk;
    e.value.pages.cols = a.head_dim_v;
    return e;
}

SdpaBackwardArgs envelope(const SdpaBackwardArgs& b) {
    SdpaBackwardArgs e = b;
    e.forward = envelope(b.forward);
    for (TensorView* v : {&e.grad_output, &e.grad_query, &e.grad_key, &e.grad_value}) v->strides[0] = 0;
    return e;
}

template <class Args, class Make>
Status admit_all(const Plan& plan, Make&& make, const DenseRunner<Args>& dense) {
    for (const Task& t : plan.tasks) {
        Status s = dense.admit(make(t), dense.context);
        if (!s.ok) return Status::error(sequence_text(t.first) + s.message);
    }
    return Status::success();
}

}  // namespace

SdpaForwardArgs with_alignment_resolved(const SdpaForwardArgs& args) {
    if (args.alignment == RowAlignment::as_given) return args;
    SdpaForwardArgs a = args;
    a.window.row_shift = aligned_row_shift(args.alignment, args.seq_q, args.seq_kv);
    a.alibi.bottom_right = args.alignment == RowAlignment::bottom_right;
    a.alignment = RowAlignment::as_given;
    return a;
}

Status run_packed_forward(const SdpaForwardArgs& a, const DenseForwardRunner& dense) {
    Status s = check_spans(a, false);
    if (!s.ok || !(s = check_forward_args(envelope(a))).ok) return s;
    const Plan plan = plan_tasks(a, forward_rules(a, dense));
    const std::vector<uint64_t> prefix = dropout_prefix(a);
    auto make = [&](const Task& t) { return dense_forward(a, t, prefix); };
    if (!(s = admit_all(plan, make, dense)).ok) return s;
    // Rows of sequences without keys: output 0, stats of the sink alone (-inf without sinks).
    const int64_t one[kBatchDims] = {1, a.batch[1], a.batch[2]};
    for (int64_t q = 0; q < a.batch[0] && dense.host_fills; ++q) {
        const SequenceSpan& sp = a.sequences.spans[q];
        if (sp.query_rows == 0 || sp.key_rows > 0) continue;
        zero_rows(a.output, one, sp.query_begin, sp.query_rows, a.head_dim_v);
        no_key_stats(a, q, sp.query_begin, sp.query_rows);
    }
    return run_tasks(plan, [&](size_t i) { return dense.run(make(plan.tasks[i]), dense.context); });
}

Status run_packed_backward(const SdpaBackwardArgs& b, const DenseBackwardRunner& dense) {
    const SdpaForwardArgs& a = b.forward;
    Status s = check_spans(a, true);
    if (!s.ok || !(s = check_backward_args(envelope(b))).ok) return s;
    if (b.grad_mask.data) return Status::error("grad_mask: not taken with packed sequences");
    const Plan plan = plan_tasks(a, backward_rules(dense));
    const std::vector<uint64_t> prefix = dropout_prefix(a);
    std::vector<SinkPart> sinks(b.grad_sinks.data ? plan.tasks.size() : 0);
    for (size_t i = 0; i < sinks.size(); ++i) sinks[i] = sink_part(b, plan.tasks[i]);
    auto make_at = [&](size_t i) { return dense_backward(b, plan.tasks[i], prefix, sinks.empty() ? nullptr : &sinks[i]); };
    for (size_t i = 0; i < plan.tasks.size(); ++i) {
        Status admitted = dense.admit(make_at(i), dense.context);
        if (!admitted.ok) return Status::error(sequence_text(plan.tasks[i].first) + admitted.message);
    }
    // Rows without keys have dQ = 0; keys without rows dK = dV = 0.
    const int64_t one[kBatchDims] = {1, a.batch[1], a.batch[2]};
    for (int64_t q = 0; q < a.batch[0] && dense.host_fills; ++q) {
        const SequenceSpan& sp = a.sequences.spans[q];
        if (sp.query_rows > 0 && sp.key_rows > 0) continue;
        zero_rows(b.grad_query, one, sp.query_begin, sp.query_rows, a.head_dim_qk);
        zero_rows(b.grad_key, one, sp.key_begin, sp.key_rows, a.head_dim_qk);
        zero_rows(b.grad_value, one, sp.key_begin, sp.key_rows, a.head_dim_v);
    }
    if (!(s = run_tasks(plan, [&](size_t i) { return dense.run(make_at(i), dense.context); })).ok) return s;
    if (!b.grad_sinks.data) return s;
    // grad_sinks: every element the call reaches starts at 0, then takes each task's part in task order.
    float* out = static_cast<float*>(const_cast<void*>(b.grad_sinks.data));
    const int64_t* gs = b.grad_sinks.strides;
    const int64_t reach[kBatchDims] = {gs[0] ? a.batch[0] : 1, gs[1] ? a.batch[1] : 1, gs[2] ? a.batch[2] : 1};
    for (int64_t x = 0; x < reach[0]; ++x)
        for (int64_t y = 0; y < reach[1]; ++y)
            for (int64_t z = 0; z < reach[2]; ++z) out[x * gs[0] + y * gs[1] + z * gs[2]] = 0.0f;
    for (size_t i = 0; i < plan.tasks.size(); ++i) {
        const Task& t = plan.tasks[i];
        const SinkPart& part = sinks[i];
        const int64_t n[kBatchDims] = {gs[0] ? t.count : 1, gs[1] ? t.heads : 1, gs[2] ? a.batch[2] : 1};
        for (int64_t x = 0; x < n[0]; ++x)
            for (int64_t y = 0; y < n[1]; ++y)
                for (int64_t z = 0; z < n[2]; ++z)
                    out[(t.first + x) * gs[0] + (t.head_begin + y) * gs[1] + z * gs[2]] +=
                        part.values[size_t(x * part.strides[0] + y * part.strides[1] + z * part.strides[2])];
    }
    return s;
}

namespace {

template <class Args, class Make>
std::string plan_text(const Plan& plan, int64_t sequences, Make&& make, const DenseRunner<Args>& dense) {
    std::string text = "layout=packed,sequences=" + std::to_string(sequences) +
                       ",team_calls=" + std::to_string(plan.tasks.size() - plan.pooled) +
                       ",pooled_tasks=" + std::to_string(plan.pooled) + ",threads=" + std::to_string(plan.threads);
    if (plan.tasks.empty()) return text;
    size_t largest = 0;
    for (size_t i = 1; i < plan.tasks.size(); ++i)
        if (plan.tasks[i].work > plan.tasks[largest].work) largest = i;
    return text + ",largest:" + dense.plan(make(largest), dense.context);
}

}  // namespace

std::string packed_forward_plan(const SdpaForwardArgs& a, const DenseForwardRunner& dense) {
    if (!check_spans(a, false).ok) return "layout=none";
    const Plan plan = plan_tasks(a, forward_rules(a, dense));
    const std::vector<uint64_t> prefix = dropout_prefix(a);
    return plan_text(plan, a.batch[0], [&](size_t i) { return dense_forward(a, plan.tasks[i], prefix); }, dense);
}

std::string packed_backward_plan(const SdpaBackwardArgs& b, const DenseBackwardRunner& dense) {
    if (!check_spans(b.forward, true).ok) return "layout=none";
    const Plan plan = plan_tasks(b.forward, backward_rules(dense));
    const std::vector<uint64_t> prefix = dropout_prefix(b.forward);
    return plan_text(plan, b.forward.batch[0],
                     [&](size_t i) { return dense_backward(b, plan.tasks[i], prefix, nullptr); }, dense);
}

}  // namespace graphattn
