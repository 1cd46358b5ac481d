"""SGLang's host pools as views of the service's arenas: one host allocation, checked once.

SGLang's MLA KV host pool and DSA indexer host pool allocate their buffers through one table of
allocation functions (``pool_host/common.py`` ``ALLOC_MEMORY_FUNCS``). While the plug-in's
strategy builds SGLang's stack, :class:`ArenaViews` answers that table: the first of the two
buffers starts the service (``ServiceThread``: budget check and machine-wide ledger reservation,
then the arenas are allocated and first-touched, page-locked on CUDA), and both buffers are
returned as views of its arenas with the dims and dtype SGLang asked for. Anything else goes to
the allocation function that was there before.

Layouts: the service keeps each pool as ``[layers, pages, page bytes]`` (``layer_first``) or
``[pages, layers, page bytes]`` (``page_first``), a page's 64 tokens contiguous per layer. SGLang's
``layer_first`` and ``page_first_direct`` host layouts are exactly those (its ``page_first`` is
token-major inside a page, which is refused, refusals.py). SGLang sizes the indexer with one page
more than the KV pool; the service's page count is the indexer's, and the KV view leaves the last
page out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...config import PoolSize, ServiceConfig
from ...errors import HostBudgetExceeded, UnsupportedSettingError
from ...geometry import HostLayout, PageGeometry
from ..loop_thread import ServiceThread
from .sizing import HostPoolSizing, RankPeers, in_sglang_terms

log = logging.getLogger(__name__)

KV, INDEXER = "kv", "indexer"


class ArenaViews:
    """The allocation functions SGLang's host pools call while the strategy builds them."""

    def __init__(self, *, kvcache: Any, mem_layout: str, agree_pages: Callable[[int], int],
                 all_started: Callable[[bool], bool], service_options: dict[str, Any],
                 hicache_size_gb: int = 0,
                 rank_peers: Callable[[], RankPeers] = lambda: RankPeers(frozenset())
                 ) -> None:
        """``hicache_size_gb``: SGLang's --hicache-size (0: --hicache-ratio sizes the pools),
        and ``rank_peers()`` (a collective over the TP ranks, called on every rank right after
        ``agree_pages``), for a budget refusal's advice."""
        self._rank_peers = rank_peers
        self.kvcache = kvcache
        self.hicache_size_gb = hicache_size_gb
        self.num_layers = int(kvcache.layer_num)
        self.page_tokens = int(kvcache.page_size)
        self.mem_layout = mem_layout  #: SGLang's --hicache-mem-layout
        self.layout = HostLayout.LAYER_FIRST if mem_layout == "layer_first" else (
            HostLayout.PAGE_FIRST)
        first_kv = kvcache.kv_buffer[0]
        self.kv_token_bytes = first_kv.shape[-1] * first_kv.element_size()
        first_index = kvcache.index_k_with_scale_buffer[0]
        self.index_page_bytes = first_index.shape[-1] * first_index.element_size()
        self._agree_pages = agree_pages
        self._all_started = all_started
        self._service_options = service_options
        self.owner: ServiceThread | None = None
        self.whole_pool: Any = None  #: the one HostPages handle holding every host page
        self.served: set[str] = set()

    # --- the table SGLang's host pools allocate through -------------------------------------

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Answer SGLang's host allocation table while the block runs; restore it after."""
        from sglang.srt.mem_cache.pool_host import common

        table = common.ALLOC_MEMORY_FUNCS
        saved_entries, saved_default = dict(table), table.default_factory

        def previous(device: object) -> Callable[..., torch.Tensor]:
            key = getattr(device, "type", device)
            found = saved_entries.get(device, saved_entries.get(key))
            return found if found is not None else saved_default()

        def allocate(dims, dtype, device, pin_memory=False, allocator=None,
                     registration_granularity_bytes=None):
            view = self.view(tuple(int(d) for d in dims), dtype)
            if view is not None:
                return view
            return previous(device)(dims, dtype=dtype, device=device, pin_memory=pin_memory,
                                    allocator=allocator,
                                    registration_granularity_bytes=registration_granularity_bytes)

        table.clear()
        table.default_factory = lambda: allocate
        try:
            yield
        finally:
            table.clear()
            table.update(saved_entries)
            table.default_factory = saved_default

    def view(self, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The arena view for one of the two pools' buffers; ``None`` for anything else."""
        which = self._which(dims, dtype)
        if which is None:
            return None
        name, pages = which
        if self.owner is None:
            self._start(pages if name == INDEXER else pages + 1)
        arena = self.owner.service.host_pool.arenas[name]
        service_pages = arena.shape[1] if self.layout is HostLayout.LAYER_FIRST else arena.shape[0]
        wanted = pages
        if wanted > service_pages or (name == INDEXER and wanted != service_pages):
            raise UnsupportedSettingError(
                f"dsa_async SGLang plug-in: SGLang's {name} host pool asks for {wanted} pages "
                f"but the service holds {service_pages}; the KV and indexer host pools must "
                f"be sized together (this SGLang version sizes them differently than 0.5.23)")
        self.served.add(name)
        if self.layout is HostLayout.LAYER_FIRST:
            part = arena[:, :wanted]
        else:
            part = arena[:wanted]
        return part.view(dtype).view(dims)

    def _which(self, dims: tuple[int, ...], dtype: torch.dtype) -> tuple[str, int] | None:
        """(pool, pages) when ``dims``/``dtype`` are those of the KV or indexer host buffer in
        this layout; else ``None``."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        layers, ps = self.num_layers, self.page_tokens
        if self.layout is HostLayout.LAYER_FIRST:
            if (len(dims) == 4 and dims[0] == layers and dims[2] == 1
                    and dims[3] * itemsize == self.kv_token_bytes and dims[1] % ps == 0):
                return KV, dims[1] // ps
            if (len(dims) == 3 and dims[0] == layers
                    and dims[2] * itemsize == self.index_page_bytes):
                return INDEXER, dims[1]
            return None
        if (len(dims) == 5 and dims[1] == layers and dims[2] == ps and dims[3] == 1
                and dims[4] * itemsize == self.kv_token_bytes):
            return KV, dims[0]
        if (len(dims) == 4 and dims[1] == layers and dims[2] == 1
                and dims[3] * itemsize == self.index_page_bytes):
            return INDEXER, dims[0]
        return None

    # --- the service ----------------------------------------------------------------------

    def _start(self, pages: int) -> None:
        pages = self._agree_pages(pages)
        peers = self._rank_peers()
        kvcache, ps = self.kvcache, self.page_tokens
        geometries = (
            PageGeometry(KV, self.kv_token_bytes, self.num_layers, ps, self.layout),
            PageGeometry(INDEXER, _exact(self.index_page_bytes, ps), self.num_layers, ps,
                         self.layout),
        )
        kv_page_bytes = ps * self.kv_token_bytes
        buffers = {
            KV: [layer.view(torch.uint8).reshape(-1, kv_page_bytes) for layer in kvcache.kv_buffer],
            INDEXER: [layer.view(torch.uint8) for layer in kvcache.index_k_with_scale_buffer],
        }
        backend = "cuda" if kvcache.kv_buffer[0].is_cuda else "cpu"
        config = ServiceConfig(geometries=geometries, host_pool=PoolSize(pages=pages),
                               backend=backend, max_queued_requests=1 << 30,
                               **self._service_options.pop("config", {}))
        log.info("dsa_async: starting the offload service for SGLang: %d host pages of %d "
                 "layers (KV %d B + indexer %d B per token per layer), %s backend", pages,
                 self.num_layers, self.kv_token_bytes, self.index_page_bytes // ps, backend)
        failure: BaseException | None = None
        try:
            self.owner = ServiceThread.start(config, buffers, name="dsa-async-sglang",
                                             **self._service_options)
            service = self.owner.service
            # SGLang's allocator owns every host page: the service holds them all for it, so a
            # copy never waits for or is refused host pages (the same on every rank).
            self.whole_pool = self.owner.run(lambda: _take_all(service))
        except HostBudgetExceeded as exc:  # says what to change in SGLang's terms
            failure = in_sglang_terms(exc, self._sizing(), peers)
        except BaseException as exc:  # noqa: BLE001 - every rank hears of it first
            failure = exc
        # Every TP rank starts, or none does: a rank left running would wait for the others
        # in SGLang's first all-reduce (a host budget, for one, is checked per rank).
        if not self._all_started(failure is None):
            self.stop()
            if failure is not None:
                raise failure
            raise UnsupportedSettingError(
                "dsa_async SGLang plug-in: another TP rank could not start its offload service "
                "(its log says why); this rank stopped its own so that no rank runs alone")
        assert failure is None

    def _sizing(self) -> HostPoolSizing:
        """SGLang's inputs to the host pools' size on this rank (``pool_host/base.py``)."""
        kvcache = self.kvcache
        device_tokens = getattr(kvcache, "host_capacity_tokens", None)
        if device_tokens is None:
            device_tokens = kvcache.size
        return HostPoolSizing(kv_bytes_per_token=self.kv_token_bytes * self.num_layers,
                              page_tokens=self.page_tokens, device_tokens=int(device_tokens),
                              hicache_size_gb=int(self.hicache_size_gb or 0))

    def stop(self) -> None:
        """Drain and close the service (blocks); the arenas go with the last view of them."""
        self.whole_pool = None
        if self.owner is not None:
            self.owner.stop()


async def _take_all(service: Any) -> Any:
    return service.allocate_host_pages(service.statistics().capacity_pages)


def _exact(total: int, parts: int) -> int:
    if total % parts:
        raise UnsupportedSettingError(
            f"dsa_async SGLang plug-in: the indexer page of {total} B does not split into "
            f"{parts} token rows")
    return total // parts
