"""Gemma-2-like attention: logit softcap on every layer, a sliding window on every other one, GQA.

Each layer runs graphattn's fused forward and backward (softcap=50, window=(4095, 0) on the local layers, is_causal)
and is checked against the float64 reference; the times are printed.  Without softcap in the kernel, a
Gemma 2 user had to materialise the (L x S) scores.

    python examples/gemma2_attention.py [--dtype bf16] [--seq 512]
"""
from example_utils import model_example_main, run_layers


def main(dtype="f32", seq=512):
    # Gemma 2 9B's layout, scaled down: 16 query heads over 8 K/V heads, head size 256 -> 64, window 4096 -> S/4.
    layers = [dict(softcap=50.0, window=(seq // 4 - 1, 0) if local else None) for local in (True, False)]
    run_layers("gemma2-like", layers, dtype, batch=1, heads_q=16, heads_kv=8, seq=seq, head_dim=64)


if __name__ == "__main__":
    model_example_main(__doc__, main)
