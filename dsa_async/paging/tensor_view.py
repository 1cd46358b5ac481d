"""Index tensors read without letting go of the GIL.

Most torch calls release the GIL while they run, and a thread that lets go of it waits to get
it back for as long as another thread runs Python (up to ``sys.getswitchinterval()``). On a
server whose forward-pass or scheduler thread is busy in Python, the two calls the fast forms
used cost that wait on every request: ``Tensor.numpy()`` took 35-73 us and ``is_neg()`` 8-10 us
against a busy thread (0.6 and 0.1 us alone), on the loop and in a submitting thread alike.
These read the same facts through calls that keep the GIL (about 1 us either way).
Nothing here blocks.
"""

from __future__ import annotations

import numpy as np
import torch

_INT64_TYPESTR = np.dtype(np.int64).str

try:
    _dispatch_keys = torch._C._dispatch_keys
    _NEGATIVE = torch._C.DispatchKey.Negative
except AttributeError:  # a torch without them: ask the tensor (the GIL is let go)
    _dispatch_keys = None


def is_negated(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a lazily negated view (its memory holds the values negated)."""
    if _dispatch_keys is None:
        return tensor.is_neg()
    return _dispatch_keys(tensor).has(_NEGATIVE)


class _Int64Memory:
    """The numpy array interface of a tensor's memory; the array's base, so the tensor lives
    as long as the array does."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False),
                                    "shape": (tensor.numel(),), "typestr": _INT64_TYPESTR,
                                    "version": 3}


def int64_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a 1-D, contiguous, not negated ``int64`` CPU tensor (what
    ``tensor.numpy()`` returns for it), writable, sharing its memory. The caller has checked
    all of that (the checks cost as much as the view)."""
    assert tensor.dtype is torch.int64 and tensor.dim() == 1
    if tensor.numel() == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(_Int64Memory(tensor))
