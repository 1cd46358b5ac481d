"""Index tensors read without letting go of the GIL: the same values, memory and lifetime as
``Tensor.numpy()``, and negated views told apart as ``Tensor.is_neg()`` tells them."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from dsa_async.paging import tensor_view
from dsa_async.paging.tensor_view import int64_view, is_negated


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 1), (0, 300), (7, 300), (299, 300),
                                        (0, 513), (5, 2000)])
def test_the_view_reads_and_writes_the_tensors_memory(start, stop):
    whole = torch.randint(-2**62, 2**62, (2000,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(start))
    tensor = whole[start:stop]  # a storage offset, as a slice of a larger buffer has
    view = int64_view(tensor)
    assert view.dtype == np.int64 and view.shape == (stop - start,)
    np.testing.assert_array_equal(view, tensor.numpy())
    if stop > start:
        view[0] = 12345  # shares memory, as numpy() does
        assert whole[start].item() == 12345
        assert view.flags.c_contiguous and view.flags.aligned and view.flags.writeable


@pytest.mark.parametrize("n", [100, 5000])
def test_the_view_keeps_the_tensor_alive(n):
    tensor = torch.arange(1000, 1000 + n)
    alive = weakref.ref(tensor)
    view = int64_view(tensor)
    del tensor
    gc.collect()
    assert alive() is not None
    np.testing.assert_array_equal(view, np.arange(1000, 1000 + n))
    del view
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("keys", [True, False], ids=["dispatch-keys", "is_neg"])
def test_negated_views_are_told_apart(monkeypatch, keys):
    if not keys:
        monkeypatch.setattr(tensor_view, "_dispatch_keys", None)
    plain = torch.arange(5)
    negated = torch._neg_view(plain)
    assert negated.is_neg() and not plain.is_neg()
    assert is_negated(negated) and not is_negated(plain)
    assert not is_negated(negated.resolve_neg())
    assert not is_negated(plain[1:])
