"""The kernel candidate tables (dispatch.cpp): each candidate this CPU runs, forced in process, against the
float64 reference, forward, stats and backward; the verdicts in the log and `info`; forcing's errors."""
import numpy as np
import pytest

import graphattn as ga
from graphattn.__main__ import info
from graphattn.kernel_choice import forced_kernels
from cpu_helpers import AMX_DTYPES
from graphattn.testing import random_array
from test_window import SHAPES, _check_call, _operands

ALL_DTYPES = ("f32", "bf16", "f16")
# (shape, mask, options): odd lengths, GQA, decode, both alignments, windows and masks, one long call
CASES = [
    ("square", None, {}),
    ("gqa", "bool", dict(window=(-1, 0))),
    ("more_rows", "float", dict(window=(-1, 0), causal_alignment="bottom_right")),
    ("square", None, dict(is_causal=True)),
    ("fewer_rows", None, dict(window=(7, 7))),
    ("decode", "bool", dict(window=(40, 0), causal_alignment="bottom_right")),
    ("long", None, dict(window=(16, 0))),
]


def _candidate_params(pass_name: str):
    params = []
    for name, missing in ga.kernel_candidates(pass_name):
        for dtype in AMX_DTYPES.get(name, ALL_DTYPES):
            marks = [pytest.mark.skip(reason=f"{name}: {missing}")] if missing else []
            params.append(pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}"))
    return params


@pytest.fixture(autouse=True)
def automatic_choice():
    """Every test starts and ends with the automatic choice, whatever it forces."""
    ga.force_kernel(forward="auto", backward="auto")
    yield
    ga.force_kernel(forward="auto", backward="auto")


@pytest.mark.parametrize("name,dtype", _candidate_params("forward"))
def test_each_forward_candidate_forced(name, dtype, rng):
    """The forced forward candidate runs every case (also those a speed rule gives to another: decode on
    tiles), checked with its backward (the automatic choice) against the float64 reference."""
    with ga.force_kernel(forward=name):
        assert ga.forward_isa(dtype, 1, 150) == name
        for shape, mask, options in CASES:
            q, k, v, attn_mask = _operands(SHAPES[shape], dtype, rng, mask)
            _check_call(q, k, v, attn_mask, dtype, rng, **options)


@pytest.mark.parametrize("name,dtype", _candidate_params("backward"))
def test_each_backward_candidate_forced(name, dtype, rng):
    with ga.force_kernel(backward=name):
        assert ga.backward_isa(dtype, 20, 90) == name
        for shape, mask, options in CASES:
            q, k, v, attn_mask = _operands(SHAPES[shape], dtype, rng, mask)
            _check_call(q, k, v, attn_mask, dtype, rng, **options)


def test_forced_candidate_shows_in_the_log(capsys, rng):
    name = ga.kernel_candidates("forward")[-1][0]  # portable: every CPU runs it
    q, k, v, _ = _operands(SHAPES["square"], "f32", rng)
    ga.set_verbose(1)
    try:
        with ga.force_kernel(name):
            ga.scaled_dot_product_attention(q[..., :5, :], k, v)  # a length of its own: a fresh compile
    finally:
        ga.set_verbose(0)
    assert f"sdpa_forward_cpu,isa={name},why=forced (" in capsys.readouterr().err


def test_automatic_choice_is_the_first_candidate_that_accepts():
    """With nothing forced, the build a call runs is the first candidate this CPU runs whose rules accept it:
    a vector build for decode (every AMX candidate declines under 6 query rows)."""
    usable = [name for name, missing in ga.kernel_candidates("forward") if not missing]
    vector = [name for name in usable if not name.startswith("amx")]
    assert ga.forward_isa("f32", 1, 4096) == vector[0]
    assert ga.forward_isa("bf16", 1, 4096) == vector[0]
    assert ga.backward_isa("f32", 100, 100) == [n for n, m in ga.kernel_candidates("backward")
                                                  if not m and not n.startswith("amx")][0]


def test_forcing_errors_name_the_pass_and_the_candidates():
    with pytest.raises(ValueError, match="no pass has a kernel candidate 'avx1024'.*forward: amx_bf16"):
        ga.force_kernel("avx1024")
    with pytest.raises(ValueError, match="unknown backward kernel 'amx_bf16x6'"):
        ga.force_kernel(backward="amx_bf16x6")  # f32 has no AMX backward
    with pytest.raises(TypeError, match="forward must be a candidate name"):
        ga.force_kernel(forward=3)
    with pytest.raises(ValueError, match="not both"):
        ga.force_kernel("avx2", forward="portable")
    for name, missing in ga.kernel_candidates("forward"):
        if missing:
            with pytest.raises(ValueError, match=f"kernel {name} cannot run on this CPU: {missing}"):
                ga.force_kernel(forward=name)
    assert forced_kernels() == {"forward": "auto", "backward": "auto"}  # a failed force changes nothing


def test_forced_candidate_refuses_a_call_it_cannot_run(rng):
    """A forced AMX candidate given inputs of another dtype class raises, naming itself and the rule."""
    usable = [name for name, missing in ga.kernel_candidates("forward") if not missing and name == "amx_bf16"]
    if not usable:
        pytest.skip("no usable AMX-BF16 on this CPU")
    q = random_array((1, 2, 40, 32), "f32", rng)
    with ga.force_kernel(forward="amx_bf16"):
        with pytest.raises(ValueError, match="forward kernel amx_bf16 is forced but cannot run this call: "
                                             "forced \\(takes bf16 inputs\\)"):
            ga.scaled_dot_product_attention(q, q, q)


def test_force_kernel_restores_on_exit_and_stays_without_with():
    with ga.force_kernel("portable"):
        assert forced_kernels() == {"forward": "portable", "backward": "portable"}
        with ga.force_kernel(forward="auto"):
            assert forced_kernels() == {"forward": "auto", "backward": "portable"}
        assert forced_kernels() == {"forward": "portable", "backward": "portable"}
    assert forced_kernels() == {"forward": "auto", "backward": "auto"}
    ga.force_kernel(backward="portable")
    assert forced_kernels()["backward"] == "portable" and ga.backward_isa("bf16", 100, 100) == "portable"


def test_info_lists_each_table_in_order():
    text = info()
    for pass_name in ("forward", "backward"):
        names = [name for name, _ in ga.kernel_candidates(pass_name)]
        line = next(line for line in text.splitlines() if line.startswith(f"{pass_name} kernels"))
        positions = [line.index(name + " (") for name in names]
        assert positions == sorted(positions), line
        for name, missing in ga.kernel_candidates(pass_name):
            assert (f"{name} (not here: {missing})" in line) == bool(missing), line
