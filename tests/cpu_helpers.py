"""What the tests expect of this CPU, found apart from the library's own detection."""
import pytest

import graphattn as ga
from graphattn.testing import cpuinfo_field


# The dtype class each AMX candidate takes (the vector builds take all three).
AMX_DTYPES = {"amx_bf16": ("bf16",), "amx_bf16x3": ("f16",), "amx_bf16x6": ("f32",)}


def bf16_pairs_expected() -> bool:
    """Whether the vector build takes bf16 products on pairs (VDPBF16PS) here: AMD CPUs with AVX512-BF16
    (lane_gemm_bf16.hpp's bf16_pairs_pay_off); Intel ones keep the f32 FMAs."""
    return "avx512_bf16" in ga.cpu_features() and cpuinfo_field("vendor_id") == "AuthenticAMD"


def missing_here(kernel: str) -> str:
    """Why this CPU cannot run the kernel candidate of that name on some pass that has it ("" where it can)."""
    for pass_name in ga.kernel_choice.PASSES:
        missing = dict(ga.kernel_candidates(pass_name)).get(kernel)
        if missing:
            return f"{pass_name} kernel {kernel} cannot run on this CPU: {missing}"
    return ""


def skip_unless_runs_here(kernel: str) -> None:
    """Skips the calling test, saying why, where this CPU lacks what the kernel candidate needs."""
    why = missing_here(kernel)
    if why:
        pytest.skip(why)
