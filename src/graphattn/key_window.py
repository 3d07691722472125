"""The key window of an attention call, flash-attn's window_size, in one place for the Python side.

window=(left, right), -1 meaning no limit on that side: key j is visible to query row i iff
(left < 0 or j >= i' - left) and (right < 0 or j <= i' + right), where i' = i under causal_alignment
"top_left" and i + S_kv - S_q under "bottom_right".  is_causal=True sets right to 0 (intersected with any
window).  A row with no visible key gives 0, its stats -inf.  The kernels take the same rule from
native/cpu/include/graphattn/key_window.hpp, as these bounds and the alignment, which the kernel turns into
the row shift of each call's own lengths.
"""
from __future__ import annotations

import operator

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")
NO_LIMIT = -1  # a window side without a limit


def checked_window(window) -> tuple[int, int]:
    """(left, right) of a window argument: None (no window) or two integers, each >= -1."""
    if window is None:
        return NO_LIMIT, NO_LIMIT
    try:
        left, right = window
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        raise TypeError(f"window must be None or a pair of integers (left, right), got {window!r}") from None
    for name, value in (("left", left), ("right", right)):
        if value < NO_LIMIT:
            raise ValueError(f"window {name} must be -1 (no limit) or a key count >= 0, got {value}")
    return left, right


def checked_alignment(causal_alignment: str) -> str:
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    return causal_alignment


def effective_window(window, is_causal: bool) -> tuple[int, int]:
    """(left, right) of a call: its window, with is_causal limiting the right side to 0."""
    left, right = checked_window(window)
    if is_causal:
        right = 0 if right == NO_LIMIT else min(right, 0)
    return left, right


def row_shift(causal_alignment: str, seq_q: int, seq_kv: int) -> int:
    """i' - i: 0 top-left, S_kv - S_q bottom-right."""
    return seq_kv - seq_q if causal_alignment == "bottom_right" else 0


def is_limited(left: int, right: int) -> bool:
    return left != NO_LIMIT or right != NO_LIMIT


def diagonal_bounds(left: int, right: int, shift: int) -> tuple[int | None, int | None]:
    """(lowest, highest): key j is visible to row i iff lowest <= j - i <= highest (None: no bound)."""
    return (None if left == NO_LIMIT else shift - left), (None if right == NO_LIMIT else shift + right)


def visible(seq_q: int, seq_kv: int, left: int, right: int, causal_alignment: str = "top_left") -> np.ndarray:
    """The (seq_q, seq_kv) bool matrix of visible keys."""
    lowest, highest = diagonal_bounds(left, right, row_shift(causal_alignment, seq_q, seq_kv))
    diagonal = np.arange(seq_kv)[None, :] - np.arange(seq_q)[:, None]
    keep = np.ones((seq_q, seq_kv), bool)
    if lowest is not None:
        keep &= diagonal >= lowest
    if highest is not None:
        keep &= diagonal <= highest
    return keep
