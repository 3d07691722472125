"""One rank's share of the ring's causal forward, alone and with every rank's at once, against one process.

    python benchmarks/ring_contention.py [--ranks 4] [--threads 4] [--seq 32768] [--heads 16] [--head-dim 128]
                                         [--dtype bf16] [--repeats 5] [--core-rounds 3]

A rank of a zigzag ring of R ranks does the work of R causal calls of S / R rows (each step two blocks of
S / 2R, R steps), so the ring's kernels can match one process of R * T threads only where a causal call of
S / R rows on T threads takes R times less than the full call.  This times that call with no MPI at all: on
T threads pinned to cores 0 .. T-1 (alone), then R processes at once, each pinned to its own T cores (the
ring's placement), against one causal call of S rows on R * T threads.  ratio = single / (R * call): at or
above 1 where the ranks' kernels lose nothing; alone against at once shows what the ranks cost each other
(shared cache and memory, and clocks that drop when every core is busy).

Then the cores one by one, --core-rounds times: R * T one-thread processes at once, each pinned to its own core,
each timing the same causal call of S / (R * T) rows (a thread's share).  A static split of the work over the
ranks' groups of T cores (contiguous, as the launcher binds them) ends when its slowest group does, where one
process sharing its work out as threads finish uses every core's speed: group_bound = R * (the slowest group's
summed speed) / (every core's summed speed), speed = 1 / call time, is the most any static split reaches of
the one process on these cores, before any ring work.  Prints one JSON line per case and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from bench_common import add_ring_shape_arguments, cpu_model


def worker(args) -> None:
    """Times one causal call of --rows rows on this process's threads (on the cores its parent pinned it to)."""
    import graphattn as ga
    from graphattn.testing import random_array

    rng = np.random.default_rng(0)
    q, k, v = (random_array((1, args.heads, args.rows, args.head_dim), args.dtype, rng) for _ in range(3))
    out = np.empty_like(q)
    ga.scaled_dot_product_attention(q, k, v, is_causal=True, out=out)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ga.scaled_dot_product_attention(q, k, v, is_causal=True, out=out)
        times.append(time.perf_counter() - start)
    print(json.dumps({"rows": args.rows, "threads": ga.thread_count(), "ms": float(np.median(times)) * 1e3}),
          flush=True)


def _spawn(args, rows: int, threads: int, cores: range | None) -> subprocess.Popen:
    """A worker of `threads` threads, pinned to `cores` (None: where the OS puts it) before it starts."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--rows", str(rows), "--heads",
               str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype, "--repeats", str(args.repeats)]
    pin = None if cores is None or not hasattr(os, "sched_setaffinity") else (lambda: os.sched_setaffinity(0, cores))
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin,
                            env=dict(os.environ, OMP_NUM_THREADS=str(threads)))


def _results(processes: list) -> list:
    rows = []
    for p in processes:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise SystemExit(f"ring_contention: a worker failed:\n{stdout}\n{stderr}")
        rows.extend(json.loads(line) for line in stdout.splitlines() if line.startswith("{"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ring_shape_arguments(parser)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--core-rounds", type=int, default=3, help="rounds of the per-core case (0: none)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.seq % args.ranks:
        raise SystemExit(f"ring_contention: --seq {args.seq} does not split into {args.ranks} ranks")
    rows, threads = args.seq // args.ranks, args.threads
    (single,) = _results([_spawn(args, args.seq, args.ranks * threads, None)])
    (alone,) = _results([_spawn(args, rows, threads, range(threads))])
    together = _results([_spawn(args, rows, threads, range(r * threads, (r + 1) * threads))
                         for r in range(args.ranks)])
    common = {"bench": "ring_contention", "ranks": args.ranks, "threads_per_rank": threads, "seq": args.seq,
              "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype, "single_ms": single["ms"],
              "cpu": cpu_model()}
    cases = [("alone", [alone["ms"]])] + [("at_once", [r["ms"] for r in together])]
    print(f"causal (1, {args.heads}, S, {args.head_dim}) {args.dtype}: one process of {args.ranks * threads} threads "
          f"at S={args.seq} against {args.ranks} x a call of S={rows} on {threads} threads ({cpu_model()})")
    print(f"  {'case':<8} {'single ms':>10} {'call ms':>24} {'ranks x call ms':>16} {'ratio':>6}")
    for name, times in cases:
        slowest = max(times)
        row = dict(common, case=name, call_ms=times, ratio=single["ms"] / (args.ranks * slowest))
        print(json.dumps(row), flush=True)
        calls = ", ".join(f"{t:.1f}" for t in times)
        print(f"  {name:<8} {single['ms']:>10.1f} {calls:>24} {args.ranks * slowest:>16.1f} {row['ratio']:>6.2f}")
    cores = args.ranks * threads
    if args.core_rounds > 0:
        print(f"each core alone in a process of one thread, all {cores} at once, a causal call of "
              f"S={args.seq // cores} each:")
        print(f"  {'round':<6} {'call ms per core':<{7 * cores}} {'max/min':>7} {'group_bound':>11}")
    for round_ in range(args.core_rounds):
        times = [r["ms"] for r in _results([_spawn(args, args.seq // cores, 1, range(c, c + 1))
                                            for c in range(cores)])]
        speeds = [1.0 / t for t in times]
        slowest_group = min(sum(speeds[g * threads:(g + 1) * threads]) for g in range(args.ranks))
        row = dict(common, case="per_core", round=round_, call_ms=times, spread=max(times) / min(times),
                   group_bound=args.ranks * slowest_group / sum(speeds))
        print(json.dumps(row), flush=True)
        calls = " ".join(f"{t:>6.1f}" for t in times)
        print(f"  {round_:<6} {calls:<{7 * cores}} {row['spread']:>7.2f} {row['group_bound']:>11.3f}")


if __name__ == "__main__":
    main()
