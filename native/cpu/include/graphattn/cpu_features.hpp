// Runtime detection of the x86 ISA extensions the kernels can dispatch on.
#pragma once

#include <string>

namespace graphattn {

struct CpuFeatures {
    bool avx2 = false;
    bool fma = false;
    bool f16c = false;
    bool avx512f = false;
    bool avx512bw = false;
    bool avx512vl = false;
    bool avx512dq = false;
    bool avx512_bf16 = false;
    bool avx512_fp16 = false;
    bool amx_tile = false;
    bool amx_bf16 = false;
    bool amx_fp16 = false;
    bool amd = false;  // the vendor, where the same instructions run at other rates (lane_gemm_bf16.hpp)
};

// Detected once, then cached.
const CpuFeatures& cpu_features();

// True when the CPU has AMX-BF16 and the OS lets this process use the tile
// state (on Linux it must be requested once with arch_prctl).
bool amx_bf16_usable();

// Space-separated names of the detected features, for diagnostics.
std::string cpu_features_string();

// Number of OpenMP threads a parallel region will use.
int max_threads();

}  // namespace graphattn
