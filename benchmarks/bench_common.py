"""Shared by the benchmarks: the one FLOP count, the machine description and timing helpers."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import numpy as np

from graphattn.testing import cpuinfo_field


def attention_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, *, causal: bool = False,
                    backward: bool = False, alignment: str = "top_left") -> float:
    """FLOPs of one SDPA call: 4*N*H*Sq*Skv*D (two matmuls), 2.5x for the backward.  Causal: half of it
    where Sq == Skv; otherwise the (query, key) pairs the mask keeps (top-left aligned, 64 query rows
    against 4096 keys keep 64*65/2 pairs, not 64*4096/2)."""
    pairs = float(seq_q * seq_kv)
    if causal and seq_q == seq_kv:
        pairs /= 2
    elif causal:  # row i keeps keys 0..i, shifted by Skv - Sq where bottom-right aligned
        shift = seq_kv - seq_q if alignment == "bottom_right" else 0
        pairs = float(np.clip(np.arange(seq_q) + shift + 1, 0, seq_kv).sum())
    flops = 4.0 * batch * heads * pairs * head_dim
    if backward:
        flops *= 2.5
    return flops


def add_ring_shape_arguments(parser) -> None:
    """The ring benchmarks' shape: --ranks R of --threads T each, causal (1, --heads, --seq, --head-dim)."""
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)


def cpu_model() -> str:
    """lscpu's model name (the figure is meaningless without it)."""
    return cpuinfo_field("model name") or platform.processor() or "unknown"


def core_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def time_call(fn, min_seconds: float = 0.2, max_reps: int = 50, warmup_share: float = 0.0,
              min_reps: int = 3) -> list[float]:
    """Runs fn to warm up (once, or for warmup_share of min_seconds where calls are short), then repeatedly for
    about min_seconds but at most max_reps times; returns the timed calls' seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    while time.perf_counter() - start < warmup_share * min_seconds:
        fn()
    reps = max(min_reps, min(max_reps, int(min_seconds / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def interleaved_times(runs: dict, min_seconds: float, rounds: int = 5, min_reps: int = 3) -> dict:
    """Each callable's timed calls (seconds), taken in rounds that alternate between them; calls of seconds each
    (a padded batch) take fewer rounds and repetitions."""
    times = {name: [] for name in runs}
    for name, fn in runs.items():  # warm-up (compiles and caches graphattn's partition)
        fn()
    for _ in range(rounds):  # interleaved, so drifting clocks or neighbours hit every contender alike
        for name, fn in runs.items():
            # Each round warms up first: the other contender's calls just ran on these cores, and a call of
            # tens of microseconds timed right after them measures their traces in the caches, not itself.
            times[name] += time_call(fn, min_seconds / rounds, max_reps=1000, warmup_share=0.2, min_reps=min_reps)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


class Progress:
    """A one-line progress bar on stderr, so JSON lines on stdout stay clean."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.enabled = enabled and total > 0

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:6.1f}s  {label[:60]:<60}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], note: str = "") -> None:
    """rows as a table after the JSON lines: columns are (key, header, format spec), e.g. ("dtype", "dtype",
    "<5") or ("speedup", "speedup", ">8.2f"); note follows the header, with the CPU and threads of rows[0]."""
    def width(spec: str) -> str:
        return spec.rstrip("0123456789.f")[:1] + "".join(c for c in spec.split(".")[0] if c.isdigit())

    header = " ".join(f"{title:{width(spec)}}" for _, title, spec in columns)
    print(f"\n{header}   (cpu: {rows[0]['cpu']}, {rows[0]['threads']} threads{'; ' + note if note else ''})")
    for row in rows:
        print(" ".join(f"{row[key]:{spec}}" for key, _, spec in columns))
