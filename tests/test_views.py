"""Stride rules used to fold reshapes and transposes into the kernels' strides."""
import numpy as np
import pytest

from graphattn.views import reshape_strides, transpose_strides, untranspose_strides


def element_strides(a):
    return tuple(s // a.itemsize for s in a.strides)


@pytest.mark.parametrize("shape,perm,new_shape", [
    ((2, 8, 3, 4), (0, 2, 1, 3), (2, 3, 2, 4, 4)),   # split a transposed dim (GQA reshape of a BSHD view)
    ((2, 3, 4), (0, 1, 2), (6, 4)),
    ((2, 3, 4), (0, 1, 2), (2, 1, 3, 1, 4)),
    ((4, 6), (1, 0), (6, 2, 2)),
])
def test_reshape_strides_match_numpy_views(shape, perm, new_shape):
    base = np.arange(np.prod(shape), dtype=np.float32).reshape(shape).transpose(perm)
    strides = reshape_strides(base.shape, element_strides(base), new_shape)
    view = base.reshape(new_shape)
    assert strides is not None and np.shares_memory(view, base)
    rebuilt = np.lib.stride_tricks.as_strided(base, new_shape, [s * 4 for s in strides])
    assert np.array_equal(rebuilt, view)


def test_reshape_needing_a_copy_returns_none():
    base = np.zeros((4, 6), np.float32).T  # (6, 4) with strides (1, 6)
    assert reshape_strides(base.shape, element_strides(base), (24,)) is None


def test_transpose_round_trip():
    order = (0, 2, 1, 3)
    strides = (96, 8, 32, 1)
    assert untranspose_strides(transpose_strides(strides, order), order) == strides


def test_first_shared_memory_agrees_with_numpy_bounds(rng):
    """_cpu.first_shared_memory finds the first written array (from first_written on) whose byte span meets
    another's, as np.may_share_memory's default bounds check says, over random views of one buffer: slices,
    steps, negative strides, transposes, empty views, and objects that are not arrays."""
    from graphattn import _cpu

    memory = np.zeros((8, 12, 6), np.float32)
    other = np.zeros(40, np.float64)

    def random_view():
        kind = rng.integers(6)
        if kind == 0:
            return other[int(rng.integers(0, 20)):int(rng.integers(20, 40))]
        if kind == 1:
            return memory[int(rng.integers(0, 8)):int(rng.integers(0, 9)), ::int(rng.integers(1, 4))]
        if kind == 2:
            return memory[::-1, :, int(rng.integers(0, 6))]
        if kind == 3:
            return memory.transpose(2, 0, 1)[int(rng.integers(0, 6))]
        if kind == 4:
            return None
        return memory[int(rng.integers(0, 8)), int(rng.integers(0, 12)):int(rng.integers(0, 13))]

    for _ in range(400):
        arrays = tuple(random_view() for _ in range(int(rng.integers(2, 7))))
        first = int(rng.integers(0, len(arrays)))
        want = None
        for i in range(first, len(arrays)):
            for j, b in enumerate(arrays):
                a = arrays[i]
                if want is None and j != i and a is not None and b is not None and a.size and b.size and \
                        np.may_share_memory(a, b):
                    want = (i, j)
        assert _cpu.first_shared_memory(arrays, first) == want, [None if a is None else (a.shape, a.strides)
                                                                  for a in arrays]
