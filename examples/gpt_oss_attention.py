"""gpt-oss-like attention: a learned sink logit per head on every layer, a sliding window on every other one, GQA.

Each layer runs graphattn's fused forward and backward (sinks, window=(127, 0) on the local layers, is_causal),
the sinks' gradient included, and is checked against the float64 reference; the times are printed.

    python examples/gpt_oss_attention.py [--dtype bf16] [--seq 512]
"""
import numpy as np

from example_utils import model_example_main, run_layers


def main(dtype="f32", seq=512):
    # gpt-oss's layout, scaled down: 64 query heads over 8 K/V heads -> 16 over 2, head size 64, window 128.
    sinks = np.random.default_rng(1).standard_normal(16).astype(np.float32)
    layers = [dict(sinks=sinks, window=(127, 0) if local else None) for local in (True, False)]
    run_layers("gpt-oss-like", layers, dtype, batch=1, heads_q=16, heads_kv=2, seq=seq, head_dim=64)


if __name__ == "__main__":
    model_example_main(__doc__, main)
