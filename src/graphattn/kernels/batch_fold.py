"""The kernels' batch: three dims.  A call with more folds adjacent dims that every operand walks as one
(the outer dim's stride is the inner's times its size, broadcast dims included) and drops size-1 dims; the
row-major flat batch index, which dropout's Philox mask counts, stays the same."""
from __future__ import annotations

KERNEL_BATCH_DIMS = 3


def fold_batch_dims(batch: tuple, strides: list[list[int]]) -> tuple[tuple, list[list[int]], tuple] | None:
    """(batch of KERNEL_BATCH_DIMS dims, each view's batch strides for it, the batch axes each kernel dim
    covers), padded with leading 1s (stride 0, no axes); strides[t] are view t's strides over `batch`.  A kernel
    dim's stride is that of the last axis it covers.  None where more than KERNEL_BATCH_DIMS dims remain."""
    dims = [(size, [s[i] for s in strides], (i,)) for i, size in enumerate(batch) if size != 1]
    merged: list[tuple[int, list[int], tuple]] = []
    for size, st, axes in dims:
        if merged and len(dims) > KERNEL_BATCH_DIMS:
            prev_size, prev_st, prev_axes = merged[-1]
            if all(p == s * size for p, s in zip(prev_st, st)):
                merged[-1] = (prev_size * size, st, prev_axes + axes)
                continue
        merged.append((size, st, axes))
    if len(merged) > KERNEL_BATCH_DIMS:
        return None
    pad = KERNEL_BATCH_DIMS - len(merged)
    out_batch = (1,) * pad + tuple(size for size, _, _ in merged)
    out_strides = [[0] * pad + [st[t] for _, st, _ in merged] for t in range(len(strides))]
    return out_batch, out_strides, ((),) * pad + tuple(axes for _, _, axes in merged)
