"""oneDNN Graph as a benchmark peer, reached through PyTorch's TorchScript oneDNN fusion (LLGA).

PyTorch's CPU wheels carry their own oneDNN (3.12 in torch 2.13) with its Graph API on OpenMP, and
torch.jit.enable_onednn_fusion(True) hands traced graphs to it: the SDPA pattern (MatMul, scale,
optional Add of a mask, SoftMax, MatMul) becomes one oneDNN Graph partition, which oneDNN compiles
with its own SDPA kernel choice (ONEDNN_VERBOSE=all names it, e.g. sdp_decomp_kernel_t).

Reachable this way: inference, f32 and bf16, K/V with as many heads as Q. Not reachable: f16 and
GQA (the bridge leaves those ops unfused), the implicit causal mask (no PyTorch op maps to it, so a
causal call gets an explicit -inf mask, which oneDNN computes in full), the training backward.
sdpa_bench.py's onednn peer (onednn_graph_peer.py, PyPI's oneDNN 3.13 on the C API) has those; this
one is the onednn_jit peer.
"""
from __future__ import annotations

import functools
import math
import re
import warnings

try:
    import torch
except ImportError:  # the peer is optional
    torch = None

PEER_DTYPES = ("f32", "bf16")


@functools.lru_cache(maxsize=None)
def onednn_version() -> str | None:
    """The oneDNN version PyTorch was built with, or None where the bridge is missing."""
    if torch is None or not hasattr(torch.jit, "enable_onednn_fusion"):
        return None
    found = re.search(r"DNN v([0-9.]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def unusable_reason(dtype: str, heads_q: int, heads_kv: int) -> str | None:
    """Why oneDNN Graph cannot take this case through the bridge, or None when it can."""
    if onednn_version() is None:
        return "PyTorch with torch.jit.enable_onednn_fusion is not installed"
    if dtype not in PEER_DTYPES:
        return f"the bridge fuses {', '.join(PEER_DTYPES)} only"
    if heads_q != heads_kv:
        return "the bridge does not fuse GQA"
    return None


def is_one_partition(graph_text: str) -> bool:
    """Whether one oneDNN fusion group of an optimized TorchScript graph holds both matmuls and the softmax."""
    groups = graph_text.split("prim::oneDNNFusionGroup_")[1:]
    return any(body.count("aten::matmul") >= 2 and "aten::softmax" in body for body in groups)


def onednn_sdpa(q, k, v, causal: bool):
    """A callable running SDPA on q, k, v (torch tensors, same heads) through oneDNN Graph, or None where
    oneDNN did not take the whole pattern as one partition."""
    seq_q, seq_kv, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim)
    operands = [q, k, v]
    if causal:  # top-left aligned, as is_causal of the functional API and of PyTorch
        mask = torch.full((seq_q, seq_kv), float("-inf"), dtype=q.dtype).triu(1)
        operands.append(mask)

    def pattern(q, k, v, *mask):
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mask:
            scores = scores + mask[0]
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    torch.jit.enable_onednn_fusion(True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(pattern, tuple(operands))
        for _ in range(3):  # the profiling executor fuses on the second or third run
            traced(*operands)
        if not is_one_partition(str(torch.jit.last_executed_optimized_graph())):
            return None

    def run():
        with torch.no_grad():
            return traced(*operands)
    return run
