"""A Llama-like transformers model (random weights from a config, nothing downloaded) run with
attn_implementation="graphattn" and "sdpa": forward, greedy generate with a KV cache, and a training step.

    python benchmarks/hf_llama_bench.py [--dtypes f32,bf16] [--seq 512] [--hidden 512] [--layers 2]

Both implementations get the same weights and inputs.  Each round times every phase once per
implementation, alternating which goes first, after one warm-up call of each phase; the figure is the median
over rounds.  Prints one JSON line per (dtype, phase) and a table with sdpa / graphattn (above 1: graphattn is
faster).  Attention's share of the model's time grows with --seq.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import graphattn as ga
import graphattn.torch
from bench_common import cpu_model, print_table

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def build(args, dtype) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4 * args.seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def phases(model, inputs, args) -> dict:
    """name -> a function running that phase once on model."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    prompt = inputs[:, : args.seq // 2]

    def forward():
        model.eval()
        with torch.no_grad():
            model(input_ids=inputs)

    def generate():
        model.eval()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)

    def train_step():
        model.train()
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return {"forward": forward, "generate": generate, "train_step": train_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name = graphattn.torch.register_transformers()
    rows = []
    for dtype in args.dtypes.split(","):
        base = build(args, DTYPES[dtype])
        inputs = torch.randint(0, base.config.vocab_size, (args.batch, args.seq),
                               generator=torch.Generator().manual_seed(1))
        runs = {}
        for implementation in (name, "sdpa"):
            model = copy.deepcopy(base)
            model.config._attn_implementation = implementation
            runs[implementation] = phases(model, inputs, args)
            for run in runs[implementation].values():  # warm-up: first calls, plans
                run()
        times = {(impl, phase): [] for impl in runs for phase in runs[impl]}
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for phase in runs[name]:
                for implementation in order:
                    start = time.perf_counter()
                    runs[implementation][phase]()
                    times[(implementation, phase)].append(time.perf_counter() - start)
        for phase in runs[name]:
            ours, theirs = (statistics.median(times[(impl, phase)]) for impl in (name, "sdpa"))
            row = {"bench": "hf_llama", "phase": phase, "dtype": dtype, "batch": args.batch, "seq": args.seq,
                   "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "layers": args.layers,
                   "new_tokens": args.new_tokens if phase == "generate" else None, "rounds": args.rounds,
                   "graphattn_ms": round(ours * 1e3, 2), "sdpa_ms": round(theirs * 1e3, 2),
                   "speedup_vs_sdpa": round(theirs / ours, 3), "cpu": cpu_model(), "threads": ga.thread_count(),
                   "torch": torch.__version__}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print_table(rows, [("phase", "phase", "<11"), ("dtype", "dtype", "<5"), ("graphattn_ms", "graphattn ms", ">12.1f"),
                       ("sdpa_ms", "sdpa ms", ">9.1f"), ("speedup_vs_sdpa", "speedup", ">8.2f")],
                f"seq {args.seq}, hidden {args.hidden}")

if __name__ == "__main__":
    main()
