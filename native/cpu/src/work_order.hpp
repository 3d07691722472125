// The order in which the kernels hand out their (batch index, block) work
// items to dynamically scheduled threads.
//
// Under a causal mask the blocks of one batch index differ in work (query
// blocks lower down see more keys; key blocks further left are seen by more
// query rows).  Where threads get few items, handing out every batch index's
// longest block first, then every second longest, and so on, leaves the
// short items for last, where they even out the threads' finishing times;
// going batch index by batch index instead would end on some long items (16
// batch indices of 8 query blocks on 16 threads: the last thread finishes
// about 11% after the average).  With many items per thread that imbalance
// is small, and batch-major order keeps neighbouring items on the same K/V.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include <omp.h>

#include "graphattn/key_window.hpp"
#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

constexpr int64_t kLongestFirstMaxItemsPerThread = 32;

// Runs body() on a team of `team` threads, or straight on this thread when
// the team would be one: libgomp's region of one thread still cost about
// 0.3 us, a tenth of a decode-sized call.  The body's worksharing loops then
// run orphaned, which OpenMP defines as running on this thread alone.
template <class Body>
void run_on_team(int team, Body&& body) {
    if (team <= 1) {
        body();
        return;
    }
#pragma omp parallel num_threads(team)
    body();
}

// Runs body() on the first `team` threads of a region that takes every thread
// of the OpenMP pool; the others leave at once.  libgomp ends the threads a
// smaller region leaves out and starts them again for the next larger one, so
// regions of varying size on one pool cost thread starts, which a host
// framework on the same libgomp (torch) then pays in its next operation
// (docs/performance-history.md, "Forward regions on the whole thread pool").  Only for
// bodies without worksharing loops or barriers, which every thread of a region
// must reach.
template <class Body>
void run_on_pool(int team, Body&& body) {
    if (team <= 1) {
        body();
        return;
    }
#pragma omp parallel num_threads(omp_get_max_threads())
    if (omp_get_thread_num() < team) body();
}

// Threads for `items` work items: no more than there are items, since each
// thread sets up its own scratch.  A call with several parallel regions
// gives them all one team: libgomp puts the threads a smaller region leaves
// out to sleep, and waking them again for the next region costs a small
// call several times its own time.
inline int team_for_items(int64_t items) { return int(std::clamp<int64_t>(items, 1, omp_get_max_threads())); }

// Whether `items` work items of unequal work go longest first (see above).
inline bool longest_first(bool unequal_work, int64_t items, int64_t threads) {
    return unequal_work && items < kLongestFirstMaxItemsPerThread * threads;
}

// Units [0, units) handed out home first: thread t of a team of T owns the
// units [t * units / T, (t + 1) * units / T), takes them from the front and,
// out of its own, takes the other threads' units from the back.  With one
// shared counter (schedule(dynamic, 1)) whichever thread comes first takes
// the next unit, so a call repeated on the same K/V finds its blocks in
// another core's cache; home units go to the same thread call after call,
// and neighbouring units (the query blocks of one batch index) to one thread,
// which finds their K/V in its own cache after the first.  Taking from the
// others still evens out threads that run slower, at the end of their work,
// not the start.  Items of unequal work (causal) and the AMX forward's
// last-wave pieces keep the shared counter: they rely on its order (longest
// first, pieces last).  Where such
// items still want a home, the units go to groups of threads instead, each
// group's threads taking its units in order from one counter of their own
// (the AMX forward's causal items with kept K/V blocks).
class HomeFirstUnits {
public:
    // home = false: every thread takes the next unit of one shared counter.
    // groups > 0: the units go to that many groups of threads (thread t in group t * groups / team) instead
    // of to each thread.
    HomeFirstUnits(int64_t units, int team, bool home, int groups = 0)
        : units_(units),
          team_(team),
          owner_count_(groups > 0 ? std::min(groups, team) : team),
          home_(home && units < (int64_t(1) << 31)),
          owners_(home_ ? new Owner[size_t(owner_count_)] : nullptr) {
        for (int t = 0; home_ && t < owner_count_; ++t) {
            const int64_t begin = units * t / owner_count_, end = units * (t + 1) / owner_count_;
            owners_[t].begin = begin;
            owners_[t].range.store(uint64_t(end - begin), std::memory_order_relaxed);
        }
    }

    // Runs body(unit) for every unit this thread takes; every thread of the
    // team calls it.  No barrier at the end.
    template <class Body>
    void for_each(Body&& body) {
        if (!home_) {
            for (int64_t unit; (unit = shared_.fetch_add(1, std::memory_order_relaxed)) < units_;) body(unit);
            return;
        }
        const int self = omp_get_thread_num() * owner_count_ / team_;  // 0 where run_on_team ran the body alone
        for (int i = 0; i < owner_count_; ++i)
            for (int64_t unit; (unit = owners_[(self + i) % owner_count_].take(i == 0)) >= 0;) body(unit);
    }

private:
    struct alignas(64) Owner {
        int64_t begin = 0;
        std::atomic<uint64_t> range{0};  // units taken from the front << 32 | end of the units not taken

        // The owner's next unit from the front, or another thread's from the back; -1 once none is left.
        int64_t take(bool front) {
            uint64_t r = range.load(std::memory_order_relaxed);
            for (;;) {
                const uint64_t first = r >> 32, end = r & 0xffffffffu;
                if (first >= end) return -1;
                const uint64_t next = front ? r + (uint64_t(1) << 32) : r - 1;
                if (range.compare_exchange_weak(r, next, std::memory_order_relaxed))
                    return begin + int64_t(front ? first : end - 1);
            }
        }
    };
    int64_t units_;
    int team_;
    int owner_count_;
    bool home_;
    std::unique_ptr<Owner[]> owners_;
    alignas(64) std::atomic<int64_t> shared_{0};
};

struct WorkItem {
    int64_t batch;  // flat batch index
    int64_t rank;   // the block's place within its batch index, 0 first
};

// Item w of batches x blocks items: all batch indices' rank-0 blocks first
// when by_rank (longest_first), else batch-major.  Callers map rank 0 to
// their longest block under a causal mask.
inline WorkItem work_item(int64_t w, int64_t batches, int64_t blocks, bool by_rank) {
    if (by_rank) return {w % batches, w / batches};
    return {w / blocks, w % blocks};
}

// The last wave of equal work items handed out in pieces.  The cores of a
// shared machine do not run at one speed, and dynamic scheduling evens out
// the threads' finishing times only down to the size of the items handed out
// last.
struct LastWave {
    int64_t items, item_rows;
    int64_t whole;        // items handed out whole, first
    int64_t pieces = 1;   // pieces per item of the last wave
    int64_t piece_rows;   // rows per piece

    // Units of work handed out: the whole items, then every piece.
    int64_t units() const { return whole + (items - whole) * pieces; }

    struct Unit {
        int64_t item, first_row, rows;  // first_row within the item
    };
    Unit unit(int64_t u) const {
        if (u < whole) return {u, 0, item_rows};
        return {whole + (u - whole) / pieces, (u - whole) % pieces * piece_rows, piece_rows};
    }
};

// `items` items of item_rows rows each for `threads` threads: the last
// `threads` items in pieces of piece_rows rows, where the items hold equal
// work and are larger than that.
inline LastWave last_wave_in_pieces(int64_t items, int64_t item_rows, int64_t threads, int64_t piece_rows,
                                    bool equal_work) {
    if (!equal_work || item_rows <= piece_rows || items <= threads) return {items, item_rows, items, 1, item_rows};
    return {items, item_rows, items - threads, item_rows / piece_rows, piece_rows};
}

// How a forward call's work is laid out, for the verbose log: comma-separated
// key=value fields with no spaces.  `order` names the hand-out order:
// home_first (HomeFirstUnits), batch_groups (HomeFirstUnits' groups),
// longest_first or batch_major (one shared counter), with "+pieces" where
// the last wave goes in pieces and "+kept_kv" where threads keep their
// packed K/V blocks (the AMX forward).
inline std::string work_plan_text(const char* layout, int64_t item_rows, int64_t items, int64_t key_splits,
                                  int64_t keys_per_split, int team, const std::string& order) {
    return std::string("layout=") + layout + ",item_rows=" + std::to_string(item_rows) +
           ",items=" + std::to_string(items) + ",key_splits=" + std::to_string(key_splits) +
           ",keys_per_split=" + std::to_string(keys_per_split) + ",threads=" + std::to_string(team) +
           ",order=" + order;
}

// The hand-out order's name for work_plan_text.
inline std::string order_name(bool home, bool by_rank, bool groups = false) {
    if (groups) return "batch_groups";
    return home ? "home_first" : (by_rank ? "longest_first" : "batch_major");
}

// How a backward's key pass is laid out, for the verbose log (fields as
// work_plan_text's): items of a K/V batch index's key blocks, `key_splits`
// per index, their dQ buffers, and the hand-out order (the last wave in
// pieces of one key block, or of piece_blocks).
inline std::string key_pass_text(const char* layout, int64_t key_block, int64_t kv_items, int64_t key_splits,
                                 int64_t dq_buffer_floats, int team, int64_t piece_blocks = 1) {
    return std::string("layout=") + layout + ",key_block=" + std::to_string(key_block) +
           ",kv_items=" + std::to_string(kv_items) + ",key_splits=" + std::to_string(key_splits) +
           ",dq_buffers_kib=" + std::to_string(dq_buffer_floats * 4 / 1024) + ",threads=" + std::to_string(team) +
           ",order=batch_major+pieces" + (piece_blocks == 1 ? "" : "_of_" + std::to_string(piece_blocks));
}

// Turns at dQ's rows for the pieces of the backwards' last wave, so that
// every call sums dQ in one order, bitwise alike however its pieces meet.
// Each dQ row takes the adds of its item's key blocks in their order, the
// order of a whole item: a block's add to a row waits until the row's
// counter, the number of the item's blocks that have added to it, reaches
// the block's ordinal among the blocks that add to the row.  Those are a run
// of the item's blocks (both ends of a row's key window only move on as the
// row does), starting after the blocks wholly before the row's first visible
// key (UnseenBlocks), so that count is reached.  Pieces are
// handed out in ascending order, so each block waits only on blocks already
// taken.  Rows are counted in `rows` counters, one per dQ sum row (split,
// batch index, row), laid out by the kernel.
class DqTurns {
public:
    explicit DqTurns(int64_t rows) : counters_(new std::atomic<int32_t>[size_t(rows)]) {
        for (int64_t r = 0; r < rows; ++r) counters_[r].store(0, std::memory_order_relaxed);
    }

    // Waits until counter r holds turn_of(r) for r in [row, row + count);
    // false (no turn: skip the add) once the call is abandoned.
    template <class TurnOf>
    bool wait(int64_t row, int64_t count, TurnOf turn_of) const {
        for (int64_t r = row; r < row + count; ++r) {
            const int32_t turn = turn_of(r);
            for (int spins = 0; counters_[r].load(std::memory_order_acquire) != turn; ++spins) {
                if (abandoned_.load(std::memory_order_relaxed)) return false;
                if (spins > 64) std::this_thread::yield();  // the predecessor's thread may be descheduled
            }
        }
        return true;
    }

    // The block whose turn at counter r was turn_of(r) has added to counters [row, row + count).
    template <class TurnOf>
    void done(int64_t row, int64_t count, TurnOf turn_of) {
        for (int64_t r = row; r < row + count; ++r) counters_[r].store(turn_of(r) + 1, std::memory_order_release);
    }

    // A piece stopped short (the AMX build met an infinity and its call will
    // be rerun): no one waits any more.
    void abandon() { abandoned_.store(true, std::memory_order_relaxed); }

private:
    std::unique_ptr<std::atomic<int32_t>[]> counters_;
    std::atomic<bool> abandoned_{false};
};

// The blocks of an item (key blocks split, split + splits, ... of
// block_keys keys each) that end before query row i's first visible key:
// under a window with a left limit they add nothing to the row, so its turns
// start after them.  None where hidden blocks are not skipped.
struct UnseenBlocks {
    KeyWindow window;
    int64_t seq_kv = 0, block_keys = 1, split = 0, splits = 1;
    bool skipped = false;

    int32_t before(int64_t i) const {
        if (!skipped || !window.limits_left()) return 0;
        const int64_t whole = window.key_begin(i, seq_kv) / block_keys;  // blocks 0 .. whole - 1 end before it
        return whole > split ? int32_t((whole - split + splits - 1) / splits) : 0;
    }
};

// One key block's turn at its item's dQ rows: no turns for a whole item;
// else the DqTurns counter of its split's first dQ row (counter_base), the
// block's ordinal in the item, and the item's blocks each row does not see.
// Rows are counted from counter_base.
struct DqTurn {
    DqTurns* turns = nullptr;
    int64_t counter_base = 0;
    int32_t ordinal = 0;
    UnseenBlocks unseen;

    // Waits for the turn at dQ sum rows [row, row + count), whose query rows
    // are query_row + (r - row) * query_step (0: one turn for a chunk of rows,
    // each counted from the chunk's first row); false: skip the add.
    bool begin(int64_t row, int64_t count, int64_t query_row, int64_t query_step) const {
        return !turns || turns->wait(counter_base + row, count, TurnOf{this, counter_base + row, query_row, query_step});
    }
    void end(int64_t row, int64_t count, int64_t query_row, int64_t query_step) const {
        if (turns) turns->done(counter_base + row, count, TurnOf{this, counter_base + row, query_row, query_step});
    }

private:
    // The block's turn at counter r: its ordinal less the blocks the counter's query row does not see.
    struct TurnOf {
        const DqTurn* turn;
        int64_t first_counter, query_row, query_step;
        int32_t operator()(int64_t r) const {
            return turn->ordinal - turn->unseen.before(query_row + (r - first_counter) * query_step);
        }
    };
};

// The backwards' items: item w takes split w % splits of a K/V batch index,
// the key blocks split, split + splits, ... < key_blocks, and sums its dQ
// into rows of its own.  The last item per thread (LastWave says why) goes
// in pieces of its key blocks, handed out round those items so that few
// pieces of one item run at once; the pieces of an item take DqTurns at its
// dQ rows.  A piece is one key block, or up to
// max_piece_blocks where the wave still gives every thread four pieces: a
// backward that reads each chunk of query rows once for several key blocks
// keeps that saving; with fewer pieces per thread, large pieces leave the
// threads' finishing times uneven again.
class KeyBlockWave {
public:
    // dq_rows: the dQ sum rows of all items, for the pieces' DqTurns.
    KeyBlockWave(int64_t items, int64_t splits, int64_t key_blocks, int64_t threads, int64_t dq_rows,
                 int64_t max_piece_blocks = 1)
        : splits_(splits),
          key_blocks_(key_blocks),
          wave_(std::min(items, threads)),
          whole_(items - wave_),
          piece_blocks_(piece_blocks(items, splits, key_blocks, threads, max_piece_blocks)),
          pieces_(((key_blocks + splits - 1) / splits + piece_blocks_ - 1) / piece_blocks_) {
        if (wave_ > 0 && pieces_ > 1) turns_.reset(new DqTurns(dq_rows));
    }

    // Key blocks per piece of the wave (for these arguments, and for the verbose log).
    static int64_t piece_blocks(int64_t items, int64_t splits, int64_t key_blocks, int64_t threads,
                                int64_t max_piece_blocks) {
        const int64_t wave = std::min(items, threads);
        const int64_t item_blocks = (key_blocks + splits - 1) / splits;
        return wave * ((item_blocks + max_piece_blocks - 1) / max_piece_blocks) >= 4 * threads ? max_piece_blocks : 1;
    }

    // Units of work handed out: the whole items, then every piece.
    int64_t units() const { return whole_ + wave_ * pieces_; }

    // Unit u: item `item` over key blocks first, first + splits, ... < end;
    // `turns` is null for a whole item (no other unit adds to its rows).
    struct Unit {
        int64_t item, first, end;
        DqTurns* turns;
        // The ordinal of key block kb among its item's blocks (its DqTurns turn).
        int32_t ordinal(int64_t kb, int64_t splits) const { return int32_t((kb - item % splits) / splits); }
    };
    Unit unit(int64_t u) const {
        if (u < whole_) return {u, u % splits_, key_blocks_, nullptr};
        const int64_t item = whole_ + (u - whole_) % wave_;
        const int64_t block = item % splits_ + (u - whole_) / wave_ * piece_blocks_ * splits_;
        return {item, block, std::min(block + piece_blocks_ * splits_, key_blocks_), turns_.get()};
    }

    // Pieces stop waiting for each other (see DqTurns::abandon).
    void abandon() const {
        if (turns_) turns_->abandon();
    }

private:
    int64_t splits_, key_blocks_, wave_, whole_, piece_blocks_, pieces_;
    std::unique_ptr<DqTurns> turns_;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
