"""Deterministic page contents and per-page checksums over every pool and layer.

The device buffers are one 3-D ``uint8`` tensor per pool, ``[num_layers, device_pages,
bytes_per_page_per_layer]``, as an inference server holds its caches. Writing a page "computes"
its tokens: every layer's row becomes ``base[pool][layer] XOR c`` (seen as ``int64`` words),
where ``base`` is fixed random data and ``c = mix(seed, pool, layer)`` comes from the page's
seed, so each write gives the page new pseudo-random bytes in every pool and layer.

The checksum of a page: the ``int64`` sum of each ``(pool, layer)`` row (wrapping), folded
into one ``uint64`` with a distinct odd multiplier per ``(pool, layer)``, so a wrong page, a
stale page or swapped layers all change it. Sums are computed on the buffers' device (one layer
at a time, so a consumer can check a layer as soon as it is ready) and folded on the host.

Worked example, DSA indexer + MLA KV (fp8) at 61 layers: a page is 61 x (8,448 + 41,984) B =
3,076,352 B; its checksum reads all of them once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

_WORD = 8  # bytes per int64 word
#: The largest seed: ``torch.Generator.manual_seed`` takes 64 bits (numpy and ``random`` more).
MAX_SEED = 2**64 - 1


def splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on ``uint64 [n]`` (wrapping arithmetic), a cheap good mixer."""
    z = values.astype(np.uint64, copy=True)
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class PagePatterns:
    """Writes seeded contents into device pages and computes page checksums.

    ``buffers``: pool name -> ``uint8 [num_layers, device_pages, bytes_per_page_per_layer]``;
    every pool has the same number of layers and pages, and rows are whole ``int64`` words.
    Methods touching the buffers are for the forward-pass thread; none blocks the loop.
    """

    def __init__(self, buffers: Mapping[str, torch.Tensor], *, seed: int) -> None:
        shapes = {tuple(t.shape[:2]) for t in buffers.values()}
        if len(shapes) != 1:
            raise ValueError(f"every pool needs the same [layers, pages]; got {shapes}")
        self.num_layers, self.device_pages = shapes.pop()
        self.names = tuple(buffers)
        gen = torch.Generator().manual_seed(seed)
        self._words: list[torch.Tensor] = []
        self._base: list[torch.Tensor] = []
        for name in self.names:
            t = buffers[name]
            if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[2] % _WORD:
                raise ValueError(f"pool {name!r}: need uint8 [layers, pages, bytes] with rows of "
                                 f"whole int64 words, got {t.dtype} {tuple(t.shape)}")
            words = t.view(torch.int64)  # [L, P, W]
            self._words.append(words)
            base = torch.randint(-(1 << 62), 1 << 62, (self.num_layers, words.shape[2]),
                                 dtype=torch.int64, generator=gen)
            self._base.append(base.to(t.device))
        self.device = buffers[self.names[0]].device
        rng = np.random.default_rng(seed)
        self._fold = rng.integers(0, 1 << 63, (len(self.names), self.num_layers),
                                  dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd

    @property
    def num_pools(self) -> int:
        return len(self.names)

    def index(self, pages: np.ndarray) -> torch.Tensor:
        """Device page numbers as an index tensor on the buffers' device."""
        return torch.as_tensor(np.asarray(pages, dtype=np.int64)).to(self.device)

    def constants(self, seeds: np.ndarray) -> torch.Tensor:
        """``int64 [pools, layers, n, 1]`` XOR constants of pages with ``seeds`` (``uint64 [n]``)."""
        seeds = np.asarray(seeds, dtype=np.uint64)
        pools, layers = np.meshgrid(np.arange(self.num_pools, dtype=np.uint64),
                                    np.arange(self.num_layers, dtype=np.uint64), indexing="ij")
        salt = splitmix64((pools << np.uint64(32)) | layers)  # [pools, layers]
        mixed = splitmix64(seeds[None, None, :] ^ salt[:, :, None])
        return torch.from_numpy(mixed.view(np.int64)).unsqueeze(-1).to(self.device)

    def write_layer(self, layer: int, pages: torch.Tensor, constants: torch.Tensor,
                    out: torch.Tensor) -> None:
        """Write ``layer`` of ``pages`` (``int64 [n]``) in every pool; row sums into ``out``.

        ``constants``: from :meth:`constants` for these pages; ``out``: ``int64 [n, pools,
        layers]`` on the device, filled at ``[:, :, layer]`` with the sums of what was written.
        """
        for p, words in enumerate(self._words):
            rows = self._base[p][layer].unsqueeze(0) ^ constants[p, layer]  # [n, W]
            words[layer].index_copy_(0, pages, rows)
            out[:, p, layer] = rows.sum(dim=1)

    def sum_layer(self, layer: int, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Row sums of ``layer`` of ``pages`` as they are on the device, into ``out[:, :, layer]``."""
        for p, words in enumerate(self._words):
            out[:, p, layer] = words[layer].index_select(0, pages).sum(dim=1)

    def new_sums(self, num_pages: int) -> torch.Tensor:
        return torch.zeros((num_pages, self.num_pools, self.num_layers), dtype=torch.int64,
                           device=self.device)

    def fold(self, sums: torch.Tensor | np.ndarray) -> np.ndarray:
        """Per-page checksums (``uint64 [n]``) from row sums ``int64 [n, pools, layers]``."""
        if isinstance(sums, torch.Tensor):
            sums = sums.cpu().numpy()
        words = np.ascontiguousarray(sums).view(np.uint64)
        return (words * self._fold[None]).sum(axis=(1, 2), dtype=np.uint64)

    # --- whole pages, for tests and one-off use ---------------------------------------------

    def write_pages(self, pages: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Write whole ``pages`` from ``seeds`` in every layer; return their checksums."""
        index = self.index(pages)
        constants = self.constants(seeds)
        sums = self.new_sums(len(pages))
        for layer in range(self.num_layers):
            self.write_layer(layer, index, constants, sums)
        return self.fold(sums)

    def checksums(self, pages: np.ndarray) -> np.ndarray:
        """Checksums of ``pages`` as they are on the device now."""
        index = self.index(pages)
        sums = self.new_sums(len(pages))
        for layer in range(self.num_layers):
            self.sum_layer(layer, index, sums)
        return self.fold(sums)
