// Per-thread scratch memory, 64-byte aligned and zero-initialised (padding
// lanes must read as 0, never garbage).  Freed blocks stay with the thread
// that frees them, up to a small total, for its next allocation of the same
// size: a kernel call allocates the same scratch on every call, and the
// allocator's large-block path cost about a fifth of a decode-sized call.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

class ThreadBlockCache {
public:
    // A held block of exactly `bytes`, or nullptr.
    void* take(size_t bytes) {
        for (int i = 0; i < count_; ++i)
            if (blocks_[i].bytes == bytes) {
                void* p = blocks_[i].data;
                held_ -= bytes;
                blocks_[i] = blocks_[--count_];
                return p;
            }
        return nullptr;
    }
    // Keeps the block if there is room; false when the caller must free it.
    bool keep(void* data, size_t bytes) {
        if (count_ == kMaxBlocks || held_ + bytes > kMaxHeldBytes) return false;
        blocks_[count_++] = {data, bytes};
        held_ += bytes;
        return true;
    }
    ~ThreadBlockCache() {
        for (int i = 0; i < count_; ++i) ::operator delete[](blocks_[i].data, std::align_val_t(64));
    }

private:
    static constexpr int kMaxBlocks = 32;
    static constexpr size_t kMaxHeldBytes = size_t(2) << 20;  // per thread
    struct Block {
        void* data;
        size_t bytes;
    };
    Block blocks_[kMaxBlocks];
    int count_ = 0;
    size_t held_ = 0;
};

inline thread_local ThreadBlockCache thread_block_cache;

class AlignedFloats {
public:
    explicit AlignedFloats(size_t count, bool zero = true) : bytes_(bytes(count)), data_(allocate(bytes_)) {
        if (zero) std::memset(data_, 0, bytes_);
    }
    AlignedFloats() : bytes_(0), data_(nullptr) {}

    // Without the zero fill, for large buffers that are written in parallel
    // before being read (their pages are then first touched by the threads
    // that use them, and no single thread pays for clearing them).
    static AlignedFloats uninitialized(size_t count) { return AlignedFloats(count, false); }
    ~AlignedFloats() { release(); }
    AlignedFloats(const AlignedFloats&) = delete;
    AlignedFloats& operator=(const AlignedFloats&) = delete;
    AlignedFloats(AlignedFloats&& other) noexcept : bytes_(other.bytes_), data_(other.data_) { other.data_ = nullptr; }
    AlignedFloats& operator=(AlignedFloats&& other) noexcept {
        if (this != &other) {
            release();
            bytes_ = other.bytes_;
            data_ = other.data_;
            other.data_ = nullptr;
        }
        return *this;
    }
    float* get() const { return data_; }

private:
    static float* allocate(size_t bytes) {
        if (void* held = thread_block_cache.take(bytes)) return static_cast<float*>(held);
        return static_cast<float*>(::operator new[](bytes, std::align_val_t(64)));
    }
    void release() {
        if (data_ && !thread_block_cache.keep(data_, bytes_)) ::operator delete[](data_, std::align_val_t(64));
    }
    static size_t bytes(size_t count) { return ((count * sizeof(float) + 63) / 64) * 64; }
    size_t bytes_;
    float* data_;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
