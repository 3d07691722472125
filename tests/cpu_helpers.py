"""What the tests expect of this CPU, found apart from the library's own detection."""
import graphattn as ga
from graphattn.testing import cpuinfo_field


def bf16_pairs_expected() -> bool:
    """Whether the vector build takes bf16 products on pairs (VDPBF16PS) here: AMD CPUs with AVX512-BF16
    (lane_gemm_bf16.hpp's bf16_pairs_pay_off); Intel ones keep the f32 FMAs."""
    return "avx512_bf16" in ga.cpu_features() and cpuinfo_field("vendor_id") == "AuthenticAMD"
