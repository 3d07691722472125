"""Decode over a KV cache larger than the last-level cache: graphattn's paged and dense caches against the
machine's streaming read bandwidth and against torch SDPA on the gathered cache, in one process, interleaved.

    python benchmarks/kvcache_bench.py [--sequences 16] [--cached 8192] [--block-sizes 16,256] [--dtype bf16]

Each contender runs one decode step (one query row per head per sequence) over the same cached rows:
  paged_<bs>     ga.attention_with_kv_cache on a paged cache of block size bs, blocks in a random order
  dense          ga.attention_with_kv_cache on a dense (B, S_cache, H_kv, D) cache
  dense_head_major  ga.scaled_dot_product_attention on the same rows laid out (B, H_kv, S, D)
  torch_gather   what users do without a paged call: gather each sequence's blocks (index_select) into a
                 dense (B, H_kv, S, D) K and V, then torch's scaled_dot_product_attention (where torch is here)
  paged_<bs>_<format>  the paged cache (first block size) stored quantized, one per --formats entry
                 ("u8:64" is u8 in groups of 64; fp8 formats take one scale): random bytes, the same table
With --kernels, each graphattn contender runs once per forward kernel named (forced; contender@kernel), so that
two kernels compare in the same run.  Then chunked prefill: --chunk query rows per sequence onto --chunk-onto
cached ones, paged (the smallest block size) against the dense forward of the same shape
(ga.scaled_dot_product_attention, bottom-right causal), as GFLOP/s.  The bandwidth is that of a multithreaded
sum over a buffer of the cache's size (torch's, else NumPy's on one thread, said in the output).  GB/s counts
every byte of K and V a step reads (a quantized cache's bytes, scales and zero points).  Prints a JSON line per contender and a table; ratios are the contender's
time over paged's (the smallest block size's).
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import graphattn as ga
from bench_common import Progress, attention_flops, cpu_model, interleaved_times, median, print_table
from graphattn import kv_quant
from graphattn.testing import random_array

try:
    import torch
except ImportError:  # the peer and the threaded bandwidth probe are optional
    torch = None


def paged(k_dense: np.ndarray, v_dense: np.ndarray, block_size: int, rng) -> tuple:
    """The dense (B, S, H, D) cache as (num_blocks, block_size, H, D) blocks in a random order, and its table."""
    b, s = k_dense.shape[:2]
    per = -(-s // block_size)
    order = rng.permutation(b * per).astype(np.int32)
    table = order.reshape(b, per)
    k = np.empty((b * per, block_size) + k_dense.shape[2:], k_dense.dtype)
    v = np.empty((b * per, block_size) + v_dense.shape[2:], v_dense.dtype)
    for seq in range(b):
        for blk in range(per):
            rows = slice(blk * block_size, min(s, (blk + 1) * block_size))
            k[table[seq, blk], :rows.stop - rows.start] = k_dense[seq, rows]
            v[table[seq, blk], :rows.stop - rows.start] = v_dense[seq, rows]
    return k, v, table


def quantized_cache(spec: str, shape: tuple, rng) -> tuple[dict, int]:
    """(attention_with_kv_cache's quantized-cache keywords, bytes of K and V with their scales) of random stored
    rows of shape (num_blocks, block_size, H_kv, D) in the format `spec` names ("u8:64": u8, groups of 64, or of
    D where D is smaller)."""
    name, _, group = spec.partition(":")
    fmt = kv_quant.format_named(name, "--formats")
    d = shape[-1]
    stored = shape[:-1] + (fmt.stored_cols(d),)
    out, nbytes = {"kv_format": name}, 0
    for side in ("k", "v"):
        data = rng.integers(0, 256, stored, dtype=np.uint8)
        if fmt.fp8 is not None:
            data &= 0x77  # no NaN or infinity codes
            out[f"{side}_scales"] = np.array(0.25, np.float32)
        else:
            groups = shape[:-1] + (d // min(int(group or d), d),)  # a group of at most the row
            out[f"{side}_scales"] = np.full(groups, 1 / 64, np.float16)
            if not fmt.symmetric:
                out[f"{side}_zero_points"] = rng.integers(0, 2 ** fmt.bits, groups, dtype=np.uint8)
        out[f"{side}_cache"] = data
        nbytes += sum(a.nbytes for key, a in out.items() if key.startswith(side + "_"))
    return out, nbytes


def sig(x: float) -> float:
    """x to 4 significant digits (a tiny case's rates round to 0 at a fixed number of decimals)."""
    return float(f"{x:.4g}")


def stream_read(nbytes: int):
    """(callable reading a buffer of nbytes once, what reads it)."""
    if torch is not None:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        return (lambda: x.sum()), f"torch.sum, {torch.get_num_threads()} threads"
    x = np.ones(nbytes // 4, np.float32)
    return (lambda: x.sum()), "numpy.sum, 1 thread"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--cached", type=int, default=8192, help="cached rows per sequence")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-sizes", default="16,256")
    parser.add_argument("--dtype", default="bf16", choices=("f32", "bf16", "f16"))
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", default="auto",
                        help="forward kernels to force on the graphattn contenders, comma-separated (auto: the choice)")
    parser.add_argument("--formats", default="u8:64,s8:64,u4:32,s4:32,fp8_e4m3",
                        help="quantized paged caches to time, comma-separated (empty: none)")
    parser.add_argument("--chunk", type=int, default=512, help="chunked prefill: query rows (0: none)")
    parser.add_argument("--chunk-onto", type=int, default=4096, help="chunked prefill: rows cached before it")
    parser.add_argument("--chunk-sequences", type=int, default=2)
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    for kernel in kernels:  # an unknown or unusable name fails here, before the caches are built
        with ga.force_kernel(forward=kernel):
            pass
    rng = np.random.default_rng(args.seed)
    b, s, h, hk, d = args.sequences, args.cached, args.heads, args.kv_heads, args.head_dim
    progress = Progress(4)
    progress.step("caches")
    k_dense, v_dense = (random_array((b, s, hk, d), args.dtype, rng) for _ in range(2))
    q = random_array((b, 1, h, d), args.dtype, rng)
    lens = np.full(b, s, np.int32)
    kv_bytes = 2 * k_dense.nbytes
    runs = {}
    bytes_of, format_of = {}, {}  # contenders of quantized caches: their K/V bytes and format
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    caches = {}
    for bs in block_sizes:
        caches[bs] = paged(k_dense, v_dense, bs, rng)
        kc, vc, table = caches[bs]
        runs[f"paged_{bs}"] = (lambda kc=kc, vc=vc, table=table:
                               ga.attention_with_kv_cache(q, kc, vc, cache_seqlens=lens, block_table=table))
    for spec in filter(None, args.formats.split(",")):
        shape = (caches[block_sizes[0]][0].shape[0], block_sizes[0], hk, d)
        cache, nbytes = quantized_cache(spec, shape, rng)
        name = f"paged_{block_sizes[0]}_{spec.replace(':', '_g')}"
        table = caches[block_sizes[0]][2]
        runs[name] = (lambda cache=cache, table=table:
                      ga.attention_with_kv_cache(q, cache["k_cache"], cache["v_cache"], cache_seqlens=lens,
                                                 block_table=table, **{key: a for key, a in cache.items()
                                                                       if key not in ("k_cache", "v_cache")}))
        bytes_of[name] = nbytes
        format_of[name] = spec
    runs["dense"] = lambda: ga.attention_with_kv_cache(q, k_dense, v_dense, cache_seqlens=lens)
    # The same rows head-major, (B, H_kv, S, D): each head's rows adjacent, as the dense call reads them best.
    k_heads, v_heads = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (k_dense, v_dense))
    q_heads = np.ascontiguousarray(q.swapaxes(1, 2))
    runs["dense_head_major"] = lambda: ga.scaled_dot_product_attention(q_heads, k_heads, v_heads, enable_gqa=True)
    if kernels != ["auto"]:
        def forced(run, kernel):
            def call():
                with ga.force_kernel(forward=kernel):
                    return run()
            return call
        runs = {f"{name}@{kernel}": forced(run, kernel) for name, run in runs.items() for kernel in kernels}
        bytes_of = {f"{name}@{kernel}": n for name, n in bytes_of.items() for kernel in kernels}
        format_of = {f"{name}@{kernel}": n for name, n in format_of.items() for kernel in kernels}
    if torch is not None and not args.no_peers:
        kc, vc, table = caches[block_sizes[0]]
        as_t = (lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)) if args.dtype == "bf16" else \
            torch.from_numpy
        tk, tv, tt = as_t(kc), as_t(vc), torch.from_numpy(table.astype(np.int64))
        tq = as_t(q).transpose(1, 2)

        def torch_gather():
            with torch.no_grad():
                kk = tk[tt].reshape(b, -1, hk, d)[:, :s].transpose(1, 2)
                vv = tv[tt].reshape(b, -1, hk, d)[:, :s].transpose(1, 2)
                torch.nn.functional.scaled_dot_product_attention(tq, kk, vv, enable_gqa=True)
        runs["torch_gather"] = torch_gather
    read, reader = stream_read(kv_bytes)
    runs["stream_read"] = read
    progress.step("timing")
    times = interleaved_times(runs, args.seconds, args.rounds)
    progress.step("done")
    stream_gbs = kv_bytes / median(times["stream_read"]) / 1e9
    base = f"paged_{block_sizes[0]}" + ("" if kernels == ["auto"] else f"@{kernels[0]}")
    rows = []
    for name, t in times.items():
        if name == "stream_read":
            continue
        ms = median(t) * 1e3
        nbytes = bytes_of.get(name, kv_bytes)
        row = {"bench": "kvcache_decode", "contender": name, "dtype": args.dtype,
               "kv_format": format_of.get(name, args.dtype), "sequences": b, "cached": s,
               "heads": [h, hk], "head_dim": d, "kv_bytes": nbytes, "kv_mib": round(nbytes / 2**20, 1),
               "ms": round(ms, 3),
               "kv_gbs": sig(nbytes / (ms * 1e-3) / 1e9), "stream_gbs": sig(stream_gbs),
               "of_stream": sig(nbytes / (ms * 1e-3) / 1e9 / stream_gbs),
               f"vs_{base}": float(f"{median(t) / median(times[base]):.4g}"), "stream_reader": reader,
               "threads": ga.thread_count(), "cpu": cpu_model()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.chunk > 0:
        progress.step("chunked prefill")
        rows.append(chunked_prefill(args, rng))
        print(json.dumps(rows[-1]), flush=True)
    decode = [r for r in rows if r["bench"] == "kvcache_decode"]
    print_table(decode, [("contender", "contender", "<28"), ("ms", "ms", ">9.3f"), ("kv_mib", "K/V MiB", ">8.0f"),
                         ("kv_gbs", "K/V GB/s", ">9.1f"),
                         ("of_stream", "of stream", ">9.3f"), (f"vs_{base}", f"vs {base}", ">10.3f")],
                f"decode, {b} x {s} cached rows, H {h}/{hk}, D {d}, {args.dtype}, {kv_bytes / 2**20:.0f} MiB of K/V; "
                f"stream read {stream_gbs:.1f} GB/s ({reader})")

    prefill = [r for r in rows if r["bench"] == "kvcache_prefill"]
    if prefill:
        print_table(prefill, [("paged_gflops", "paged GFLOP/s", ">14.1f"), ("dense_gflops", "dense GFLOP/s", ">14.1f"),
                              ("paged_over_dense", "paged/dense", ">12.3f")],
                    f"chunked prefill, {args.chunk_sequences} x {args.chunk} rows onto {args.chunk_onto}, "
                    f"{args.dtype}, causal bottom-right")


def chunked_prefill(args, rng) -> dict:
    """GFLOP/s of a chunk of query rows onto a paged cache against the dense forward over the same keys."""
    b, h, hk, d, chunk, total = args.chunk_sequences, args.heads, args.kv_heads, args.head_dim, args.chunk, \
        args.chunk_onto + args.chunk
    bs = int(args.block_sizes.split(",")[0])
    k_dense, v_dense = (random_array((b, total, hk, d), args.dtype, rng) for _ in range(2))
    q = random_array((b, chunk, h, d), args.dtype, rng)
    kc, vc, table = paged(k_dense, v_dense, bs, rng)
    kh, vh = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (k_dense, v_dense))
    qh = np.ascontiguousarray(q.swapaxes(1, 2))
    lens = np.full(b, total, np.int32)
    times = interleaved_times({
        "paged": lambda: ga.attention_with_kv_cache(q, kc, vc, cache_seqlens=lens, block_table=table, is_causal=True),
        "dense": lambda: ga.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True,
                                                         causal_alignment="bottom_right")}, args.seconds, args.rounds)
    flops = attention_flops(b, h, chunk, total, d, causal=True, alignment="bottom_right")
    paged_gflops, dense_gflops = (flops / median(times[n]) / 1e9 for n in ("paged", "dense"))
    return {"bench": "kvcache_prefill", "dtype": args.dtype, "sequences": b, "chunk": chunk, "onto": args.chunk_onto,
            "block_size": bs, "heads": [h, hk], "head_dim": d, "paged_ms": sig(median(times["paged"]) * 1e3),
            "dense_ms": sig(median(times["dense"]) * 1e3), "paged_gflops": sig(paged_gflops),
            "dense_gflops": sig(dense_gflops), "paged_over_dense": sig(paged_gflops / dense_gflops),
            "threads": ga.thread_count(), "cpu": cpu_model()}


if __name__ == "__main__":
    main()
