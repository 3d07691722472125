"""Shape rules shared by the element-wise ops: NumPy-style broadcasting."""
from __future__ import annotations

from typing import Sequence


def broadcast_shapes(shapes: Sequence[tuple[int, ...]], where: str, mode: str = "numpy") -> tuple[int, ...]:
    if mode == "none":
        if any(s != shapes[0] for s in shapes):
            raise ValueError(f"{where}: auto_broadcast='none' needs equal shapes, got {list(shapes)}")
        return tuple(shapes[0])
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        dims = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ValueError(f"{where}: shapes {list(shapes)} are not broadcastable (axis {axis - rank})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)
