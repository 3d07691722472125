// Per-thread scratch memory, 64-byte aligned, allocated once per parallel
// region and zero-initialised (padding lanes must read as 0, never garbage);
// a count of 0 allocates nothing.
// Small blocks are kept by the thread that frees them and handed out again
// for the next request of the same size class: on decode-sized calls, malloc
// and free of each thread's scratch took about a third of the kernel's time
// (perf, (1,2,1,1,64) f32: malloc_consolidate, _int_malloc, _int_free).
// Sizes are rounded up to eight classes per doubling, so that the calls of a
// decode loop, whose key count grows by one each step, keep finding a block:
// exact sizes made each new length allocate (and first touch) fresh memory.
#pragma once

#include <atomic>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "isa_namespace.hpp"

namespace graphattn {
extern std::atomic<bool> g_poison_scratch;  // set_scratch_poisoning (dispatch.cpp)
namespace GRAPHATTN_ISA_NS {

// Blocks freed by one thread, kept for its later requests of the same size.
// Bounded, so that what one call leaves behind stays small: blocks up to
// kMaxBlockBytes, kMaxHeldBytes in all (every thread holds its own).
class ThreadBlockCache {
public:
    static constexpr size_t kMaxBlockBytes = size_t(256) << 10;
    static constexpr size_t kMaxHeldBytes = size_t(1) << 20;
    static constexpr int kSlots = 32;

    // A kept block of exactly `bytes`, or nullptr.
    void* take(size_t bytes) {
        for (int i = 0; i < kSlots; ++i)
            if (slots_[i].block && slots_[i].bytes == bytes) {
                void* block = slots_[i].block;
                slots_[i].block = nullptr;
                held_ -= bytes;
                return block;
            }
        return nullptr;
    }

    // Keeps `block` if it fits the bounds; false when the caller must free it.
    bool keep(void* block, size_t bytes) {
        if (bytes > kMaxBlockBytes || held_ + bytes > kMaxHeldBytes) return false;
        for (int i = 0; i < kSlots; ++i)
            if (!slots_[i].block) {
                slots_[i] = {block, bytes};
                held_ += bytes;
                return true;
            }
        return false;
    }

    ~ThreadBlockCache() {
        for (const Slot& s : slots_)
            if (s.block) ::operator delete[](s.block, std::align_val_t(64));
    }

    static ThreadBlockCache& of_this_thread() {
        thread_local ThreadBlockCache cache;
        return cache;
    }

private:
    struct Slot {
        void* block = nullptr;
        size_t bytes = 0;
    };
    Slot slots_[kSlots];
    size_t held_ = 0;
};

// With scratch poisoning on (set_scratch_poisoning, sdpa.hpp), buffers that
// are not cleared start as NaN, so that a kernel reading what it never wrote
// shows in its results (the test suite turns it on).
inline bool poison_scratch() { return graphattn::g_poison_scratch.load(std::memory_order_relaxed); }

class AlignedFloats {
public:
    explicit AlignedFloats(size_t count, bool zero = true) : data_(allocate(bytes(count))), bytes_(bytes(count)) {
        if (bytes_ == 0) return;  // the buffers a kernel variant does not use
        if (zero)
            std::memset(data_, 0, bytes_);
        else if (poison_scratch())
            std::memset(data_, 0xff, bytes_);  // NaN in every float
    }
    AlignedFloats() : data_(nullptr), bytes_(0) {}

    // Without the zero fill, for large buffers that are written in parallel
    // before being read (their pages are then first touched by the threads
    // that use them, and no single thread pays for clearing them).
    static AlignedFloats uninitialized(size_t count) { return AlignedFloats(count, false); }
    ~AlignedFloats() { release(); }
    AlignedFloats(const AlignedFloats&) = delete;
    AlignedFloats& operator=(const AlignedFloats&) = delete;
    AlignedFloats(AlignedFloats&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
        other.data_ = nullptr;
    }
    AlignedFloats& operator=(AlignedFloats&& other) noexcept {
        if (this != &other) {
            release();
            data_ = other.data_;
            bytes_ = other.bytes_;
            other.data_ = nullptr;
        }
        return *this;
    }
    float* get() const { return data_; }
    // The same storage as 32-bit words (bf16 pairs, lane_gemm_bf16.hpp), for buffers only ever read that way.
    uint32_t* words() const { return reinterpret_cast<uint32_t*>(data_); }

private:
    static float* allocate(size_t bytes) {
        if (bytes == 0) return nullptr;  // a buffer the kernel's variant does not use
        ThreadBlockCache& cache = ThreadBlockCache::of_this_thread();
        void* block = bytes <= ThreadBlockCache::kMaxBlockBytes ? cache.take(bytes) : nullptr;
        return static_cast<float*>(block ? block : ::operator new[](bytes, std::align_val_t(64)));
    }
    void release() {
        if (!data_) return;
        const bool kept =
            bytes_ <= ThreadBlockCache::kMaxBlockBytes && ThreadBlockCache::of_this_thread().keep(data_, bytes_);
        if (!kept) ::operator delete[](data_, std::align_val_t(64));
    }
    // The block size for `count` floats: whole 64-byte lines, then rounded up
    // to a multiple of an eighth of the largest power of two at or below it
    // (at most 1/8 more than asked).
    static size_t bytes(size_t count) {
        const size_t lines = ((count * sizeof(float) + 63) / 64) * 64;
        if (lines <= 512) return lines;
        size_t power = 512;
        while (power * 2 <= lines) power *= 2;
        const size_t step = power / 8;
        return (lines + step - 1) / step * step;
    }
    float* data_;
    size_t bytes_;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
