"""graphattn's fused SDPA against the installed peers, in one process, interleaved.

    python benchmarks/sdpa_bench.py [--suite quick|standard|full|training|decode|small|window|modifiers]
                                    [--dtypes f32,bf16]
                                    [--direction forward|backward|both] [--only causal|plain]
                                    [--plot out.png] [--memory]

Peers (--peers): torch, PyTorch's CPU F.scaled_dot_product_attention when torch is
importable; onednn, oneDNN's Graph API called through its C API where PyPI's onednn
wheel is installed (onednn_graph_peer.py: the specification's SDPA patterns, the
implicit causal mask and 5-D GQA included; forward where oneDNN takes the pattern as
one partition, backward as the partitions it makes); onednn_jit, not timed unless
asked for, oneDNN Graph through PyTorch's TorchScript oneDNN fusion (onednn_peer.py:
forward, f32 and bf16, no GQA; causal calls give it an explicit -inf mask).
Each case times graphattn and every peer alternately on the same inputs and
reports the median. The backward times graphattn's fused backward against
torch's autograd backward of F.scaled_dot_product_attention (retained graph, so
only the backward is timed). Prints one JSON line per case on stdout, a progress bar
on stderr, then a table with ms, GFLOP/s, graphattn's share of the practical
peak and the ratio to each peer (peer time / graphattn time, so > 1 means
graphattn is faster), and the machine's measured GEMM rate per dtype as the
practical peak.
Where a forward suite times causal and plain at square S >= 2048, graphattn's causal
speedup over the plain call is timed again, the two interleaved, and printed after the table.
The training suite times forward and backward unless --direction says otherwise.
The modifiers suite times the score modifiers (softcap, ALiBi, sinks, all three) against the same causal call
without them, interleaved, forward and backward: the cost of each as a time ratio.
--memory runs the forward at S=32768 (N=1, H=8, D=128) in a child process
and prints its peak memory beyond inputs and outputs.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import numpy as np

import graphattn as ga
from bench_common import Progress, attention_flops, core_count, cpu_model, interleaved_times, median, time_call
import onednn_graph_peer
from onednn_peer import onednn_sdpa, onednn_version, unusable_reason

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the peer is optional
    torch = None

# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim)
SUITES = {
    "quick": [(1, 16, 16, 1024, 1024, 64), (1, 2, 2, 2048, 2048, 64), (1, 32, 8, 1, 4096, 128)],
    "standard": [(1, 16, 16, 1024, 1024, 64), (1, 16, 16, 2048, 2048, 128), (4, 32, 32, 512, 512, 64),
                 (1, 2, 2, 2048, 2048, 64), (1, 32, 8, 1, 4096, 128), (1, 32, 8, 1, 16384, 128)],
}
SUITES["training"] = [(1, 16, 16, 1024, 1024, 64), (1, 16, 16, 2048, 2048, 128), (4, 32, 32, 512, 512, 64),
                      (1, 32, 8, 1024, 1024, 128)]
SUITES["decode"] = [(1, 32, 8, 1, s, 128) for s in (4096, 16384, 32768)]
# Few heads and short prompts: fewer query blocks than threads, so the keys are split too.
SUITES["small"] = [(1, 1, 1, 64, 4096, 128), (1, 1, 1, 256, 4096, 128), (1, 2, 2, 128, 8192, 128),
                   (1, 4, 1, 512, 2048, 64)]
# Odd shapes where a kernel choice can fall off a cliff: 1 to 63 query rows (decode without GQA, GQA groups of
# 17-row heads, short prompts against long keys), single heads, short key sequences; a fixed sample of the grid.
_CLIFF_GRID = [(n, hq, hkv, sq, skv, d) for n, hq, hkv in ((1, 1, 1), (1, 8, 8), (2, 16, 16), (1, 32, 8), (1, 16, 4))
               for sq, skv in ((1, 17), (1, 300), (4, 768), (8, 300), (12, 2048), (17, 17), (17, 768), (24, 300),
                               (48, 300), (64, 768), (200, 1500), (1000, 1000))
               for d in (64, 80, 128)]
SUITES["cliffs"] = [_CLIFF_GRID[i] for i in sorted(np.random.default_rng(1).choice(len(_CLIFF_GRID), 48,
                                                                                     replace=False))]
SUITES["full"] = SUITES["standard"] + [(8, 16, 16, s, s, d) for d in (64, 128) for s in (512, 1024, 2048, 4096)] + [
    (1, 32, 8, 1, s, 128) for s in (8192, 32768)]


def make_inputs(shape, dtype: str, rng):
    n, hq, hkv, sq, skv, d = shape
    q = rng.standard_normal((n, hq, sq, d), dtype=np.float32)
    k = rng.standard_normal((n, hkv, skv, d), dtype=np.float32)
    v = rng.standard_normal((n, hkv, skv, d), dtype=np.float32)
    if torch is not None:  # graphattn takes torch tensors without a copy, so both see the same memory
        tdtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
        return [torch.from_numpy(x).to(tdtype) for x in (q, k, v)]
    np_dtype = {"f32": np.float32, "bf16": ga.dtypes.DTYPES[ga.DataType.bf16].numpy, "f16": np.float16}[dtype]
    return [x.astype(np_dtype) for x in (q, k, v)]


MS_DECIMALS = 6  # ms to the nanosecond, so a ratio of two rounded figures for a call of microseconds stays within 0.01

PEERS = ("torch", "onednn", "onednn_jit")
DEFAULT_PEERS = ("torch", "onednn")
LEFT_OUT: collections.Counter = collections.Counter()  # (peer, why it sat out a case): cases
ONEDNN_PARTITIONS: collections.Counter = collections.Counter()  # (direction, partitions oneDNN ran): cases


def onednn_peer_run(direction: str, dtype: str, build):
    """The direct oneDNN Graph peer's callable from build() (onednn_graph_peer.sdpa_forward or
    sdpa_backward bound to a case), or None, with why in LEFT_OUT."""
    reason = onednn_graph_peer.unavailable_reason()
    if reason is None:
        try:
            run, _ = build()
            ONEDNN_PARTITIONS[direction, run.partition_count] += 1
            return run
        except onednn_graph_peer.OneDnnError as why:
            reason = f"{dtype}: {why}"
    LEFT_OUT["onednn", reason] += 1
    return None


def contenders(shape, dtype: str, causal: bool, inputs, peers=PEERS):
    n, hq, hkv, sq, skv, d = shape
    gqa = hq != hkv
    q, k, v = inputs
    runs = {"graphattn": lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)}
    if torch is not None and "torch" in peers:
        def torch_sdpa():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        runs["torch"] = torch_sdpa
    if "onednn" in peers and (run := onednn_peer_run(
            "forward", dtype, lambda: onednn_graph_peer.sdpa_forward(q, k, v, causal))) is not None:
        runs["onednn"] = run
    if "onednn_jit" in peers:
        reason = unusable_reason(dtype, hq, hkv)
        onednn = onednn_sdpa(q, k, v, causal) if reason is None else None
        if onednn is not None:
            runs["onednn_jit"] = onednn
        else:
            LEFT_OUT["onednn_jit", reason or "oneDNN split the pattern into several partitions"] += 1
    return runs


def backward_contenders(shape, dtype: str, causal: bool, inputs, peers=PEERS):
    n, hq, hkv, sq, skv, d = shape
    gqa = hq != hkv
    q, k, v = inputs
    out, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_stats=True)
    grad_out = out.clone() if torch is not None else out.copy()
    runs = {"graphattn": lambda: ga.scaled_dot_product_attention_backward(grad_out, q, k, v, out, stats,
                                                                          is_causal=causal, enable_gqa=gqa)}
    if torch is not None and "torch" in peers:
        tq, tk, tv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)

        def torch_backward():
            tq.grad = tk.grad = tv.grad = None
            tout.backward(grad_out, retain_graph=True)
        runs["torch"] = torch_backward
    if "onednn" in peers and (run := onednn_peer_run(
            "backward", dtype, lambda: onednn_graph_peer.sdpa_backward(q, k, v, grad_out, stats, causal))) is not None:
        runs["onednn"] = run
    return runs


def bench_case(shape, dtype: str, causal: bool, rng, min_seconds: float, backward: bool = False,
               peers=PEERS) -> dict:
    n, hq, hkv, sq, skv, d = shape
    if causal and sq == 1:
        causal = False  # one query row: the causal mask keeps every key
    inputs = make_inputs(shape, dtype, rng)
    runs = (backward_contenders(shape, dtype, causal, inputs, peers) if backward
            else contenders(shape, dtype, causal, inputs, peers))
    times = interleaved_times(runs, min_seconds)
    flops = attention_flops(n, hq, sq, skv, d, causal=causal, backward=backward)
    row = {"bench": "sdpa_backward" if backward else "sdpa_forward", "shape": [n, hq, hkv, sq, skv, d], "dtype": dtype, "causal": causal,
           "isa": ga.backward_isa(dtype, sq, skv) if backward else ga.forward_isa(dtype, sq, skv, n * hq, causal, d), "threads": ga.thread_count(), "cpu": cpu_model()}
    for name, t in times.items():
        ms = median(t) * 1e3
        row[f"{name}_ms"] = round(ms, MS_DECIMALS)
        row[f"{name}_gflops"] = round(flops / (ms * 1e-3) / 1e9, 1)
    for name in times:
        if name != "graphattn":
            row[f"vs_{name}"] = round(row[f"{name}_ms"] / row["graphattn_ms"], 2)
    return row


CAUSAL_SPEEDUP_MIN_SEQ = 2048  # the line: causal at S=2048 at least 1.7x faster than the plain call
CAUSAL_SPEEDUP_TARGET = 1.7


def takes_causal_speedup(shape) -> bool:
    """Square sequences of at least CAUSAL_SPEEDUP_MIN_SEQ, where the causal mask drops about half the work."""
    return shape[3] == shape[4] >= CAUSAL_SPEEDUP_MIN_SEQ


def causal_speedup_case(shape, dtype: str, rng, min_seconds: float) -> dict:
    """graphattn's forward with is_causal against the same call without it, interleaved on the same inputs:
    the speedup the skipped blocks give (2 at most), free of the drift between two rows taken minutes apart."""
    q, k, v = make_inputs(shape, dtype, rng)
    gqa = shape[1] != shape[2]
    runs = {"plain": lambda: ga.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
            "causal": lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)}
    medians = {name: median(t) * 1e3 for name, t in interleaved_times(runs, min_seconds).items()}
    return {"bench": "sdpa_causal_speedup", "shape": list(shape), "dtype": dtype,
            "isa": ga.forward_isa(dtype, shape[3], shape[4], shape[0] * shape[1], True, shape[5]),
            "plain_ms": round(medians["plain"], MS_DECIMALS), "causal_ms": round(medians["causal"], MS_DECIMALS),
            "speedup": round(medians["plain"] / medians["causal"], 2), "threads": ga.thread_count(),
            "cpu": cpu_model()}


WINDOW_KEYS = 2048  # the case: window=(W - 1, 0) under is_causal at S=16384, D=64
WINDOW_SPEEDUP_SHARE = 0.8  # of the ideal speedup, the ratio of visible score pairs
SUITES["window"] = [(1, 2, 2, 16384, 16384, 64)]


def visible_pairs(seq: int, window_keys: int | None) -> int:
    """Score pairs a square causal call sees: row i sees min(i + 1, W) keys (all i + 1 without a window)."""
    if window_keys is None:
        return seq * (seq + 1) // 2
    w = min(window_keys, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def window_speedup_case(shape, dtype: str, rng, min_seconds: float, window_keys: int | None = None) -> dict:
    """graphattn's causal forward with a sliding window of window_keys keys against full causal, interleaved
    on the same inputs; ideal_speedup is the ratio of visible score pairs, share the part of it reached."""
    window_keys = WINDOW_KEYS if window_keys is None else window_keys
    q, k, v = make_inputs(shape, dtype, rng)
    gqa = shape[1] != shape[2]
    window = (window_keys - 1, 0)
    runs = {"causal": lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
            "window": lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa,
                                                               window=window)}
    medians = {name: median(t) * 1e3 for name, t in interleaved_times(runs, min_seconds).items()}
    ideal = visible_pairs(shape[3], None) / visible_pairs(shape[3], window_keys)
    speedup = medians["causal"] / medians["window"]
    return {"bench": "sdpa_window_speedup", "shape": list(shape), "dtype": dtype, "window": list(window),
            "causal_ms": round(medians["causal"], MS_DECIMALS), "window_ms": round(medians["window"], MS_DECIMALS),
            "speedup": round(speedup, 2), "ideal_speedup": round(ideal, 2), "share": round(speedup / ideal, 3),
            "threads": ga.thread_count(), "cpu": cpu_model()}


def print_window_speedups(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\nsliding window vs full causal, graphattn alone, interleaved (causal ms / window ms; share = speedup / "
          f"ideal, target {WINDOW_SPEEDUP_SHARE}):")
    for row in rows:
        print(f"  {str(tuple(row['shape'])):<30} {row['dtype']:<5} window {tuple(row['window'])} causal "
              f"{row['causal_ms']:>9.3f} ms  window {row['window_ms']:>9.3f} ms  speedup {row['speedup']:.2f} of "
              f"{row['ideal_speedup']:.2f}  share {row['share']:.2f}")


# Softcap (Gemma 2's 50), ALiBi and sinks against the same causal call: a prefill, a decode step under GQA, and
# a training-sized call.
SUITES["modifiers"] = [(1, 16, 16, 1024, 1024, 64), (1, 32, 8, 1, 4096, 128), (1, 16, 16, 2048, 2048, 128)]
MODIFIERS = ("softcap", "alibi", "sinks", "all")


def modifier_arguments(name: str, heads: int) -> dict:
    """The functional API's arguments of one modifier variant (deterministic values)."""
    slopes = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)  # BLOOM's geometric slopes
    sinks = np.linspace(-1.0, 1.0, heads, dtype=np.float32)
    return {"softcap": dict(softcap=50.0), "alibi": dict(alibi_slopes=slopes), "sinks": dict(sinks=sinks),
            "all": dict(softcap=50.0, alibi_slopes=slopes, sinks=sinks), "plain": {}}[name]


def modifier_cost_case(shape, dtype: str, rng, min_seconds: float, backward: bool) -> dict:
    """graphattn's causal call with each modifier against the same call without one, interleaved on the same
    inputs: cost = modified ms / plain ms."""
    n, hq, hkv, sq, skv, d = shape
    q, k, v = make_inputs(shape, dtype, rng)
    gqa = hq != hkv
    causal = sq > 1
    runs = {}
    for name in ("plain",) + MODIFIERS:
        kw = modifier_arguments(name, hq)
        if not backward:
            runs[name] = (lambda kw=kw: ga.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                                                         **kw))
            continue
        out, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_stats=True,
                                                     **kw)
        grad = out * 0.5
        runs[name] = (lambda kw=kw, out=out, stats=stats, grad=grad: ga.scaled_dot_product_attention_backward(
            grad, q, k, v, out, stats, is_causal=causal, enable_gqa=gqa, return_sinks_grad="sinks" in kw, **kw))
    medians = {name: median(t) * 1e3 for name, t in interleaved_times(runs, min_seconds).items()}
    row = {"bench": "sdpa_modifier_cost", "direction": "backward" if backward else "forward", "shape": list(shape),
           "dtype": dtype, "causal": causal,
           "isa": ga.backward_isa(dtype, sq, skv) if backward else ga.forward_isa(dtype, sq, skv, n * hq, causal, d)}
    for name, ms in medians.items():
        row[f"{name}_ms"] = round(ms, MS_DECIMALS)
    for name in MODIFIERS:
        row[f"{name}_cost"] = round(medians[name] / medians["plain"], 3)
    row.update(threads=ga.thread_count(), cpu=cpu_model())
    return row


def print_modifier_costs(rows: list[dict]) -> None:
    print("\nscore modifiers vs the same call without them, graphattn alone, interleaved (cost = modified ms / "
          "plain ms):")
    print(f"  {'direction':<9} {'shape':<28} {'dtype':<5} {'plain ms':>10} " +
          " ".join(f"{name:>8}" for name in MODIFIERS))
    for row in rows:
        print(f"  {row['direction']:<9} {str(tuple(row['shape'])):<28} {row['dtype']:<5} {row['plain_ms']:>10.3f} " +
              " ".join(f"{row[name + '_cost']:>8.3f}" for name in MODIFIERS))
    print(f"cpu: {cpu_model()}, threads: {ga.thread_count()}")


def print_causal_speedups(rows: list[dict]) -> None:
    if not rows:
        return
    print("\ncausal vs plain, graphattn alone, interleaved (plain ms / causal ms; 2.0 = every masked block "
          "skipped for free):")
    for row in rows:
        print(f"  {str(tuple(row['shape'])):<30} {row['dtype']:<5} {row['isa']:<9} plain {row['plain_ms']:>9.3f} ms"
              f"  causal {row['causal_ms']:>9.3f} ms  speedup {row['speedup']:.2f}")
    lowest = min(rows, key=lambda r: r["speedup"])
    print(f"causal speedup: lowest {lowest['speedup']:.2f} {tuple(lowest['shape'])} {lowest['dtype']}, "
          f"{sum(r['speedup'] < CAUSAL_SPEEDUP_TARGET for r in rows)} of {len(rows)} below {CAUSAL_SPEEDUP_TARGET}")


def gemm_peak(dtype: str, size: int = 2048) -> float | None:
    """GFLOP/s of a square GEMM of this size and dtype (PyTorch if present, else NumPy f32)."""
    if torch is not None:
        tdtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
        a = torch.randn(size, size).to(tdtype)
        b = torch.randn(size, size).to(tdtype)
        fn = lambda: torch.matmul(a, b)  # noqa: E731
    elif dtype == "f32":
        a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
        fn = lambda: a @ a  # noqa: E731
    else:
        return None
    return 2.0 * size ** 3 / median(time_call(fn, 0.5)) / 1e9


GEMM_PROBE_SIZE = 512


def gemm_rates(dtypes: list[str]) -> dict:
    """Per dtype, GFLOP/s of a 2048^3 GEMM; f32 first, then each other dtype only where a 512^3 probe runs at
    least half the f32 rate, else the probe's rate, as practical_peaks takes the f32 one for it anyway (a dtype
    without native products, as there: a 2048^3 call takes 40 s at 0.4 GFLOP/s)."""
    rates = {}
    for dt in dict.fromkeys(["f32"] + dtypes):
        probe = gemm_peak(dt, GEMM_PROBE_SIZE) if dt != "f32" else None
        if probe is not None and probe < rates.get("f32", 0.0) / 2:
            rates[dt] = probe
        elif (rate := gemm_peak(dt)) is not None:
            rates[dt] = rate
    return rates


def practical_peaks(gemm_rates: dict, dtypes: list[str]) -> dict:
    """Per dtype, the faster of its own GEMM and the f32 GEMM: bf16 or f16 operands can always widen to f32,
    and a CPU without native f16 products (PyTorch's f16 GEMM on AVX-512 without AVX512-FP16 ran at
    0.4 GFLOP/s on a 2-core AMD EPYC) would otherwise give a share of peak in the tens of thousands."""
    f32 = gemm_rates.get("f32", 0.0)
    return {dt: max(gemm_rates[dt], f32) for dt in dtypes if dt in gemm_rates}


MEMORY_SCRIPT = r"""
import numpy as np, graphattn as ga
def peak_kib():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmHWM'))
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 32768, 128), dtype=np.float32) for _ in range(3))
before = peak_kib()  # before any call: the compiled partition and the per-thread scratch it keeps count too
ga.scaled_dot_product_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64])
res = ga.scaled_dot_product_attention(q, k, v)
after = peak_kib()
print((after - before) / 1024 - res.nbytes / 2**20)  # the output is not extra
"""


def memory_case() -> dict:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, check=True)
    extra = float(result.stdout.strip())
    return {"bench": "sdpa_forward_memory", "shape": [1, 8, 8, 32768, 32768, 128], "dtype": "f32",
            "peak_extra_mib": round(extra, 1), "seconds": round(time.perf_counter() - start, 1), "cpu": cpu_model()}


def print_table(rows: list[dict], peaks: dict) -> None:
    peers = sorted({key[:-3] for row in rows for key in row if key.endswith("_ms")} - {"graphattn"})
    header = (f"{'pass':<8} {'shape (N,Hq,Hkv,Sq,Skv,D)':<30} {'dtype':<5} {'causal':<6} {'isa':<9} "
              f"{'graphattn ms':>12} {'GFLOP/s':>8} {'%peak':>6}")
    for peer in peers:
        header += f" {peer + ' ms':>10} {'GFLOP/s':>8} {'ratio':>6}"
    print()
    kernels = "; ".join(f"{name} " + ", ".join(f"{dt} {isa(dt)}" for dt in ("f32", "bf16", "f16"))
                        for name, isa in (("forward", ga.forward_isa), ("backward", ga.backward_isa)))
    print(f"cpu: {cpu_model()}, {core_count()} cores, {ga.thread_count()} threads; kernels: {kernels}")
    print(header)
    for row in rows:
        peak = peaks.get(row["dtype"])
        of_peak = f"{100 * row['graphattn_gflops'] / peak:>6.0f}" if peak else f"{'-':>6}"
        line = (f"{row['bench'][5:]:<8} {str(tuple(row['shape'])):<30} {row['dtype']:<5} {str(row['causal']):<6} "
                f"{row['isa']:<9} "
                f"{row['graphattn_ms']:>12.3f} {row['graphattn_gflops']:>8.1f} {of_peak}")
        for peer in peers:
            if f"{peer}_ms" in row:
                line += f" {row[peer + '_ms']:>10.3f} {row[peer + '_gflops']:>8.1f} {row['vs_' + peer]:>6.2f}"
            else:  # a peer that sat the case out keeps its columns, blank, so the next peer's stay under their header
                line += f" {'-':>10} {'-':>8} {'-':>6}"
        print(line)
    if "onednn" in peers:
        runs = "; ".join(f"{direction} as {count} partition{'s' if count > 1 else ''} in {cases} case(s)"
                         for (direction, count), cases in sorted(ONEDNN_PARTITIONS.items()))
        print(f"onednn: oneDNN Graph v{onednn_graph_peer.onednn_version()} (PyPI's onednn, C API; {runs}); causal "
              "forward rows use its implicit causal mask, causal backward rows an explicit -inf mask "
              "(the specification's backward takes explicit masks only)")
    if "onednn_jit" in peers:
        print(f"onednn_jit: oneDNN Graph v{onednn_version()} (PyTorch's build, through torch.jit's oneDNN fusion, "
              "one partition per call); causal rows give it an explicit -inf mask, computed in full")
    for (peer, reason), cases in LEFT_OUT.items():
        print(f"{peer} left out of {cases} case(s): {reason}")
    if peaks:
        print("practical peak (2048^3 GEMM, measured after the cases, the f32 one where a dtype's own is slower; "
              "%peak = graphattn's share of it): "
              + ", ".join(f"{dt} {gf:.0f} GFLOP/s" for dt, gf in peaks.items()))
    for peer in peers:
        ratios = sorted(((row["vs_" + peer], row) for row in rows if "vs_" + peer in row), key=lambda x: x[0])
        if not ratios:
            continue
        worst = ", ".join(f"{r:.2f} {row['bench'][5:]} {tuple(row['shape'])} {row['dtype']}"
                          f"{' causal' if row['causal'] else ''}" for r, row in ratios[:3])
        print(f"vs {peer}: {sum(r < 1.0 for r, _ in ratios)} of {len(ratios)} cases below 1.0, "
              f"{sum(r < 1.3 for r, _ in ratios)} below 1.3; lowest: {worst}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); skipped", file=sys.stderr)
        return
    labels = [f"{r['bench'][5:]} {tuple(r['shape'])} {r['dtype']}{' causal' if r['causal'] else ''}" for r in rows]
    peers = sorted({key[:-7] for row in rows for key in row if key.endswith("_gflops")})
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    height = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        ax.barh([y + i * height for y in range(len(rows))], [r.get(f"{peer}_gflops", 0) for r in rows], height,
                label=peer)
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(rows))], labels, fontsize=7)
    ax.set_xlabel("GFLOP/s")
    ax.set_title(f"SDPA, {cpu_model()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="standard")
    parser.add_argument("--dtypes", default="f32,bf16,f16")
    parser.add_argument("--only", choices=["causal", "plain"], default=None)
    parser.add_argument("--direction", choices=["forward", "backward", "both"], default=None,
                        help="default: both for the training suite, else forward")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per contender and case")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here (needs matplotlib)")
    parser.add_argument("--memory", action="store_true", help="also measure peak extra memory at S=32768")
    parser.add_argument("--no-peak", action="store_true", help="skip the GEMM peak measurement")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help=f"peers to time where installed, of {', '.join(PEERS)} "
                             "(default: %(default)s; empty: graphattn alone)")
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads would spin on our cores
    if torch is not None:
        torch.set_num_threads(ga.thread_count())

    dtypes = args.dtypes.split(",")
    peers = [p for p in args.peers.split(",") if p]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"--peers: unknown {', '.join(sorted(unknown))}; known: {', '.join(PEERS)}")
    causal_flags = {"causal": [True], "plain": [False], None: [False, True]}[args.only]
    direction = args.direction or ("both" if args.suite in ("training", "modifiers") else "forward")
    directions = {"forward": [False], "backward": [True], "both": [False, True]}[direction]
    if args.suite == "window":  # the window suite times the window against full causal only
        rows = []
        for shape, dtype in [(s, dt) for s in SUITES["window"] for dt in dtypes]:
            row = window_speedup_case(shape, dtype, np.random.default_rng(0), args.seconds)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print_window_speedups(rows)
        return
    if args.suite == "modifiers":  # each modifier against the same call without it
        cases = [(s, dt, b) for b in directions for s in SUITES["modifiers"] for dt in dtypes]
        progress = Progress(len(cases))
        rows = []
        for shape, dtype, backward in cases:
            progress.step(f"modifiers {'backward' if backward else 'forward'} {shape} {dtype}")
            row = modifier_cost_case(shape, dtype, np.random.default_rng(0), args.seconds, backward)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print_modifier_costs(rows)
        return
    cases = [(s, dt, c, b) for b in directions for s in SUITES[args.suite] for dt in dtypes for c in causal_flags
             if not (c and s[3] == 1)]
    rng = np.random.default_rng(0)
    # Where a suite times a square S >= 2048 causal and plain, their speedup is timed again, interleaved.
    speedup_cases = [(s, dt) for s, dt, c, b in cases if c and not b and takes_causal_speedup(s)
                     and (s, dt, False, False) in cases]
    progress = Progress(len(cases) + len(speedup_cases) + (0 if args.no_peak else 1) + (1 if args.memory else 0))
    rows = []
    for shape, dtype, causal, backward in cases:
        progress.step(f"{'backward' if backward else 'forward'} {shape} {dtype} {'causal' if causal else ''}")
        row = bench_case(shape, dtype, causal, rng, args.seconds, backward, peers)
        print(json.dumps(row), flush=True)
        rows.append(row)
    speedup_rows = []
    for shape, dtype in speedup_cases:
        progress.step(f"causal vs plain {shape} {dtype}")
        row = causal_speedup_case(shape, dtype, rng, args.seconds)
        print(json.dumps(row), flush=True)
        speedup_rows.append(row)
    rates = {}
    if not args.no_peak:
        progress.step("GEMM peak per dtype")
        rates = gemm_rates(dtypes)
    for dt, gf in rates.items():
        print(json.dumps({"bench": "gemm_peak", "dtype": dt, "gflops": round(gf, 1), "cpu": cpu_model()}), flush=True)
    peaks = practical_peaks(rates, dtypes)
    if args.memory:
        progress.step("memory S=32768")
        print(json.dumps(memory_case()), flush=True)
    print_table(rows, peaks)
    print_causal_speedups(speedup_rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
