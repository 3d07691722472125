"""The benchmark runs end to end: JSON lines, the table, and per peer the count of cases under 1.0x and 1.3x."""
import importlib
import json
import pathlib
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest

import graphattn as ga

from graphattn.testing import assert_close, assert_grad_close, random_array, sdpa_reference, sdpa_reference_backward

pytestmark = pytest.mark.cpu

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "sdpa_bench.py"


def test_benchmark_prints_rows_table_and_summary():
    result = subprocess.run([sys.executable, str(BENCH), "--suite", "quick", "--dtypes", "f32", "--only", "plain",
                             "--seconds", "0.01", "--no-peak"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [tuple(r["shape"]) for r in rows] == [(1, 16, 16, 1024, 1024, 64), (1, 2, 2, 2048, 2048, 64),
                                                  (1, 32, 8, 1, 4096, 128)]
    assert all(r["graphattn_ms"] > 0 and r["graphattn_gflops"] > 0 and r["isa"] for r in rows)
    assert any(line.startswith("pass     shape") for line in lines)
    peers = sorted({key[3:] for r in rows for key in r if key.startswith("vs_")})
    summaries = [line for line in lines if line.startswith("vs ")]
    assert [s.split(":")[0] for s in summaries] == [f"vs {peer}" for peer in peers]
    for peer, summary in zip(peers, summaries):
        compared = [r for r in rows if "vs_" + peer in r]  # a peer may not take every case (oneDNN: no GQA)
        below = sum(r["vs_" + peer] < 1.0 for r in compared)
        assert f": {below} of {len(compared)} cases below 1.0" in summary


def test_benchmark_refuses_an_unknown_peer():
    result = subprocess.run([sys.executable, str(BENCH), "--suite", "quick", "--peers", "torch,mkl"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--peers: unknown mkl" in result.stderr


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH.parent))


def _onednn_peer():
    return _bench_module("onednn_peer")


def test_practical_peak_is_never_below_the_f32_gemm():
    peaks = _bench_module("sdpa_bench").practical_peaks({"f32": 100.0, "bf16": 300.0, "f16": 0.4}, ["bf16", "f16"])
    assert peaks == {"bf16": 300.0, "f16": 100.0}


def test_onednn_partition_check_needs_both_matmuls_and_the_softmax_in_one_group():
    peer = _onednn_peer()
    fused = "%3 = prim::oneDNNFusionGroup_0(%q)\nwith prim::oneDNNFusionGroup_0 = graph(%q):\n  aten::matmul\n" \
            "  aten::mul\n  aten::softmax\n  aten::matmul\n"
    split = "with prim::oneDNNFusionGroup_0 = graph(%q):\n  aten::matmul\n  aten::mul\n" \
            "with prim::oneDNNFusionGroup_1 = graph(%s):\n  aten::softmax\n  aten::matmul\n"
    assert peer.is_one_partition(fused)
    assert not peer.is_one_partition(split)
    assert not peer.is_one_partition("aten::matmul aten::softmax aten::matmul")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_onednn_peer_computes_attention(dtype, causal):
    peer = _onednn_peer()
    if peer.onednn_version() is None:
        pytest.skip("PyTorch with its oneDNN fusion is not installed")
    import torch
    rng = np.random.default_rng(3)
    q, k, v = (random_array(shape, "f32", rng) for shape in ((1, 2, 17, 32), (1, 2, 40, 32), (1, 2, 40, 32)))
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    run = peer.onednn_sdpa(*(torch.from_numpy(x).to(torch_dtype) for x in (q, k, v)), causal)
    if run is None:
        _skip_unfused_bf16(dtype, "oneDNN did not take the SDPA pattern as one partition")
    assert run is not None, "oneDNN did not take the SDPA pattern as one partition"
    expected = sdpa_reference(q, k, v, is_causal=causal)
    assert_close(run().float().numpy(), expected, dtype, what="oneDNN peer output")


def test_onednn_peer_names_what_it_cannot_take():
    peer = _onednn_peer()
    if peer.onednn_version() is None:
        assert "not installed" in peer.unusable_reason("f32", 4, 4)
        return
    assert peer.unusable_reason("f32", 4, 4) is None
    assert "bf16" in peer.unusable_reason("f16", 4, 4)
    assert "GQA" in peer.unusable_reason("bf16", 8, 2)


# oneDNN fuses bf16 attention only where the CPU has AVX-512 (its avx512_core ISA); elsewhere it splits the pattern.
_ONEDNN_BF16_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def _skip_unfused_bf16(dtype: str, what: str) -> None:
    """Skips a bf16 case of a oneDNN peer that did not fuse, saying why, on a CPU without AVX-512; elsewhere a
    split stays a failure."""
    lacking = _ONEDNN_BF16_NEEDS - set(ga.cpu_features())
    if dtype == "bf16" and lacking:
        pytest.skip(f"{what}; oneDNN fuses bf16 attention only with AVX-512, and this CPU lacks "
                    f"{', '.join(sorted(lacking))}")


def _onednn_graph_peer():
    peer = _bench_module("onednn_graph_peer")
    if (reason := peer.unavailable_reason()) is not None:
        pytest.skip(reason)
    return peer


# (N, Hq, Hkv, Sq, Skv, D): S=1, S=17 against 40 keys at D=80, a GQA group of 4, plain 4-D.
ONEDNN_CASES = [(1, 2, 2, 17, 40, 80), (2, 8, 2, 17, 17, 64), (1, 4, 1, 1, 33, 32)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ONEDNN_CASES)
def test_onednn_graph_peer_forward_matches_the_reference(shape, dtype, causal):
    peer = _onednn_graph_peer()
    n, hq, hkv, sq, skv, d = shape
    rng = np.random.default_rng(5)
    q, k, v = (random_array(s, dtype, rng) for s in ((n, hq, sq, d), (n, hkv, skv, d), (n, hkv, skv, d)))
    try:
        run, out = peer.sdpa_forward(q, k, v, causal)
    except peer.OneDnnError as why:
        _skip_unfused_bf16(dtype, str(why))
        raise
    assert run.partition_count == 1
    run()
    expected = sdpa_reference(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    assert_close(out.astype(np.float32), expected, dtype, what=f"oneDNN Graph peer output {shape}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ONEDNN_CASES[:2])
def test_onednn_graph_peer_backward_matches_the_reference(shape, dtype, causal):
    peer = _onednn_graph_peer()
    n, hq, hkv, sq, skv, d = shape
    rng = np.random.default_rng(6)
    q, k, v = (random_array(s, dtype, rng) for s in ((n, hq, sq, d), (n, hkv, skv, d), (n, hkv, skv, d)))
    grad_out = random_array((n, hq, sq, d), dtype, rng)
    _, stats = sdpa_reference(q, k, v, is_causal=causal, enable_gqa=hq != hkv, return_stats=True)
    try:
        run, grads = peer.sdpa_backward(q, k, v, grad_out, np.ascontiguousarray(stats, dtype=np.float32), causal)
    except peer.OneDnnError as why:
        _skip_unfused_bf16(dtype, str(why))
        raise
    run()
    expected = sdpa_reference_backward(grad_out, q, k, v, is_causal=causal, enable_gqa=hq != hkv)[:3]
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        assert_grad_close(got.astype(np.float32), want, dtype, what=f"oneDNN Graph peer {name} {shape}")


def test_onednn_graph_peer_refuses_a_split_pattern_unless_asked():
    peer = _onednn_graph_peer()

    def two_softmaxes():  # two unconnected ops: two partitions
        from graphattn.builder import GraphBuilder
        b = GraphBuilder()
        for _ in range(2):
            y = b.op("SoftMax", [b.tensor(None, "f32", (2, 8))], [b.tensor(None, "f32", (2, 8))], axis=-1)
        return peer._PatternGraph(peer._library(), b.graph()), y.id

    g, y = two_softmaxes()
    with pytest.raises(peer.OneDnnError, match="split the pattern into 2 partitions"):
        g.compile([y])
    g, y = two_softmaxes()
    assert g.compile([y], allow_split=True).partition_count == 2


def test_onednn_graph_peer_says_when_onednn_is_missing(monkeypatch, tmp_path):
    peer = _bench_module("onednn_graph_peer")
    monkeypatch.delenv("GRAPHATTN_BENCH_ONEDNN", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert "not installed" in peer._library.__wrapped__()
    monkeypatch.setenv("GRAPHATTN_BENCH_ONEDNN", str(tmp_path / "elsewhere" / "libdnnl.so.3"))
    assert "elsewhere" in peer._library.__wrapped__()


def test_causal_flops_count_the_pairs_the_mask_keeps():
    flops = _bench_module("bench_common").attention_flops
    assert flops(1, 1, 1024, 1024, 64, causal=True) == flops(1, 1, 1024, 1024, 64) / 2
    assert flops(1, 1, 64, 4096, 128, causal=True) == 4 * 128 * 64 * 65 / 2  # rows keep 1..64 keys
    assert flops(1, 1, 5, 2, 8, causal=True) == 4 * 8 * (1 + 2 + 2 + 2 + 2)
    assert flops(2, 3, 16, 16, 8, backward=True) == 2.5 * 4 * 2 * 3 * 16 * 16 * 8
    assert flops(1, 1, 2, 5, 8, causal=True, alignment="bottom_right") == 4 * 8 * (4 + 5)


def test_window_ideal_speedup_counts_visible_pairs():
    bench = _bench_module("sdpa_bench")
    assert bench.visible_pairs(5, None) == 15
    assert bench.visible_pairs(5, 2) == 1 + 2 * 4  # rows see 1, 2, 2, 2, 2 keys
    assert bench.visible_pairs(4, 9) == bench.visible_pairs(4, None)
    assert round(bench.visible_pairs(16384, None) / bench.visible_pairs(16384, 2048), 2) == 4.27


def test_window_suite_prints_its_speedup(monkeypatch, capsys):
    bench = _bench_module("sdpa_bench")
    monkeypatch.setitem(bench.SUITES, "window", [(1, 1, 1, 300, 300, 32)])
    monkeypatch.setattr(sys, "argv", ["sdpa_bench.py", "--suite", "window", "--dtypes", "f32", "--seconds", "0.05"])
    monkeypatch.setattr(bench, "WINDOW_KEYS", 64)
    bench.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["bench"] for r in rows] == ["sdpa_window_speedup"]
    assert rows[0]["window"] == [63, 0] and rows[0]["speedup"] > 0 and rows[0]["ideal_speedup"] > 1


def test_table_keeps_each_peers_columns_where_a_peer_sat_a_case_out(capsys):
    bench = _bench_module("sdpa_bench")
    row = {"bench": "sdpa_forward", "shape": [1, 2, 2, 64, 64, 32], "dtype": "f16", "causal": False, "isa": "avx512",
           "graphattn_ms": 1.0, "graphattn_gflops": 10.0}
    both = dict(row, onednn_ms=4.0, onednn_gflops=2.5, vs_onednn=4.0, torch_ms=3.0, torch_gflops=3.3, vs_torch=3.0)
    torch_only = dict(row, torch_ms=3.0, torch_gflops=3.3, vs_torch=3.0)
    bench.print_table([both, torch_only], {})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("forward")]
    assert lines[0].index(" 3.000 ") == lines[1].index(" 3.000 ")


def test_causal_speedup_is_timed_for_the_square_long_standard_shapes(capsys):
    bench = _bench_module("sdpa_bench")
    assert [s for s in bench.SUITES["standard"] if bench.takes_causal_speedup(s)] == [
        (1, 16, 16, 2048, 2048, 128), (1, 2, 2, 2048, 2048, 64)]
    row = bench.causal_speedup_case((1, 2, 2, 64, 64, 32), "f32", np.random.default_rng(0), 0.01)
    assert row["plain_ms"] > 0 and row["causal_ms"] > 0
    assert row["speedup"] == pytest.approx(row["plain_ms"] / row["causal_ms"], abs=0.01)
    slow = dict(row, shape=[1, 2, 2, 4096, 4096, 64], speedup=1.2)
    bench.print_causal_speedups([dict(row, speedup=1.9), slow])
    assert "lowest 1.20 (1, 2, 2, 4096, 4096, 64) f32, 1 of 2 below 1.7" in capsys.readouterr().out


def test_gemm_peak_skips_the_large_gemm_of_a_dtype_without_native_products(monkeypatch):
    bench = _bench_module("sdpa_bench")
    rates = {("f32", 2048): 180.0, ("bf16", 512): 300.0, ("bf16", 2048): 400.0, ("f16", 512): 0.4}
    calls = []

    def fake_gemm_peak(dtype, size=2048):
        calls.append((dtype, size))
        return rates[dtype, size]

    monkeypatch.setattr(bench, "gemm_peak", fake_gemm_peak)
    assert bench.gemm_rates(["bf16", "f16"]) == {"f32": 180.0, "bf16": 400.0, "f16": 0.4}
    assert ("f16", 2048) not in calls and calls[0] == ("f32", 2048)
    assert bench.practical_peaks(bench.gemm_rates(["f16"]), ["f16"]) == {"f16": 180.0}


def test_ab_summary_flags_only_cases_slower_than_their_spread(tmp_path):
    """ab_summary.py: a case whose new/old ratio exceeds its builds' A/A spread by more than 3% is flagged;
    one within its spread is not."""
    def row(shape, ms):
        return json.dumps({"bench": "sdpa_forward", "shape": shape, "dtype": "f32", "causal": False,
                           "graphattn_ms": ms})
    times = {"old": {1: (1.00, 2.00), 2: (1.02, 2.20)}, "new": {1: (1.30, 2.10), 2: (1.32, 2.15)}}
    for build, rounds in times.items():
        for r, (steady, noisy) in rounds.items():
            (tmp_path / f"{build}.{r}.cliffs.jsonl").write_text(
                row([1, 1, 1, 4, 4, 8], steady) + "\n" + row([1, 1, 1, 8, 8, 8], noisy) + "\ntable line\n")
    out = subprocess.run([sys.executable, str(BENCH.parent / "ab_summary.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    steady = next(line for line in out.splitlines() if "(1, 1, 1, 4, 4, 8)" in line)
    noisy = next(line for line in out.splitlines() if "(1, 1, 1, 8, 8, 8)" in line)
    assert steady.endswith("SLOWER") and not noisy.endswith("SLOWER")
    assert "slower than 3% beyond the A/A spread: 1" in out


def _json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_decode_loop_times_graphattn_and_torch_per_step():
    pytest.importorskip("torch")
    result = subprocess.run([sys.executable, str(BENCH.parent / "decode_loop.py"), "--shapes", "small_batch4",
                             "--dtypes", "f32", "--layouts", "concat,static,paged", "--steps", "8",
                             "--rounds", "2", "--start", "16"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert [r["layout"] for r in rows] == ["concat", "static", "paged"]
    for r in rows:
        assert r["graphattn_us_per_step"] > 0 and r["torch_sdpa_us_per_step"] > 0
        # each round its own lengths, new to graphattn, run by both implementations
        assert r["round_lengths"] == [[16, 23], [24, 31]]
        ours, theirs = r["graphattn_us_per_round"], r["torch_sdpa_us_per_round"]
        assert len(ours) == len(theirs) == 2
        assert r["graphattn_us_per_step"] == pytest.approx(statistics.median(ours), abs=0.01)
        # the speedup pairs each round's two times (printed with 3 decimals, from unrounded times)
        ratio = statistics.median(t / o for o, t in zip(ours, theirs))
        assert r["speedup_vs_torch_sdpa"] == pytest.approx(ratio, rel=0.01, abs=6e-4)
    assert "speedup" in result.stdout.splitlines()[-len(rows) - 1]  # the table header above its rows


def test_hf_llama_bench_times_each_phase_with_both_implementations():
    pytest.importorskip("transformers")
    result = subprocess.run([sys.executable, str(BENCH.parent / "hf_llama_bench.py"), "--dtypes", "f32", "--seq", "32",
                             "--hidden", "64", "--layers", "1", "--new-tokens", "3", "--rounds", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert [r["phase"] for r in rows] == ["forward", "generate", "train_step"]
    assert all(r["graphattn_ms"] > 0 and r["sdpa_ms"] > 0 for r in rows)


def test_ring_contention_times_a_ranks_share_alone_and_at_once():
    result = subprocess.run([sys.executable, str(BENCH.parent / "ring_contention.py"), "--ranks", "2", "--threads", "1",
                             "--seq", "256", "--heads", "2", "--head-dim", "16", "--dtype", "f32", "--repeats", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert [(r["case"], len(r["call_ms"])) for r in rows] == [("alone", 1), ("at_once", 2), ("per_core", 2),
                                                             ("per_core", 2), ("per_core", 2)]
    for r in rows:
        assert r["single_ms"] > 0 and all(t > 0 for t in r["call_ms"])
        if r["case"] == "per_core":  # two groups of one core: the slower core's speed twice, over both speeds
            speeds = [1 / t for t in r["call_ms"]]
            assert r["group_bound"] == pytest.approx(2 * min(speeds) / sum(speeds))
            assert r["spread"] == pytest.approx(max(r["call_ms"]) / min(r["call_ms"]))
        else:
            assert r["ratio"] == pytest.approx(r["single_ms"] / (2 * max(r["call_ms"])))
    assert [r["round"] for r in rows if r["case"] == "per_core"] == [0, 1, 2]
    assert "ranks x call ms" in result.stdout and "group_bound" in result.stdout


def test_call_overhead_prints_each_new_length_premium():
    """Each case of new lengths gets its premium over the cached call of the same length, as a JSON line and in a
    table of its own."""
    result = subprocess.run([sys.executable, str(BENCH.parent / "call_overhead.py"), "--calls", "50", "--rounds", "1",
                             "--new-lengths", "3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    times = {r["case"]: r["us_per_call"] for r in rows if r["bench"] == "call_overhead"}
    premiums = {r["case"]: r["us_over_cached"] for r in rows if r["bench"] == "call_overhead_premium"}
    expected = {"new_length", "static_new_length", "sinks_new_length", "paged_new_length", "backward_new_length",
                "backward_mask_new_length", "graph_new_length", "graph_backward_new_length"}
    assert expected <= set(premiums), sorted(premiums)
    for case, premium in premiums.items():
        repeat = case[:-len("new_length")] + "repeat_length"
        assert premium == pytest.approx(times[case] - times[repeat], abs=0.011)
    assert "new length over its repeat_length" in result.stdout


def _softcap_cost_flags() -> list[str]:
    """softcap_cost.cpp's compile flags: the kernels' own (GRAPHATTN_KERNEL_FLAGS in CMakeLists.txt, the one
    place they are set) and the AVX-512 subsets its code uses."""
    cmake = (BENCH.parent.parent / "CMakeLists.txt").read_text()
    kernel_flags = re.search(r"set\(GRAPHATTN_KERNEL_FLAGS ([^)]*)\)", cmake)
    assert kernel_flags, "CMakeLists.txt no longer sets GRAPHATTN_KERNEL_FLAGS"
    return kernel_flags.group(1).split() + ["-mavx512f", "-mavx512dq"]


def test_softcap_cost_documents_the_kernels_flags():
    """The build commands in softcap_cost.cpp's header and in docs/performance.md name the kernels' flags: the
    benchmark's figures stand for the kernels' cost only when it is built as they are."""
    flags = " ".join(_softcap_cost_flags())
    header = (BENCH.parent / "softcap_cost.cpp").read_text().splitlines()
    docs = (BENCH.parent.parent / "docs" / "performance.md").read_text().splitlines()
    for name, commands in (("softcap_cost.cpp", [line for line in header if "g++" in line]),
                           ("performance.md", [line for line in docs if "g++" in line and "softcap_cost" in line])):
        assert commands, f"{name} shows no build command of softcap_cost"
        for command in commands:
            assert f"g++ {flags} " in command, (name, command)


@pytest.mark.skipif(not {"avx512f", "avx512dq"} <= set(ga.cpu_features()), reason="softcap_cost.cpp times AVX-512 code")
def test_softcap_cost_times_both_paths_against_exp2(tmp_path):
    """benchmarks/softcap_cost.cpp builds with the kernels' flags and prints ns per score of exp2 and of the
    softcap's paths (c = 50 takes the scaled fits, near and far, c = 1e6 the fallback) and their ratios."""
    source = BENCH.parent / "softcap_cost.cpp"
    src = BENCH.parent.parent / "native" / "cpu"
    binary = tmp_path / "softcap_cost"
    subprocess.run(["g++", *_softcap_cost_flags(), f"-I{src / 'src'}", f"-I{src / 'include'}", str(source), "-o",
                    str(binary)], check=True, timeout=120)
    lines = subprocess.run([str(binary), "test cpu"], capture_output=True, text=True, timeout=120,
                           check=True).stdout.splitlines()
    row = json.loads(lines[0])
    assert row["bench"] == "softcap_cost" and row["cpu"] == "test cpu"
    assert row["scaled_path"] is True and row["fallback_path"] is True
    for name in ("exp2_ns_per_score", "softcap_ns_per_score", "softcap_far_ns_per_score",
                 "softcap_fallback_ns_per_score"):
        assert 0.0 < row[name] < 100.0, row
    for ratio, name in (("softcap_over_exp2", "softcap_ns_per_score"), ("far_over_exp2", "softcap_far_ns_per_score"),
                        ("fallback_over_exp2", "softcap_fallback_ns_per_score")):
        assert row[ratio] == pytest.approx(row[name] / row["exp2_ns_per_score"], rel=1e-2), (ratio, row)
    assert "softcap c*tanh(s/c), c = 50:" in lines[1]


def test_varlen_benchmark_prints_rows_and_tables():
    script = BENCH.parent / "varlen_bench.py"
    result = subprocess.run([sys.executable, str(script), "--sequences", "3", "--min-len", "8", "--max-len", "40",
                             "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dense-batch", "2",
                             "--dense-len", "16", "--dtypes", "f32", "--seconds", "0.01", "--rounds", "1",
                             "--min-reps", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["bench"], r["pass"]) for r in rows] == [("varlen", "forward"), ("varlen_dense", "forward"),
                                                      ("varlen", "backward"), ("varlen_dense", "backward")]
    for r in rows:
        assert r["varlen_ms"] > 0 and r["cpu"]
    assert all(r["vs_per_sequence"] > 0 and r["vs_padded"] > 0 for r in rows if r["bench"] == "varlen")
    assert "vs per-seq" in result.stdout and "dense/varlen" in result.stdout


def test_kvcache_benchmark_prints_rows_and_table():
    script = BENCH.parent / "kvcache_bench.py"
    result = subprocess.run([sys.executable, str(script), "--sequences", "2", "--cached", "40", "--heads", "4",
                             "--kv-heads", "2", "--head-dim", "16", "--block-sizes", "3,16", "--seconds", "0.01",
                             "--rounds", "1", "--chunk", "8", "--chunk-onto", "30", "--formats", "u8:64,s4:16,fp8_e5m2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    decode = {r["contender"]: r for r in rows if r["bench"] == "kvcache_decode"}
    assert set(decode) >= {"paged_3", "paged_16", "dense", "dense_head_major", "paged_3_u8_g64", "paged_3_s4_g16",
                           "paged_3_fp8_e5m2"}
    for r in decode.values():
        assert r["ms"] > 0 and r["kv_gbs"] > 0 and r["stream_gbs"] > 0 and r["cpu"]
    # a quantized cache's bytes: its data and scales (and zero points), fewer than bf16's
    assert decode["paged_3_s4_g16"]["kv_bytes"] < decode["paged_3_u8_g64"]["kv_bytes"] < decode["paged_3"]["kv_bytes"]
    assert decode["paged_3_u8_g64"]["kv_format"] == "u8:64" and decode["paged_3"]["kv_format"] == "bf16"
    (prefill,) = [r for r in rows if r["bench"] == "kvcache_prefill"]
    assert prefill["paged_gflops"] > 0 and prefill["dense_gflops"] > 0 and prefill["block_size"] == 3
    assert "of stream" in result.stdout and "paged/dense" in result.stdout


def test_kv_quant_accuracy_benchmark_prints_every_format():
    script = BENCH.parent / "kv_quant_accuracy.py"
    result = subprocess.run([sys.executable, str(script), "--sequences", "2", "--cached", "50", "--heads", "4",
                             "--kv-heads", "2", "--head-dim", "32", "--groups", "16,32"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {(r["data"], r["kv_format"]) for r in rows} == {(data, f) for data in ("normal", "outlier_keys") for f in
                                                           ("u8", "s8", "u4", "s4", "fp8_e4m3", "fp8_e5m2")}
    normal = {(r["kv_format"], r["group"]): r["rel_rms_err"] for r in rows if r["data"] == "normal"}
    assert 0 < normal[("u8", "16")] < normal[("u4", "16")] < 1  # 8 bits closer than 4
    assert "RMS err / RMS" in result.stdout


def test_kvcache_benchmark_compares_forced_kernels():
    """--kernels times each graphattn contender under each forward kernel named, in the same run."""
    script = BENCH.parent / "kvcache_bench.py"
    result = subprocess.run([sys.executable, str(script), "--sequences", "2", "--cached", "40", "--heads", "4",
                             "--kv-heads", "2", "--head-dim", "16", "--block-sizes", "3", "--seconds", "0.01",
                             "--rounds", "1", "--chunk", "0", "--no-peers", "--kernels", "portable,auto", "--formats", ""],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert {r["contender"] for r in rows} == {f"{name}@{kernel}" for name in ("paged_3", "dense", "dense_head_major")
                                              for kernel in ("portable", "auto")}
    assert all("vs_paged_3@portable" in r for r in rows)
