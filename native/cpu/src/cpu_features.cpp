// CPUID-based feature detection.  A feature counts only when the OS also
// saves its register state (XCR0), otherwise its instructions would fault.
#include "graphattn/cpu_features.hpp"

#include <omp.h>

#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace graphattn {
namespace {

#if defined(__x86_64__) || defined(__i386__)
unsigned long long read_xcr0() {
    unsigned int eax = 0, edx = 0;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool bit(unsigned int reg, int index) { return (reg >> index) & 1u; }

CpuFeatures detect() {
    CpuFeatures f;
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
    f.amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
    const bool osxsave = bit(ecx, 27);
    const bool fma = bit(ecx, 12), f16c = bit(ecx, 29);
    if (!osxsave) return f;
    const unsigned long long xcr0 = read_xcr0();
    const bool ymm_state = (xcr0 & 0x6) == 0x6;
    const bool zmm_state = (xcr0 & 0xe6) == 0xe6;
    const bool tile_state = (xcr0 & 0x60000) == 0x60000;
    if (!ymm_state) return f;
    f.fma = fma;
    f.f16c = f16c;
    unsigned int max_leaf = __get_cpuid_max(0, nullptr);
    if (max_leaf < 7) return f;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    f.avx2 = bit(ebx, 5);
    if (zmm_state) {
        f.avx512f = bit(ebx, 16);
        f.avx512dq = bit(ebx, 17);
        f.avx512bw = bit(ebx, 30);
        f.avx512vl = bit(ebx, 31);
        f.avx512_fp16 = bit(edx, 23);
    }
    if (tile_state) {
        f.amx_bf16 = bit(edx, 22);
        f.amx_tile = bit(edx, 24);
    }
    unsigned int eax1, ebx1, ecx1, edx1;
    __cpuid_count(7, 1, eax1, ebx1, ecx1, edx1);
    if (zmm_state) f.avx512_bf16 = bit(eax1, 5);
    if (tile_state) f.amx_fp16 = bit(eax1, 21);
    return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

}  // namespace

const CpuFeatures& cpu_features() {
    static const CpuFeatures features = detect();
    return features;
}

bool amx_bf16_usable() {
    static const bool usable = [] {
        const CpuFeatures& f = cpu_features();
        if (!(f.amx_tile && f.amx_bf16 && f.avx512_bf16)) return false;
#if defined(__linux__)
        constexpr long kArchRequestXcompPerm = 0x1023;
        constexpr long kXfeatureTileData = 18;
        return syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
#else
        return false;
#endif
    }();
    return usable;
}

std::string cpu_features_string() {
    const CpuFeatures& f = cpu_features();
    std::string out;
    auto add = [&out](bool present, const char* name) {
        if (!present) return;
        if (!out.empty()) out += ' ';
        out += name;
    };
    add(f.avx2, "avx2");
    add(f.fma, "fma");
    add(f.f16c, "f16c");
    add(f.avx512f, "avx512f");
    add(f.avx512bw, "avx512bw");
    add(f.avx512vl, "avx512vl");
    add(f.avx512dq, "avx512dq");
    add(f.avx512_bf16, "avx512_bf16");
    add(f.avx512_fp16, "avx512_fp16");
    add(f.amx_tile, "amx_tile");
    add(f.amx_bf16, "amx_bf16");
    add(f.amx_fp16, "amx_fp16");
    return out;
}

int max_threads() { return omp_get_max_threads(); }

}  // namespace graphattn
