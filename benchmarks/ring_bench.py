"""Ring attention (graphattn.distributed) on R ranks of T threads against one process of R*T threads.

    python benchmarks/ring_bench.py [--ranks 4] [--threads 4] [--seq 32768] [--heads 16] [--head-dim 128]
                                    [--dtypes bf16,f32] [--repeats 3] [--rounds 1] [--no-binding]

Causal attention at (1, H, S, D), forward and backward, median of --repeats after a warm-up (and, with --rounds,
the medians over that many launches of each, alternating; the ratio is the median of each round's): the ring under
mpiexec (this environment's, else PATH's, which must be the MPI mpi4py runs on; each rank bound to its T cores
by Hydra's or Open MPI's options), the single process with R*T threads, and the ring's two halves apart: its
compute alone (the same kernel calls, each hop a copy on its own rank) and its communication alone (the same
hops with no kernel calls).  overlap = (compute + communication - ring) / communication: 1 where the
exchanges hide behind the kernels, 0 where they add up.  Prints one JSON line per case and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

from bench_common import add_ring_shape_arguments, cpu_model

HERE = pathlib.Path(__file__).resolve().parent


class _NoExchange:
    """A communicator whose hops stay on this rank (a local copy of what would be sent): the ring's compute
    alone, on real data (its results are not the attention's)."""

    def __init__(self, comm):
        self.comm = comm

    def Get_rank(self):
        return self.comm.Get_rank()

    def Get_size(self):
        return self.comm.Get_size()

    def Sendrecv(self, sendbuf, dest, recvbuf, source):
        recvbuf[...] = sendbuf

    def allgather(self, value):  # the ranks' signature check, as if every rank made this rank's call
        return [value] * self.Get_size()

    def Abort(self, code):
        self.comm.Abort(code)


def _median_ms(comm, fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        comm.Barrier()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def ring_worker(args) -> None:
    from mpi4py import MPI

    import graphattn as ga
    from graphattn import distributed as gd
    from graphattn.testing import random_array

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != args.ranks:  # a launcher of another MPI than mpi4py's starts singletons, each a world of 1
        raise SystemExit(f"ring_bench: the world has {size} rank(s), not --ranks {args.ranks}: mpiexec must come "
                         f"from the MPI mpi4py uses ({MPI.Get_library_version().splitlines()[0]})")
    for dtype in args.dtypes.split(","):
        rng = np.random.default_rng(rank)  # each rank makes its own shard: no full tensor is built
        local_rows = args.seq // size
        q, k, v, grad = (random_array((1, args.heads, local_rows, args.head_dim), dtype, rng) for _ in range(4))
        options = dict(is_causal=True)
        out, stats = gd.ring_attention(q, k, v, comm=comm, return_stats=True, **options)
        idle = _NoExchange(comm)
        kv_bytes = k.nbytes + v.nbytes
        hops = np.empty(kv_bytes, np.uint8), np.empty(kv_bytes, np.uint8)
        grad_hops = np.empty(kv_bytes + 4 * (k.size + v.size), np.uint8), np.empty(kv_bytes + 4 * (k.size + v.size),
                                                                                   np.uint8)

        def exchange(buffers, count):
            for _ in range(count):
                comm.Sendrecv(buffers[0], dest=(rank + 1) % size, recvbuf=buffers[1], source=(rank - 1) % size)

        row = {"bench": "ring_attention", "ranks": size, "threads_per_rank": ga.thread_count(), "seq": args.seq,
               "heads": args.heads, "head_dim": args.head_dim, "dtype": dtype}
        row["forward_ms"] = _median_ms(comm, lambda: gd.ring_attention(q, k, v, comm=comm, **options), args.repeats)
        row["forward_compute_ms"] = _median_ms(comm, lambda: gd.ring_attention(q, k, v, comm=idle, **options),
                                               args.repeats)
        row["forward_comm_ms"] = _median_ms(comm, lambda: exchange(hops, size - 1), args.repeats)
        row["backward_ms"] = _median_ms(comm, lambda: gd.ring_attention_backward(grad, q, k, v, out, stats,
                                                                                  comm=comm, **options), args.repeats)
        row["backward_compute_ms"] = _median_ms(comm, lambda: gd.ring_attention_backward(
            grad, q, k, v, out, stats, comm=idle, **options), args.repeats)
        row["backward_comm_ms"] = _median_ms(comm, lambda: exchange(grad_hops, size), args.repeats)
        if rank == 0:
            print(json.dumps(row), flush=True)


def single_worker(args) -> None:
    import graphattn as ga
    from graphattn.testing import random_array

    class _Local:
        def Barrier(self):
            pass

    for dtype in args.dtypes.split(","):
        rng = np.random.default_rng(0)
        q, k, v, grad = (random_array((1, args.heads, args.seq, args.head_dim), dtype, rng) for _ in range(4))
        out, stats = ga.scaled_dot_product_attention(q, k, v, is_causal=True, return_stats=True)
        row = {"bench": "single_process", "threads": ga.thread_count(), "seq": args.seq, "heads": args.heads,
               "head_dim": args.head_dim, "dtype": dtype}
        row["forward_ms"] = _median_ms(_Local(), lambda: ga.scaled_dot_product_attention(q, k, v, is_causal=True),
                                       args.repeats)
        row["backward_ms"] = _median_ms(_Local(), lambda: ga.scaled_dot_product_attention_backward(
            grad, q, k, v, out, stats, is_causal=True), args.repeats)
        print(json.dumps(row), flush=True)


def _launch(command: list, threads: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        [str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _mpiexec(ranks: int, threads: int, bind: bool = True) -> list:
    """This environment's mpiexec (the mpich wheel's), else PATH's, with its own way of binding each rank to
    `threads` cores (bind): Hydra's (MPICH, Intel MPI) or Open MPI's; else ranks left to the OS's scheduler."""
    local = pathlib.Path(sys.executable).parent / "mpiexec"
    mpiexec = str(local) if local.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("ring_bench: no mpiexec next to this Python or on PATH")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True)
    version = version.stdout + version.stderr
    if not bind:
        binding = ["--bind-to", "none"] if "open" in version.lower() else ["-bind-to", "none"]
    elif "open mpi" in version.lower() or "openrte" in version.lower():
        binding = ["--bind-to", "core", "--map-by", f"slot:PE={threads}"]
    elif "hydra" in version.lower():
        binding = ["-bind-to", f"core:{threads}"]
    else:
        binding = []  # another launcher: ranks go where it puts them
    return [mpiexec, "-n", str(ranks), *binding]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ring_shape_arguments(parser)
    parser.add_argument("--dtypes", default="bf16,f32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="launches of the ring and of the one process, alternating; figures are medians over them")
    parser.add_argument("--no-binding", action="store_true", help="leave the ranks unbound (the OS places them)")
    parser.add_argument("--worker", choices=["ring", "single"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ring":
        return ring_worker(args)
    if args.worker == "single":
        return single_worker(args)

    common = ["--seq", str(args.seq), "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtypes",
              args.dtypes, "--repeats", str(args.repeats)]
    launches = {
        "ring": ([*_mpiexec(args.ranks, args.threads, not args.no_binding), sys.executable, __file__, "--worker",
                  "ring", "--ranks", str(args.ranks), *common], args.threads),
        "single": ([sys.executable, __file__, "--worker", "single", *common], args.ranks * args.threads)}
    rounds = []  # per round, (ring rows, single rows), one row per dtype each
    for r in range(args.rounds):  # alternating which goes first, as the machine's pace drifts between launches
        order = ("ring", "single") if r % 2 == 0 else ("single", "ring")
        results = {name: _launch(*launches[name]) for name in order}
        rounds.append((results["ring"], results["single"]))
    print(f"ring attention, causal (1, {args.heads}, {args.seq}, {args.head_dim}): {args.ranks} ranks x "
          f"{args.threads} threads{' (unbound)' if args.no_binding else ''} against 1 x {args.ranks * args.threads}, "
          f"{args.rounds} round(s) ({cpu_model()})")
    print(f"  {'dtype':<5} {'pass':<8} {'single ms':>10} {'ring ms':>10} {'single/ring':>11} {'compute ms':>10} "
          f"{'comm ms':>9} {'comm share':>10} {'overlap':>8}")
    for i, first in enumerate(rounds[0][0]):
        for name in ("forward", "backward"):
            ring = [ring_rows[i] for ring_rows, _ in rounds]
            median = {key: float(np.median([row[f"{name}{key}"] for row in ring]))
                      for key in ("_ms", "_compute_ms", "_comm_ms")}
            single = float(np.median([single_rows[i][f"{name}_ms"] for _, single_rows in rounds]))
            ratios = [single_rows[i][f"{name}_ms"] / ring_rows[i][f"{name}_ms"] for ring_rows, single_rows in rounds]
            total, compute, comm = median["_ms"], median["_compute_ms"], median["_comm_ms"]
            row = dict(first, bench=f"ring_{name}", rounds=args.rounds, **{f"{name}{k}": v for k, v in median.items()},
                       single_ms=single, ratio=float(np.median(ratios)), round_ratios=ratios,
                       comm_share=comm / total, overlap=(compute + comm - total) / comm if comm else 1.0,
                       cpu=cpu_model())
            print(json.dumps(row), flush=True)
            print(f"  {first['dtype']:<5} {name:<8} {single:>10.1f} {total:>10.1f} {row['ratio']:>11.2f} "
                  f"{compute:>10.1f} {comm:>9.1f} {row['comm_share']:>10.2f} {row['overlap']:>8.2f}")


if __name__ == "__main__":
    main()
