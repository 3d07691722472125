"""Run by tests/test_distributed.py under mpiexec (or, with --torch, as the ranks of a gloo process group): each
rank's shard of ring_attention and of its backward against the single-process call on the full tensors."""
import itertools
import os
import sys

import numpy as np

import graphattn as ga
from graphattn import distributed as gd
from graphattn.testing import assert_close, assert_grad_close, random_array

STATS_TOLERANCE = (1e-5, 1e-4)


def check(comm, rank, size, dtypes, wrap=lambda x: x, unwrap=np.asarray, causals=(False, True),
          layouts=("zigzag", "contiguous"), gqas=(False, True), rows=12, dims=(32, 16), batch=2) -> int:
    """Every case on this rank (rank of size): `rows` per chunk, head sizes dims (E, Ev); returns the number
    checked."""
    cases = 0
    for dtype, causal, layout, gqa in itertools.product(dtypes, causals, layouts, gqas):
        rng = np.random.default_rng(0)  # the same full tensors on every rank
        length = rows * (2 * size if layout == "zigzag" else size)
        hq, hkv = (4, 2) if gqa else (3, 3)
        q = random_array((batch, hq, length, dims[0]), dtype, rng)
        k = random_array((batch, hkv, length, dims[0]), dtype, rng)
        v = random_array((batch, hkv, length, dims[1]), dtype, rng)
        grad = random_array((batch, hq, length, dims[1]), dtype, rng)
        want, want_stats = ga.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, return_stats=True)
        want_grads = ga.scaled_dot_product_attention_backward(grad, q, k, v, want, want_stats, is_causal=causal,
                                                              enable_gqa=gqa)
        what = f"rank {rank} of {size}, {dtype}, causal={causal}, {layout}, gqa={gqa}"
        local = [gd.shard(wrap(x), comm, layout) for x in (q, k, v, grad)]
        options = dict(comm=comm, is_causal=causal, enable_gqa=gqa, layout=layout)
        out, stats = gd.ring_attention(*local[:3], return_stats=True, **options)
        assert_close(unwrap(out), gd.shard(want, comm, layout), dtype, f"output {what}")
        assert_close(unwrap(stats), gd.shard(want_stats, comm, layout), "f32", f"stats {what}", STATS_TOLERANCE)
        grads = gd.ring_attention_backward(local[3], *local[:3], out, stats, **options)
        magnitude = max(float(np.abs(g).max()) for g in want_grads)
        for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
            assert_grad_close(unwrap(got), gd.shard(expected, comm, layout), dtype, f"{name} {what}", magnitude)
        full = gd.unshard(out, comm, layout)
        assert_close(unwrap(full), want, dtype, f"unsharded output {what}")
        cases += 1
    return cases


# What rank 1 changes of an otherwise equal call, for --mismatch: each must be refused on every rank alike.
MISMATCHES = {
    "dtype": lambda x: x.astype(np.float16),  # the same bytes per element as bf16 would not tell
    "shape": lambda x: x.reshape(x.shape[0], x.shape[1] * 2, x.shape[2] // 2, x.shape[3]),  # same byte count
    "rows": lambda x: x[..., : x.shape[-2] // 2, :],  # other K/V byte counts
    "causal": None,
}


def mismatch(comm, rank: int, size: int, what: str, wrap=lambda x: x) -> None:
    """Rank 1 differs from the others in `what`; every rank prints the error it got, and whether they match is
    the test's to judge (each rank's line holds the whole message)."""
    x = np.ones((1, 2, 8 * size, 8), np.float32)
    causal = what == "causal" and rank == 1
    if rank == 1 and MISMATCHES[what] is not None:
        x = MISMATCHES[what](x)
    try:
        gd.ring_attention(wrap(x), wrap(x), wrap(x), comm=comm, is_causal=causal)
    except ValueError as why:
        print(f"rank {rank} refused: {why}", flush=True)
        return
    print(f"rank {rank} finished", flush=True)


def interrupt_mid_ring(comm, rank: int, size: int, wrap=lambda x: x) -> None:
    """Rank 1 is interrupted (KeyboardInterrupt) in its first kernel call of the ring; every rank must end."""
    calls = []
    kernel = gd.functional.scaled_dot_product_attention

    def interrupted(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            raise KeyboardInterrupt
        return kernel(*args, **kwargs)

    gd.functional.scaled_dot_product_attention = interrupted
    x = np.ones((1, 2, 8 * size, 8), np.float32)
    gd.ring_attention(wrap(x), wrap(x), wrap(x), comm=comm, is_causal=True)
    print(f"rank {rank} finished", flush=True)


def main() -> None:
    if "--torch" in sys.argv:  # the torch.distributed adapter on gloo, with autograd
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = dist.group.WORLD
        rank, size = dist.get_rank(), dist.get_world_size()
        for arg in sys.argv:
            if arg.startswith("--mismatch="):
                mismatch(group, rank, size, arg.split("=", 1)[1], wrap=torch.from_numpy)
                dist.destroy_process_group()
                return
        if "--interrupt-on-rank-1" in sys.argv:
            interrupt_mid_ring(group, rank, size, wrap=torch.from_numpy)
            return
        cases = check(group, rank, size, ["f32"], wrap=torch.from_numpy, unwrap=lambda t: t.detach().numpy())
        rng = np.random.default_rng(1)
        q, k, v = (torch.from_numpy(random_array((1, 2, 8 * size, 16), "f32", rng)) for _ in range(3))
        local = [gd.shard(x, group).requires_grad_() for x in (q, k, v)]
        out = gd.ring_attention(*local, comm=group, is_causal=True)
        out.backward(torch.ones_like(out))
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ga.scaled_dot_product_attention(*full, is_causal=True).backward(torch.ones(1, 2, 8 * size, 16))
        for name, mine, whole in zip(("dq", "dk", "dv"), local, full):
            assert_grad_close(mine.grad.numpy(), gd.shard(whole.grad, group).numpy(), "f32", f"autograd {name}")
        dist.destroy_process_group()
        print(f"rank {rank}: {cases} cases and autograd ok", flush=True)
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for arg in sys.argv:
        if arg.startswith("--mismatch="):
            mismatch(comm, comm.Get_rank(), comm.Get_size(), arg.split("=", 1)[1])
            return
    if "--interrupt-on-rank-1" in sys.argv:
        interrupt_mid_ring(comm, comm.Get_rank(), comm.Get_size())
        return
    if "--fail-on-rank-1" in sys.argv:  # a bad argument on one rank: every rank must exit with an error
        layout = "diagonal" if comm.Get_rank() == 1 else "zigzag"
        x = np.ones((1, 1, 4 * comm.Get_size(), 8), np.float32)
        gd.ring_attention(x, x, x, comm=comm, layout=layout)
        print(f"rank {comm.Get_rank()} finished", flush=True)
        return
    dtypes = os.environ.get("RING_DTYPES", "f32,bf16").split(",")
    cases = check(comm, comm.Get_rank(), comm.Get_size(), dtypes)
    # odd sizes: K/V shards of 3 heads x 5 rows x (7 + 6) values, whose bf16 bytes are no multiple of 4 (the
    # backward's f32 sums after them in one buffer must stay aligned)
    cases += check(comm, comm.Get_rank(), comm.Get_size(), dtypes, causals=(True,), layouts=("contiguous",),
                   gqas=(False,), rows=5, dims=(7, 6), batch=1)
    print(f"rank {comm.Get_rank()}: {cases} cases ok", flush=True)


if __name__ == "__main__":
    main()
