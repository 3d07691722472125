"""Where one rank's ring attention time goes: each kernel call, merge or gradient sum, and wait for a hop, per
rank, in one forward and one backward (the second of two), run under mpiexec.

    OMP_NUM_THREADS=4 mpiexec -n 4 [binding] python benchmarks/ring_profile.py [--seq 32768] [--heads 16]
                                                                               [--head-dim 128] [--dtype bf16]

Causal (1, H, S, D), zigzag.  Prints one JSON line per rank and pass (its total and its events in order, ms)
and a table of the sums: kernel calls, merges/sums, waits and the rest (buffers, Python) per rank and pass.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    from mpi4py import MPI

    import graphattn as ga
    from graphattn import _cpu, distributed as gd, functional, functional_backward
    from graphattn.testing import random_array
    from bench_common import cpu_model

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(rank)
    q, k, v, grad = (random_array((1, args.heads, args.seq // size, args.head_dim), args.dtype, rng)
                     for _ in range(4))
    events = []

    def timed(owner, name, kind):  # owner.name, each call's time recorded as (kind, ms)
        inner = getattr(owner, name)

        def call(*a, **kw):
            start = time.perf_counter()
            result = inner(*a, **kw)
            events.append((kind, (time.perf_counter() - start) * 1e3))
            return result
        setattr(owner, name, call)

    timed(functional, "scaled_dot_product_attention", "kernel")
    timed(functional_backward, "scaled_dot_product_attention_backward", "kernel")
    timed(_cpu, "merge_attention", "merge")
    timed(_cpu, "accumulate", "merge")
    timed(gd._Exchange, "join", "wait")
    rows = []
    for _ in range(2):  # the second of each is kept
        rows = []
        for name, run in (("forward", lambda: gd.ring_attention(q, k, v, comm=comm, is_causal=True,
                                                                return_stats=True)),
                          ("backward", lambda: gd.ring_attention_backward(grad, q, k, v, out, stats, comm=comm,
                                                                          is_causal=True))):
            events.clear()
            comm.Barrier()
            start = time.perf_counter()
            result = run()
            total = (time.perf_counter() - start) * 1e3
            if name == "forward":
                out, stats = result
            sums = {kind: sum(ms for k_, ms in events if k_ == kind) for kind in ("kernel", "merge", "wait")}
            rows.append({"bench": "ring_profile", "rank": rank, "ranks": size, "threads": ga.thread_count(),
                         "pass": name, "seq": args.seq, "heads": args.heads, "head_dim": args.head_dim,
                         "dtype": args.dtype, "total_ms": round(total, 1),
                         **{f"{kind}_ms": round(ms, 1) for kind, ms in sums.items()},
                         "other_ms": round(total - sum(sums.values()), 1),
                         "events": [(kind, round(ms, 1)) for kind, ms in events], "cpu": cpu_model()})
    everyone = comm.gather(rows, root=0)
    if rank == 0:
        print(f"ring profile, causal (1, {args.heads}, {args.seq}, {args.head_dim}) {args.dtype}: {size} ranks x "
              f"{ga.thread_count()} threads ({cpu_model()})")
        print(f"  {'rank':>4} {'pass':<8} {'total ms':>9} {'kernels':>9} {'merges':>8} {'waits':>8} {'other':>8}")
        for rank_rows in everyone:
            for row in rank_rows:
                print(json.dumps(row))
                print(f"  {row['rank']:>4} {row['pass']:<8} {row['total_ms']:>9.1f} {row['kernel_ms']:>9.1f} "
                      f"{row['merge_ms']:>8.1f} {row['wait_ms']:>8.1f} {row['other_ms']:>8.1f}")


if __name__ == "__main__":
    main()
