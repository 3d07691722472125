"""Philox4x32-10 (Salmon et al., SC'11) and the dropout keep-mask built on it.

The keep decision of an element depends only on (seed, offset, linear index
of the element), never on thread or block order, so a forward and a backward
pass (or the CPU and a SYCL device) regenerate the same mask.  Element e uses
word e % 4 of Philox(key=seed, counter=(e // 4, offset)).
"""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32_10(counter: tuple[np.ndarray, ...], key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Ten Philox rounds on arrays of 32-bit counter words; returns four arrays of 32-bit words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0 = _M0 * c0.astype(np.uint64)
            p1 = _M1 * c2.astype(np.uint64)
            hi0, lo0 = (p0 >> _SHIFT).astype(np.uint32), (p0 & _LOW).astype(np.uint32)
            hi1, lo1 = (p1 >> _SHIFT).astype(np.uint32), (p1 & _LOW).astype(np.uint32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0 = np.uint32(k0 + _W0)
            k1 = np.uint32(k1 + _W1)
    return c0, c1, c2, c3


def bits64(value: int) -> int:
    """The 64-bit pattern a seed or offset stands for (a signed value's two's complement): what the
    Philox key and counter take, here and in every kernel."""
    return int(value) & 0xFFFFFFFFFFFFFFFF


def keep_threshold(p: float) -> int:
    """An element is kept when its 32-bit random word is >= this threshold."""
    return min(int(p * 4294967296.0), 4294967295)


def dropout_keep_mask(shape: tuple[int, ...], p: float, seed: int, offset: int) -> np.ndarray:
    """Boolean keep-mask of the given shape (True = kept, probability 1 - p)."""
    n = int(np.prod(shape, dtype=np.int64))
    index = np.arange(n, dtype=np.uint64)
    block = index >> np.uint64(2)
    seed_u, offset_u = bits64(seed), bits64(offset)
    words = philox4x32_10(
        ((block & _LOW).astype(np.uint32), (block >> _SHIFT).astype(np.uint32),
         np.full(n, offset_u & 0xFFFFFFFF, np.uint32), np.full(n, offset_u >> 32, np.uint32)),
        (seed_u & 0xFFFFFFFF, seed_u >> 32))
    stacked = np.stack(words, axis=-1)
    word = stacked[np.arange(n), (index & np.uint64(3)).astype(np.int64)]
    return (word >= np.uint32(keep_threshold(p))).reshape(shape)
