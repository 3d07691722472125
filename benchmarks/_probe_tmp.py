import sys, numpy as np, graphattn as ga
sys.path.insert(0, "benchmarks")
from bench_common import interleaved_times, median
from graphattn.testing import random_array
import varlen_bench as vb
rng = np.random.default_rng(0)
for dtype in ("bf16", "f32"):
    B, L, H, Hk, D = 4, 1024, 32, 8, 128
    q, k, v = (random_array((B, L, h, D), dtype, rng) for h in (H, Hk, Hk))
    cq = vb.cu([L] * B)
    flat = [x.reshape(B * L, *x.shape[2:]) for x in (q, k, v)]
    views = [x.swapaxes(1, 2) for x in (q, k, v)]
    head_major = np.empty((H, B * L, D), q.dtype).swapaxes(0, 1)
    runs = {"dense": lambda: ga.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True),
            "varlen": lambda: ga.varlen_attention(*flat, cq, cq, is_causal=True),
            "varlen_head_major_out": lambda: ga.varlen_attention(*flat, cq, cq, is_causal=True, out=head_major)}
    t = interleaved_times(runs, 2.0)
    print(dtype, {n: round(median(x) * 1e3, 3) for n, x in t.items()}, flush=True)
