"""The references the engine is measured against.

* :class:`ContiguousCopy` — ``dst.copy_(src)`` between two warm, preallocated contiguous
  buffers of the same byte count (on CUDA: page-locked host <-> device, same direction). This
  is the speed of light for moving those bytes.
* :class:`TokenGranularCopy` — the best path that moves tokens instead of pages: per layer, the
  layer's bytes viewed as ``[tokens, 132] uint8`` -> ``[tokens, 33] int32``, the page's 64
  token rows gathered by token index (``index_select``) and scattered to the host token rows
  (``index_copy_``), and back. It moves exactly the bytes the engine moves.
"""

from __future__ import annotations

import torch

from ..paging.runs import page_tokens
from .copy_rig import CopyRig
from .device import BenchDevice


class ContiguousCopy:
    """Two warm contiguous buffers of ``nbytes``: one "device", one host."""

    def __init__(self, device: BenchDevice, nbytes: int) -> None:
        self.device = device
        self.host = device.host_reference_buffer(nbytes)
        self.dev = device.empty(nbytes)
        self.host.fill_(1)  # first touch: no page faults inside a timed copy
        self.dev.fill_(2)
        device.synchronize()

    def d2h(self, nbytes: int | None = None, offset: int = 0) -> None:
        end = offset + (nbytes or self.host.numel())
        self.host[offset:end].copy_(self.dev[offset:end], non_blocking=True)
        self.device.synchronize()

    def h2d(self, nbytes: int | None = None, offset: int = 0) -> None:
        end = offset + (nbytes or self.host.numel())
        self.dev[offset:end].copy_(self.host[offset:end], non_blocking=True)
        self.device.synchronize()

    def round_trip(self) -> None:
        self.d2h()
        self.h2d()


def _token_rows(layer_bytes: torch.Tensor, bytes_per_token: int) -> torch.Tensor:
    """A layer's ``uint8 [pages, B]`` as ``[tokens, bytes_per_token]`` rows, widest int view."""
    rows = layer_bytes.reshape(-1, bytes_per_token)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if bytes_per_token % size == 0 and rows.data_ptr() % size == 0:
            return rows.view(dtype)
    return rows


class TokenGranularCopy:
    """The token-granular path over the same page pairs as ``rig`` (132 B rows as int32)."""

    def __init__(self, rig: CopyRig) -> None:
        g = rig.geometry
        self.device = rig.ctx.device
        per_token = g.bytes_per_token_per_layer
        self.host_rows = [_token_rows(rig.binding.host[i], per_token) for i in range(g.num_layers)]
        self.dev_rows = [_token_rows(t, per_token) for t in rig.binding.device_layers]
        ps = g.page_size_tokens
        self.tokens_per_page = ps
        self.host_tokens = torch.from_numpy(page_tokens(rig.host_pages, ps))
        dev_tokens = torch.from_numpy(page_tokens(rig.device_pages, ps))
        self.dev_tokens = dev_tokens.to(self.device.torch_device)
        n_tokens = self.host_tokens.numel()
        like = self.host_rows[0]
        self.host_staging = torch.empty((n_tokens, like.shape[1]), dtype=like.dtype,
                                        pin_memory=self.device.is_cuda)
        self.dev_staging = (
            torch.empty_like(self.host_staging, device=self.device.torch_device)
            if self.device.is_cuda else self.host_staging
        )

    def _slices(self, batch_pages: int | None) -> list[slice]:
        n = self.host_tokens.numel()
        step = batch_pages * self.tokens_per_page if batch_pages else n
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def d2h(self, batch_pages: int | None = None) -> None:
        for s in self._slices(batch_pages):
            host_idx, dev_idx = self.host_tokens[s], self.dev_tokens[s]
            staged_dev, staged_host = self.dev_staging[s], self.host_staging[s]
            for host, dev in zip(self.host_rows, self.dev_rows):
                torch.index_select(dev, 0, dev_idx, out=staged_dev)
                if self.device.is_cuda:  # through page-locked staging, as a real path would
                    staged_host.copy_(staged_dev)
                host.index_copy_(0, host_idx, staged_host)
        self.device.synchronize()

    def h2d(self, batch_pages: int | None = None) -> None:
        for s in self._slices(batch_pages):
            host_idx, dev_idx = self.host_tokens[s], self.dev_tokens[s]
            staged_dev, staged_host = self.dev_staging[s], self.host_staging[s]
            for host, dev in zip(self.host_rows, self.dev_rows):
                torch.index_select(host, 0, host_idx, out=staged_host)
                if self.device.is_cuda:
                    staged_dev.copy_(staged_host)
                dev.index_copy_(0, dev_idx, staged_dev)
        self.device.synchronize()

    def round_trip(self) -> None:
        self.d2h()
        self.h2d()
