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

import ctypes

import numpy as np
import torch

_INT64_DTYPE = np.dtype(np.int64)
_INT64_TYPESTR = _INT64_DTYPE.str
_INT64 = torch.int64

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


#: Up to this many values a view is a ctypes array over the tensor's memory (its type made
#: once per length, so at most this many types): 0.45 us, under what ``Tensor.numpy()`` takes;
#: longer ones go through the array interface (1 us, next to work that grows with the length).
_CTYPES_MAX = 512
_ctypes_arrays: list[type | None] = [None] * (_CTYPES_MAX + 1)


class _Int64Memory:
    """The numpy array interface of a tensor's memory; the array's base, so the tensor lives
    as long as the array does."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.__array_interface__ = {"data": (tensor.data_ptr(), False),
                                    "shape": (tensor.numel(),), "typestr": _INT64_TYPESTR,
                                    "version": 3}


def plain_int64_view(tensor: torch.Tensor) -> np.ndarray | None:
    """:func:`int64_view` of ``tensor`` when it is a 1-D, contiguous, not negated ``int64`` CPU
    tensor; ``None`` for any other. One call for the checks and the view (the request path
    makes it on every request)."""
    if (tensor.dtype is not _INT64 or not tensor.is_cpu or tensor.dim() != 1
            or not tensor.is_contiguous() or is_negated(tensor)):
        return None
    return int64_view(tensor)


def int64_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a 1-D, contiguous, not negated ``int64`` CPU tensor (what
    ``tensor.numpy()`` returns for it), writable, sharing its memory and keeping the tensor
    alive. The caller has checked all of that (the checks cost as much as the view)."""
    n = tensor.numel()
    if n > _CTYPES_MAX:
        return np.asarray(_Int64Memory(tensor))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    array_type = _ctypes_arrays[n]
    if array_type is None:
        array_type = _ctypes_arrays[n] = type(f"Int64Memory{n}", (ctypes.c_int64 * n,),
                                              {"__slots__": ("tensor",)})
    memory = array_type.from_address(tensor.data_ptr())
    memory.tensor = tensor  # the array's base holds the tensor
    return np.frombuffer(memory, _INT64_DTYPE)
