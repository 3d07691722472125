"""One K/V row reader: the kernels and packers, CPU and SYCL, find and decode key and value rows only through
graphattn/kv_rows.hpp (the layout) and its readers (native/cpu/src/kv_reader.hpp, the SYCL device helpers), so
a new cache layout changes the readers and not the kernels.  The rule is checked on the sources, and the reader's
paths on data: K and V in every dtype, with strided columns, broadcast over a GQA group, and offset views."""
import pathlib
import re

import numpy as np

import pytest

import graphattn as ga
from graphattn.testing import random_array
from test_kernel_table import _candidate_params, automatic_choice  # noqa: F401 (a fixture)
from test_window import _check_call

NATIVE = pathlib.Path(__file__).resolve().parents[1] / "native"

# The files that read K/V rows: every kernel and packer.  The reader's own files and those that only check or
# re-base whole views (args_check.cpp, packed_sequences.cpp) are not among them.
KERNEL_FILES = [
    "cpu/src/sdpa_forward_lanes.hpp",
    "cpu/src/sdpa_backward_lanes.hpp",
    "cpu/src/sdpa_forward_amx.cpp",
    "cpu/src/sdpa_backward_amx.cpp",
    "cpu/src/row_layout_blocks.hpp",
    "cpu/src/amx_packing.hpp",
    "cpu/src/lane_gemm_bf16.hpp",
    "cpu/src/kv_grouping.hpp",
    "cpu/src/block_io.hpp",
    "sycl/kernels/sdpa_forward.cpp",
    "sycl/kernels/sdpa_forward_xmx.cpp",
    "sycl/kernels/sdpa_backward.cpp",
]
# A K or V view's strides or data read directly: `key.strides`, `a.value.data`, `p.key.strides`, `k.strides`, ...
DIRECT_KV_ACCESS = re.compile(r"(?<![\w.])(?:\w+\.)?(?:key|value|k|v)\.(?:strides|data)\b")


@pytest.mark.parametrize("path", KERNEL_FILES)
def test_kernels_reach_kv_rows_only_through_the_reader(path):
    text = (NATIVE / path).read_text()
    code = "\n".join(line.split("//")[0] for line in text.splitlines())  # comments may name the strides
    found = sorted(set(DIRECT_KV_ACCESS.findall(code)))
    assert not found, f"{path} reads K/V views directly ({found}); use the K/V reader (kv_reader.hpp, KvRows)"


def test_the_rule_sees_a_direct_read():
    assert DIRECT_KV_ACCESS.findall("x = a.key.strides[3] + k.data + p.value.strides[4];") == [
        "a.key.strides", "k.data", "p.value.strides"]
    assert not DIRECT_KV_ACCESS.findall("b.grad_key.strides[3]; kv.layout.row_stride; q.strides[3]")


def _kv_views(layout, dtype, rng, B, H_kv, S, D, Dv):
    """K and V as the reader must take them: contiguous; head-major with strided columns (every other element
    of a wider buffer); rows 5 .. 5 + S of a longer token-major cache, seen head-major."""
    if layout == "contiguous":
        return random_array((B, H_kv, S, D), dtype, rng), random_array((B, H_kv, S, Dv), dtype, rng)
    if layout == "strided_columns":
        return (random_array((B, H_kv, S, 2 * D), dtype, rng)[..., ::2],
                random_array((B, H_kv, S, 2 * Dv), dtype, rng)[..., ::2])
    return tuple(random_array((B, S + 11, H_kv, d), dtype, rng)[:, 5:5 + S].transpose(0, 2, 1, 3) for d in (D, Dv))


# (B, H_q, H_kv, L, S, D, Dv, options): odd lengths, GQA, decode, a causal prefill of several key blocks
KV_CASES = [
    (2, 4, 2, 37, 133, 40, 24, {}),
    (1, 8, 2, 1, 301, 64, 64, dict(window=(100, 0), causal_alignment="bottom_right")),
    (1, 2, 1, 70, 290, 32, 48, dict(is_causal=True, causal_alignment="bottom_right")),
]


def _kv_params():
    return [pytest.param(pass_name, layout, *p.values, marks=p.marks, id=f"{pass_name}-{layout}-{p.id}")
            for pass_name in ("forward", "backward") for p in _candidate_params(pass_name)
            for layout in ("contiguous", "strided_columns", "cache_window")]


@pytest.mark.parametrize("pass_name,layout,name,dtype", _kv_params())
def test_each_candidate_reads_kv_views(pass_name, layout, name, dtype, rng):
    """Each forced candidate of each pass against the float64 reference (forward, stats and backward), K and
    V in each layout; the other pass takes its automatic choice."""
    with ga.force_kernel(**{pass_name: name}):
        for B, H, H_kv, L, S, D, Dv, options in KV_CASES:
            k, v = _kv_views(layout, dtype, rng, B, H_kv, S, D, Dv)
            _check_call(random_array((B, H, L, D), dtype, rng), k, v, None, dtype, rng, **options)


# Token-major K/V (each token's heads side by side, rows a stride apart): (B, H_q, H_kv, L, S, D, Dv, options),
# query rows few enough for the row layout, whose blocks the reader copies adjacent: GQA decode; MHA with odd head
# sizes (rows copied to f32, not read in place) and a softcap; speculative rows under bottom-right causal whose keys
# split; a window with ALiBi and sinks; an explicit float mask.
TOKEN_MAJOR_CASES = [
    (4, 8, 4, 1, 777, 64, 64, {}),
    (2, 12, 12, 1, 333, 40, 24, dict(softcap=5.0)),
    (1, 8, 2, 3, 1030, 64, 64, dict(is_causal=True, causal_alignment="bottom_right")),
    (3, 6, 3, 1, 500, 32, 32, dict(window=(200, 0), causal_alignment="bottom_right")),
    (2, 4, 2, 2, 260, 64, 64, dict(mask="float")),
]


def _vector_forward_params():
    return [p for p in _candidate_params("forward") if not p.values[0].startswith("amx")]


@pytest.mark.parametrize("name,dtype", [pytest.param(*p.values, marks=p.marks, id=p.id)
                                        for p in _vector_forward_params()])
def test_row_layout_reads_token_major_rows(name, dtype, rng):
    """Each vector build forced (the row layout: decode and short query blocks), K and V token-major: the
    float64 reference, forward and backward, with ALiBi and sinks on the windowed case."""
    with ga.force_kernel(forward=name):
        for B, H, H_kv, L, S, D, Dv, options in TOKEN_MAJOR_CASES:
            options = dict(options)
            k, v = _kv_views("cache_window", dtype, rng, B, H_kv, S, D, Dv)  # a token-major cache
            mask = random_array((B, 1, L, S), "f32", rng) if options.pop("mask", None) else None
            if "window" in options:
                options.update(alibi_slopes=np.linspace(0.05, 0.4, H).astype(np.float32),
                               sinks=np.linspace(-1.0, 2.0, H).astype(np.float32))
            _check_call(random_array((B, H, L, D), dtype, rng), k, v, mask, dtype, rng, **options)
