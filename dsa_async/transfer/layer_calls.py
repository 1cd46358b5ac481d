"""One layer's copy as one call that a crew thread runs with the GIL released.

The CPU engine shares a batch's layers out between its crew's threads (``CopyCrew.stream`` for
a load, ``CopyCrew.map`` for a backup), so a layer's copy must need no shared staging and hold
the GIL as little as possible: while one thread runs Python, the others wait for the GIL as
soon as their copy ends. Binding a layer's run copies as numpy views on the crew threads cost
a streamed load of host extents a quarter of its time for that reason (15.2 against 11.9 ms
for 140 MB on 2 cores), so packed rows move as one ``memmove`` per run from offsets computed
once per batch and pool.

``host`` and ``dev`` are one layer's rows in one element type (``PoolBinding.layers_wide``).
Nothing here blocks except the returned calls, on the calling thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

#: libc's memmove as a foreign function: the GIL is released while it copies.
_memmove = ctypes.memmove


class RunBlocks:
    """A plan's runs ``[host_start, device_start, pages]`` as byte moves for rows of
    ``row_bytes``, with the rows each side must hold (made once per batch and pool)."""

    __slots__ = ("moves", "host_rows", "device_rows", "row_bytes")

    def __init__(self, runs: np.ndarray, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.moves: list[list[int]] = (runs * row_bytes).tolist()
        ends = runs[:, :2] + runs[:, 2:3]
        self.host_rows, self.device_rows = (int(x) for x in ends.max(axis=0))


def _packed(rows: torch.Tensor) -> bool:
    """Whether ``rows`` ([pages, width]) lie back to back, so a run of pages is one block."""
    return rows.stride(1) == 1 and (rows.shape[0] <= 1 or rows.stride(0) == rows.shape[1])


def run_copy(host: torch.Tensor, dev: torch.Tensor, runs: np.ndarray, blocks: RunBlocks,
             to_host: bool) -> Callable[[], None]:
    """One layer's copy of ``runs`` (``[r, 3]``): a ``memmove`` per run when both sides' rows
    are packed (``blocks``: the runs in bytes for this row size), else a numpy block copy per
    run (``dst[a:b] = src[c:d]``)."""
    if _packed(host) and _packed(dev):
        assert blocks.row_bytes == host.shape[1] * host.element_size()
        # A bad offset here would write outside the tensors: the plan's pages were validated
        # against the pool and the device buffers, and this checks it once more.
        assert blocks.host_rows <= host.shape[0] and blocks.device_rows <= dev.shape[0]
        host_at, dev_at, moves = host.data_ptr(), dev.data_ptr(), blocks.moves
        if to_host:
            def copy() -> None:
                for h, d, n in moves:
                    _memmove(host_at + h, dev_at + d, n)
        else:
            def copy() -> None:
                for h, d, n in moves:
                    _memmove(dev_at + d, host_at + h, n)
        return copy
    host_np, dev_np = host.numpy(), dev.numpy()
    pairs = [(host_np[h:h + k], dev_np[d:d + k]) for h, d, k in runs.tolist()]
    if not to_host:
        pairs = [(d, h) for h, d in pairs]  # (destination, source)

    def copy_views() -> None:
        for dst, src in pairs:
            dst[...] = src
    return copy_views


def gather_scatter(host: torch.Tensor, dev: torch.Tensor, host_index: torch.Tensor,
                   device_index: torch.Tensor, to_host: bool) -> Callable[[], None]:
    """One layer's copy of single pages scattered on both sides: numpy's ``dst[i] = src[j]``,
    which gathers into a private temporary and scatters from it, a block per row."""
    src, dst = (dev, host) if to_host else (host, dev)
    src_index, dst_index = (device_index, host_index) if to_host else (host_index, device_index)
    src_np, dst_np = src.numpy(), dst.numpy()
    src_at, dst_at = src_index.numpy(), dst_index.numpy()

    def copy() -> None:
        dst_np[dst_at] = src_np[src_at]
    return copy
