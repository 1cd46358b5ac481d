"""The stack strategy SGLang picks for DSA models when the plug-in is on (see __init__.py).

``matches`` takes what SGLang's own ``_DsaStrategy`` takes (a ``DSATokenToKVPool`` with full
attention only), and only while ``DSA_ASYNC_SGLANG=1``; every other model is left to SGLang's
strategies (logged at info once per pool type). ``build``:

1. refuses unsupported settings before anything is allocated (refusals.py);
2. runs SGLang's own DSA build (host pool group, ``HybridCacheController``) while SGLang's host
   allocation table is answered by :class:`host_views.ArenaViews`: the first host buffer starts
   the service, whose budget check and ledger reservation are the only ones (SGLang's own check
   would count the service's arenas a second time), and both buffers are views of its arenas;
3. agrees the host page count over the TP ranks first (all ranks must make the same decisions:
   they all-reduce their acks), and fails loudly if the ranks' SGLang pools differ;
4. gives the controller the service's transfer engine and layer counter, keeps the controller's
   host indices on the CPU and device indices where they are (the service reads GPU indices after
   the copy's producers, never blocking the scheduler thread), and refuses draft sidecars added
   later;
5. stops the service (drained, host pool and ledger reservation returned) when SGLang releases
   its host pools (``release_host_resources``), or at interpreter exit.

``SERVICE_OPTIONS``: extra keyword arguments for the ``OffloadService`` the next build starts
(``registry``, ``fault_hook``; a ``config`` dict of further ``ServiceConfig`` fields). For tests
and for operators who export the service's metrics; empty by default.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _DsaStrategy
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope, ranks_per_host

from ...errors import UnsupportedSettingError
from ...host_memory.ledger import read_process_start_ticks
from .engine import ServiceTransferEngine
from .host_views import INDEXER, KV, ArenaViews
from .layer_counter import ServiceLayerCounter
from .opt_in import opted_in
from .refusals import check_supported, storage_backend_problem
from .sizing import RankPeers

log = logging.getLogger(__name__)

SERVICE_OPTIONS: dict[str, Any] = {}
#: SGLang's own host budget check, inside the build, books against this: the service's check
#: (done before its arenas exist) is the one that counts.
_CHECKED_BY_THE_SERVICE = 1 << 62


class DsaAsyncStrategy(_DsaStrategy):
    """SGLang's DSA stack with the service as its host pool and transfer engine."""

    def __init__(self) -> None:
        self._declined: set[str] = set()

    def matches(self, kvcache: Any, components: Any) -> bool:
        if not opted_in():
            return False
        if super().matches(kvcache, components):
            return True
        kind = type(kvcache).__name__
        if kind not in self._declined:
            self._declined.add(kind)
            log.info("dsa_async: %s is not a DSA model's cache; SGLang builds its own", kind)
        return False

    def build(self, *, cache: Any, kvcache: Any, params: Any, server_args: Any,
              load_cache_event: Any, storage_backend: str | None = None, **kwargs: Any) -> Any:
        from sglang.srt.runtime_context import get_memory, get_parallel

        memory = get_memory()
        try:
            parallel = get_parallel()
        except (RuntimeError, ValueError):  # not published (a bare test build)
            parallel = None
        from sglang.srt.mem_cache.pool_host.common import get_allocator_type

        check_supported(kvcache=kvcache, params=params, memory=memory,
                        storage_backend=storage_backend, parallel=parallel,
                        host_allocator=get_allocator_type())
        views = ArenaViews(kvcache=kvcache, mem_layout=memory.hicache_mem_layout,
                           agree_pages=lambda pages: _agree_over_tp(pages, params),
                           rank_peers=lambda: _rank_peers(params),
                           all_started=lambda ok: _all_over_tp(ok, params),
                           service_options=dict(SERVICE_OPTIONS),
                           hicache_size_gb=getattr(memory, "hicache_size", 0))
        try:
            with views.installed(), host_memory_budget_scope(_CHECKED_BY_THE_SERVICE):
                result = super().build(cache=cache, kvcache=kvcache, params=params,
                                       server_args=server_args,
                                       load_cache_event=load_cache_event,
                                       storage_backend=storage_backend, **kwargs)
            if views.served != {KV, INDEXER}:
                raise UnsupportedSettingError(
                    f"dsa_async SGLang plug-in: SGLang allocated host buffers the service "
                    f"does not recognise (served {sorted(views.served)} of KV and indexer); "
                    f"this SGLang build lays out its DSA host pools differently than 0.5.23")
            self._wire(result, views, kvcache)
        except BaseException:
            views.stop()
            raise
        return result

    @staticmethod
    def _wire(result: Any, views: ArenaViews, kvcache: Any) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        group = result.host_pool_group
        kv_host, indexer_host = group.get_pool(PoolName.KV), group.get_pool(PoolName.INDEXER)
        for host_pool in (kv_host, indexer_host):
            # The service page-locked (and will unlock) these bytes, not SGLang: its teardown
            # must not unregister a view of them.
            host_pool.pin_memory = False
        service = views.owner.service
        cuda = kvcache.kv_buffer[0].is_cuda
        controller = result.cache_controller
        controller.l2_transfer_engine = ServiceTransferEngine(
            service, kv_host_pool=kv_host, indexer_host_pool=indexer_host, cuda=cuda)
        controller.layer_done_counter = ServiceLayerCounter(int(kvcache.layer_num), cuda)
        controller.move_indices = _indices_where_they_are

        def register_host_pool_entry(entry: Any) -> None:
            raise UnsupportedSettingError(
                f"dsa_async SGLang plug-in: a host pool added after the build "
                f"({getattr(entry, 'name', entry)!r}, e.g. an MTP draft sidecar) is not moved "
                f"by the service; run without speculative decoding or unset DSA_ASYNC_SGLANG")

        controller.register_host_pool_entry = register_host_pool_entry
        attach = controller.attach_storage_backend
        layout = views.mem_layout

        def attach_served(*args: Any, **kwargs: Any) -> Any:
            # SGLang's runtime attach (its admin endpoint) skips the build's refusals; it
            # reports what this raises as a failed attach, with nothing attached.
            backend = kwargs.get("storage_backend", args[0] if args else None)
            problem = storage_backend_problem(
                backend, layout, kwargs.get("storage_backend_extra_config"))
            if problem is not None:
                raise UnsupportedSettingError(
                    f"dsa_async SGLang plug-in: {problem}; attach another backend, or restart "
                    f"without DSA_ASYNC_SGLANG to let SGLang build its own cache")
            return attach(*args, **kwargs)

        controller.attach_storage_backend = attach_served
        destroy = group.destroy

        def destroy_then_stop() -> None:
            try:
                destroy()
            finally:
                views.stop()

        group.destroy = destroy_then_stop


def _indices_where_they_are(host_indices: torch.Tensor, device_indices: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The controller's index placement, for the service: host indices stay on the CPU (where
    the radix tree keeps them), device indices where the allocator put them (the CUDA engine
    reads GPU ones after the copy's producers)."""
    if host_indices.device.type != "cpu":
        host_indices = host_indices.cpu()
    return host_indices, device_indices


def _tp_group(params: Any) -> Any:
    """The TP group when there are several ranks; else ``None``."""
    group = getattr(params, "tp_cache_group", None)
    if group is None or not torch.distributed.is_available() or not (
            torch.distributed.is_initialized()):
        return None
    return group if torch.distributed.get_world_size(group=group) > 1 else None


def _agree_over_tp(pages: int, params: Any) -> int:
    """The host page count every TP rank uses: all must hold the same, or the ranks would
    accept different requests. Fails loudly (naming both counts) when they differ."""
    group = _tp_group(params)
    if group is None:
        return pages
    counts = torch.tensor([pages, -pages], dtype=torch.int64)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN, group=group)
    low, high = int(counts[0]), -int(counts[1])
    if low != high:
        raise UnsupportedSettingError(
            f"dsa_async SGLang plug-in: the TP ranks' host pools differ (SGLang sized their "
            f"KV host pools at {low - 1} to {high - 1} pages); give every rank the same "
            f"--hicache-size / --hicache-ratio and device pool")
    return low


def _rank_peers(params: Any) -> RankPeers:
    """The TP ranks' process ids (one all-reduce over the group; this rank's alone without
    one) and SGLang's ranks per host, for a budget refusal's advice."""
    me = (os.getpid(), read_process_start_ticks(os.getpid()) or 0)
    group = _tp_group(params)
    if group is None:
        return RankPeers(frozenset({me}))
    table = torch.zeros((torch.distributed.get_world_size(group=group), 2), dtype=torch.int64)
    table[torch.distributed.get_rank(group=group)] = torch.tensor(me)
    torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.SUM, group=group)
    try:
        per_host = int(ranks_per_host())  # SGLang's own split of a host's memory
    except (RuntimeError, ValueError):
        per_host = 1
    return RankPeers(frozenset((int(p), int(t)) for p, t in table.tolist()), max(1, per_host))


def _all_over_tp(ok: bool, params: Any) -> bool:
    """Whether every TP rank says ``ok`` (this one's answer when it is alone)."""
    group = _tp_group(params)
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())
