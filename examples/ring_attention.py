"""Context-parallel causal attention over MPI: each rank holds a zigzag shard of the sequence, K/V travel around
the ring, and the result is checked against one process's call on the whole sequence.

    mpiexec -n 2 python examples/ring_attention.py [--seq 4096] [--dtype bf16]

Give each rank its share of the cores (OMP_NUM_THREADS=cores/ranks); docs/distributed.md says more.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import graphattn as ga
from graphattn import distributed as gd
from graphattn.testing import assert_close, assert_grad_close, random_array


def main(seq: int, dtype: str) -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)  # every rank draws the same full tensors, then keeps its shard
    q, k, v, grad = (random_array((1, 8, seq, 64), dtype, rng) for _ in range(4))
    local = [gd.shard(x, comm) for x in (q, k, v, grad)]
    comm.Barrier()
    start = time.perf_counter()
    out, stats = gd.ring_attention(*local[:3], comm=comm, is_causal=True, return_stats=True)
    comm.Barrier()
    forward_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    dq, dk, dv = gd.ring_attention_backward(local[3], *local[:3], out, stats, comm=comm, is_causal=True)
    comm.Barrier()
    backward_ms = (time.perf_counter() - start) * 1e3

    want, want_stats = ga.scaled_dot_product_attention(q, k, v, is_causal=True, return_stats=True)
    want_grads = ga.scaled_dot_product_attention_backward(grad, q, k, v, want, want_stats, is_causal=True)
    assert_close(out, gd.shard(want, comm), dtype, f"rank {rank} output")
    magnitude = max(float(np.abs(g).max()) for g in want_grads)
    for name, got, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads):
        assert_grad_close(got, gd.shard(expected, comm), dtype, f"rank {rank} {name}", magnitude)
    rows = gd.positions(seq, comm)
    print(f"rank {rank} of {size}: rows {rows[0]}..{rows[len(rows) // 2 - 1]} and {rows[len(rows) // 2]}..{rows[-1]}, "
          f"forward {forward_ms:.1f} ms, backward {backward_ms:.1f} ms, {ga.thread_count()} threads: "
          "matches the single-process call", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    args = parser.parse_args()
    main(args.seq, args.dtype)
