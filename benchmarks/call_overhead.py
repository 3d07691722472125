"""Per-call overhead of ga.scaled_dot_product_attention on a tiny repeated call.

    python benchmarks/call_overhead.py [--calls 20000] [--rounds 5] [--new-lengths 200]

Shape (1, 1, 1, 1, 16): the kernel's work is negligible, so the time is the
Python path (cache lookup, binding, validation) plus the kernel launch.
Cases: NumPy inputs (plain, causal, stats); where torch is importable, torch
tensors of shape (1, 1, 1, 16) (torch) and, for scale, PyTorch's own
F.scaled_dot_product_attention on them (torch_sdpa).
Also decode calls whose K/V length S is new on each call (new_length: the plan of an earlier length is
re-made for it) against a call of that length again right after it, on other data, its plan then cached
(repeat_length), on NumPy and, where importable, torch inputs, with K/V contiguous and as views of one
preallocated buffer (static_), and with sinks and a softcap (sinks_, NumPy, contiguous); over a paged cache
(paged_: ga.attention_with_kv_cache, blocks of 16 rows, NumPy); their backward
(backward_, NumPy, contiguous), also with a bool padding mask (backward_mask_); and graph API partitions, the
forward's (graph_) and the training backward's (graph_backward_), compiled once with the K/V length unknown
(-1) and executed on new lengths.
Prints one JSON line per case and a table, then each new_length case's premium over its repeat_length
(call_overhead_premium lines and a second table).
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np

import graphattn as ga
from bench_common import cpu_model, print_table
from graphattn.dtypes import numpy_dtype
from graphattn.testing import SdpaGraphSpec

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch cases are optional
    torch = None


def measure(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        best = min(best, (time.perf_counter() - start) / (calls // 5))
    return best


NEW_LENGTHS = 200  # lengths per round (--new-lengths)
ROUNDS = 5  # (--rounds)


_OTHER_WORK = np.ones(1 << 19, np.float32)  # 2 MiB: more than a core's L2


def _other_work() -> None:
    """What a model does between two attention calls, in little: it takes the caches from the last call."""
    _OTHER_WORK.sum()
    sorted(range(2000), key=lambda i: -i)


def paired_times(calls) -> tuple[list, list]:
    """Seconds of each call of a new length (its first) and of a call of the same length and layout on other
    data (its plan cached), for calls: a list of (arrays to touch, the new call, the repeated call), each of a
    length no call had before.  Each timed call follows the same other work (_other_work), so that both start
    from caches in the same state and only the plan's cost differs."""
    new, repeat = [], []
    clock = time.perf_counter
    for touch, first, again in calls:
        for a in touch:
            a.sum()
        for call, times in ((first, new), (again, repeat)):
            _other_work()
            start = clock()
            call()
            times.append(clock() - start)
    return new, repeat


def length_cases(rng, rounds_count: int = ROUNDS, new_lengths: int = NEW_LENGTHS) -> dict:
    """{name: (shape, seconds per call)}: decode calls (1, 4, 1, 32) against K/V (1, 2, S, 32), a kernel small
    enough that the plan's cost shows.  Each round calls new_lengths lengths S that no call had before, each
    timed on its first call (new_length) and on a call of the same length and layout right after, on other
    data (repeat_length); the medians over every call of rounds_count rounds, for contiguous K/V (a cache that grows
    by concatenation) and for views of one preallocated buffer (a static cache)."""
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    longest = 64 + rounds_count * new_lengths
    buffers = [rng.standard_normal((1, 2, longest, 32)).astype(np.float32) for _ in range(2)]
    kinds = {"": np.asarray}
    if torch is not None:
        kinds["torch_"] = torch.from_numpy
    times: dict = {}

    def record(prefix, calls):
        new, repeat = paired_times(calls)
        times.setdefault(prefix + "new_length", []).extend(new)
        times.setdefault(prefix + "repeat_length", []).extend(repeat)

    def rounds():
        for r in range(rounds_count):
            yield range(64 + r * new_lengths, 64 + (r + 1) * new_lengths)

    def contiguous(n):  # K/V of length n from each buffer
        return [np.ascontiguousarray(b[:, :, :n]) for b in buffers]

    for prefix, wrap in kinds.items():
        query = wrap(q)
        for layout in ("", "static_"):
            for lengths in rounds():
                calls = []
                for n in lengths:
                    data = [b[:, :, :n] for b in buffers] if layout else contiguous(n)
                    first, again = (functools.partial(ga.scaled_dot_product_attention, query, wrap(kv), wrap(kv),
                                                      enable_gqa=True) for kv in data)
                    calls.append((data, first, again))
                record(prefix + layout, calls)
    # gpt-oss's decode: sinks and a softcap on NumPy, contiguous K/V
    sinks = rng.standard_normal(4).astype(np.float32)
    for lengths in rounds():
        calls = []
        for n in lengths:
            data = contiguous(n)
            calls.append((data, *(functools.partial(ga.scaled_dot_product_attention, q, kv, kv, enable_gqa=True,
                                                    sinks=sinks, softcap=30.0) for kv in data)))
        record("sinks_", calls)
    # decode over a paged cache (ga.attention_with_kv_cache, blocks of 16 rows in a table), as a generate loop
    # with a paged cache calls it: the call keeps no plan, so a new length should cost what a repeated one does
    block = 16
    pools = [rng.standard_normal((-(-longest // block), block, 2, 32)).astype(np.float32) for _ in range(2)]
    table = np.arange(pools[0].shape[0], dtype=np.int32)[None]
    q_rows = np.ascontiguousarray(q.transpose(0, 2, 1, 3))  # (1, 1, 4, 32)
    for lengths in rounds():
        calls = []
        for n in lengths:
            calls.append((pools, *(functools.partial(ga.attention_with_kv_cache, q_rows, p, p, cache_seqlens=n,
                                                     block_table=table) for p in pools)))
        record("paged_", calls)
    # the backward of such decode calls (training with dynamic padding plans each new length the same way), and
    # with a padding mask (bool, (1, 1, 1, S)), as a padded batch's training step passes it
    masks = {"backward_": lambda n: None, "backward_mask_": lambda n: rng.random((1, 1, 1, n)) < 0.9}
    for prefix, mask_of in masks.items():
        for lengths in rounds():
            calls = []
            for n in lengths:
                data = contiguous(n)
                mask = [mask_of(n) for _ in data]
                forwards = [ga.scaled_dot_product_attention(q, kv, kv, m, enable_gqa=True, return_stats=True)
                            for kv, m in zip(data, mask)]
                calls.append((data + [m for m in mask if m is not None] + [a for f in forwards for a in f],
                              *(functools.partial(ga.scaled_dot_product_attention_backward, out, q, kv, kv, out,
                                                  stats, m, enable_gqa=True)
                                for kv, m, (out, stats) in zip(data, mask, forwards))))
            record(prefix, calls)
    times.update(graph_length_times(rng, rounds_count, new_lengths))
    times.update(graph_length_times(rng, rounds_count, new_lengths, backward=True))
    shape = (1, 2, "S", 32)
    return {name: (shape, float(np.median(t))) for name, t in times.items()}


def graph_length_times(rng, rounds_count: int = ROUNDS, new_lengths: int = NEW_LENGTHS,
                       backward: bool = False) -> dict:
    """{name: [seconds per call]}: the graph API's partition (the forward's, or with backward the training
    backward's) compiled once with the K/V length unknown (-1), executed on new_lengths new lengths per round
    (graph_new_length: each is planned on first sight), each followed by a call of the same length on other
    data (graph_repeat_length)."""
    options = dict(seq_q=1, heads_q=4, head_dim=32, stats=backward, softmax_mode="inf_as_zero")
    spec = SdpaGraphSpec(seq_kv=-1, **options)
    (partition,) = (spec.build_backward() if backward else spec.build()).get_partitions()
    ports = partition.get_input_ports()
    engine = ga.Engine("cpu")
    stream = ga.Stream(engine)
    compiled = partition.compile(ports, partition.get_output_ports(), engine)
    new, repeat = [], []
    for r in range(rounds_count):
        calls = []
        for n in range(64 + r * new_lengths, 64 + (r + 1) * new_lengths):
            concrete = SdpaGraphSpec(seq_kv=n, **options)
            if backward:
                data = [concrete.backward_case(rng)[1] for _ in range(2)]
            else:
                concrete.build()
                data = [concrete.random_inputs(rng) for _ in range(2)]
            outs = compiled.query_dynamic_outputs([ga.LogicalTensor(lt.id, lt.dtype, data[0][lt.id].shape)
                                                   for lt in ports])
            runs = [functools.partial(compiled.execute, stream, [ga.Tensor(lt, engine, inputs[lt.id]) for lt in ports],
                                      [ga.Tensor(lt, engine, np.empty(lt.shape, numpy_dtype(lt.dtype))) for lt in outs])
                    for inputs in data]
            calls.append(([a for inputs in data for a in inputs.values()], *runs))
        pair = paired_times(calls)
        new.extend(pair[0])
        repeat.extend(pair[1])
    prefix = "graph_backward_" if backward else "graph_"
    return {prefix + "new_length": new, prefix + "repeat_length": repeat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of new lengths")
    parser.add_argument("--new-lengths", type=int, default=NEW_LENGTHS, help="new lengths per round")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 1, 1, 16)).astype(np.float32)
    cases = {  # name: (the inputs' shape, the call)
        "plain": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x)),
        "causal": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x, is_causal=True)),
        "stats": (x.shape, lambda: ga.scaled_dot_product_attention(x, x, x, return_stats=True)),
    }
    if torch is not None:  # graphattn on torch tensors, and PyTorch's own call on them for scale
        t = torch.from_numpy(x[0])  # 4-D: PyTorch takes 5-D inputs down a slower path
        cases["torch"] = (t.shape, lambda: ga.scaled_dot_product_attention(t, t, t))
        cases["torch_sdpa"] = (t.shape, lambda: F.scaled_dot_product_attention(t, t, t))
    timed = {name: (shape, measure(fn, args.calls)) for name, (shape, fn) in cases.items()}
    timed.update(length_cases(rng, args.rounds, args.new_lengths))
    rows = []
    for name, (shape, seconds) in timed.items():
        row = {"bench": "call_overhead", "case": name, "shape": list(shape), "dtype": "f32",
               "us_per_call": round(seconds * 1e6, 2), "cpu": cpu_model(), "threads": ga.thread_count()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print_table(rows, [("case", "case", "<27"), ("us_per_call", "us/call", ">8.1f")])
    # what a new length costs over a cached call of the same length, per pair of cases
    premiums = []
    for row in rows:
        if row["case"].endswith("new_length"):
            prefix = row["case"][:-len("new_length")]
            repeat = next(r for r in rows if r["case"] == prefix + "repeat_length")
            premiums.append({"bench": "call_overhead_premium", "case": prefix + "new_length",
                             "us_over_cached": round(row["us_per_call"] - repeat["us_per_call"], 2),
                             "cpu": row["cpu"], "threads": row["threads"]})
    for row in premiums:
        print(json.dumps(row))
    print_table(premiums, [("case", "case", "<27"), ("us_over_cached", "+us", ">8.1f")],
                "new length over its repeat_length")


if __name__ == "__main__":
    main()
