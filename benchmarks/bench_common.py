"""Shared by the benchmarks: the one FLOP count, the machine description and timing helpers."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

from graphattn.testing import cpuinfo_field


def attention_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, *, causal: bool = False,
                    backward: bool = False) -> float:
    """FLOPs of one SDPA call: 4*N*H*Sq*Skv*D (two matmuls), half of it when causal, 2.5x for the backward."""
    flops = 4.0 * batch * heads * seq_q * seq_kv * head_dim
    if causal:
        flops /= 2
    if backward:
        flops *= 2.5
    return flops


def cpu_model() -> str:
    """lscpu's model name (the figure is meaningless without it)."""
    return cpuinfo_field("model name") or platform.processor() or "unknown"


def core_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def time_call(fn, min_seconds: float = 0.2, max_reps: int = 50, warmup_share: float = 0.0) -> list[float]:
    """Runs fn to warm up (once, or for warmup_share of min_seconds where calls are short), then repeatedly for
    about min_seconds but at most max_reps times; returns the timed calls' seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    while time.perf_counter() - start < warmup_share * min_seconds:
        fn()
    reps = max(3, min(max_reps, int(min_seconds / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
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
