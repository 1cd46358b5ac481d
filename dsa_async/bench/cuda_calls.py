"""Count the device calls a piece of torch code makes, by running it on CPU tensors.

Every torch op that moves or computes data becomes one CUDA call when the same code runs on a
device: a ``copy_`` between host and device is a ``cudaMemcpyAsync``, one between two device
tensors or an index op is a kernel launch, a ``copy_`` into the device page index is an upload.
Ops that only describe memory (views, slices, strides, dtype reinterpretation) and allocations
are not calls on the stream. :class:`CudaCallCounter` intercepts every op below the Python API
(a ``TorchDispatchMode``) and counts the first kind, so the CUDA issue code can be measured on
a machine without a device.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
#: Ops that allocate or describe memory: no work is queued on a stream for them.
_NOT_CALLS = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.set_.source_Storage,
    _aten.set_.source_Storage_storage_offset, _aten._pin_memory.default,
    _aten.is_pinned.default, _aten.lift_fresh.default, _aten.detach.default,
})


class CudaCallCounter(TorchDispatchMode):
    """Within ``with counter:``, counts ops that would be CUDA calls (``calls``, ``by_op``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in _NOT_CALLS:
            self.calls += 1
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
