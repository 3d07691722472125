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
