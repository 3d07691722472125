// Per-thread scratch memory, 64-byte aligned, allocated once per parallel
// region and zero-initialised (padding lanes must read as 0, never garbage).
#pragma once

#include <cstddef>
#include <cstring>
#include <new>

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

class AlignedFloats {
public:
    explicit AlignedFloats(size_t count, bool zero = true)
        : data_(static_cast<float*>(::operator new[](bytes(count), std::align_val_t(64)))) {
        if (zero) std::memset(data_, 0, bytes(count));
    }
    AlignedFloats() : data_(nullptr) {}

    // Without the zero fill, for large buffers that are written in parallel
    // before being read (their pages are then first touched by the threads
    // that use them, and no single thread pays for clearing them).
    static AlignedFloats uninitialized(size_t count) { return AlignedFloats(count, false); }
    ~AlignedFloats() { release(); }
    AlignedFloats(const AlignedFloats&) = delete;
    AlignedFloats& operator=(const AlignedFloats&) = delete;
    AlignedFloats(AlignedFloats&& other) noexcept : data_(other.data_) { other.data_ = nullptr; }
    AlignedFloats& operator=(AlignedFloats&& other) noexcept {
        if (this != &other) {
            release();
            data_ = other.data_;
            other.data_ = nullptr;
        }
        return *this;
    }
    float* get() const { return data_; }

private:
    void release() {
        if (data_) ::operator delete[](data_, std::align_val_t(64));
    }
    static size_t bytes(size_t count) { return ((count * sizeof(float) + 63) / 64) * 64; }
    float* data_;
};

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
