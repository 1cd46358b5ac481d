"""What the SGLang plug-in does not serve, refused when SGLang builds the cache, before anything
is allocated, each naming the SGLang flag (or model setting) to change.

The user asked for the plug-in (``DSA_ASYNC_SGLANG=1``), so an unsupported setting fails the
start loudly instead of silently falling back to SGLang's own cache. Pure checks; no SGLang
state is changed.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ...errors import UnsupportedSettingError

#: ``--hicache-mem-layout`` values whose host bytes are views of the service's arenas: MLA KV
#: and indexer both block-split per page and per layer (see strategy.py).
SUPPORTED_MEM_LAYOUTS = ("layer_first", "page_first_direct")
#: ``--hicache-storage-backend`` values whose host memory is allocated by the backend itself.
_OWN_ALLOCATOR_BACKENDS = ("mooncake", "mori", "shm", "tensorcast", "npu_memcache")
#: ``--hicache-storage-backend`` values that move pages through ``get_page_buffer_meta``
#: addresses (SGLang's zero-copy interface), which assume a contiguous layer_first KV buffer.
_RAW_POINTER_BACKENDS = ("nixl", "seaweedfs", "simm")
_UNSET_BY = "or unset DSA_ASYNC_SGLANG to let SGLang build its own cache"


def check_supported(*, kvcache: Any, params: Any, memory: Any, storage_backend: str | None,
                    parallel: Any = None, host_allocator: str | None = None) -> None:
    """Raise ``UnsupportedSettingError`` for the first setting the plug-in cannot serve.
    ``host_allocator``: SGLang's ``get_allocator_type()`` (a ``dynamic`` storage backend may
    ask for shared memory in its extra config)."""
    for problem in _problems(kvcache, params, memory, storage_backend, parallel,
                             host_allocator):
        raise UnsupportedSettingError(f"dsa_async SGLang plug-in: {problem}; {_UNSET_BY}")


def _problems(kvcache: Any, params: Any, memory: Any, storage_backend: str | None,
              parallel: Any, host_allocator: str | None):
    if getattr(torch.version, "hip", None):
        yield ("ROCm/HIP builds are not supported (SGLang's DSA pool there uses 1-token pages); "
               "run on CUDA")
    if getattr(params, "mtp_draft_device_pools", None):
        yield ("MTP draft KV pools (--speculative-algorithm with a DSA draft model) are not "
               "moved by the service; run without speculative decoding")
    if getattr(params, "sidecar_draft_device_pools", None):
        yield ("draft KV pools kept beside the target's (--speculative-algorithm with a "
               "separate draft model, e.g. STANDALONE or EAGLE3) are not moved by the "
               "service; run without speculative decoding")
    if any(getattr(kvcache, "skip_topk_layers", None) or ()):
        yield ("layers that reuse another layer's top-k (skip_topk_layers, from the model "
               "config's index_topk_freq, indexer_types, index_topk_pattern, "
               "index_skip_topk_offset or cli_factor) have no indexer rows; use a model config "
               "where every layer has its own indexer")
    if getattr(kvcache, "index_kpool", 1) != 1:
        yield (f"index_kpool={kvcache.index_kpool} (model config) packs several indexer pages "
               f"per KV page; only index_kpool=1 is supported")
    dcp_size = getattr(parallel, "attn_dcp_size", 1) if parallel is not None else 1
    if getattr(kvcache, "dcp_replicated", False) or (dcp_size or 1) > 1:
        yield "decode context parallelism (--dcp-size > 1) widens the indices; use --dcp-size 1"
    kinds = {cls.__name__ for cls in type(kvcache).__mro__}
    if "PageInterleaveKVPoolMixin" in kinds:
        yield ("page-interleaved KV sharding (--enable-kv-cache-sharding) is not supported; "
               "turn it off")
    if "HiSparseDSATokenToKVPool" in kinds:
        yield "HiSparse (--enable-hisparse) pools are not supported; turn it off"
    if "LayerSplitDSATokenToKVPool" in kinds or getattr(kvcache, "layer_shard_enabled", False):
        yield ("layer-split DSA caches (--enable-dsa-cache-layer-split) are not supported; "
               "turn it off")
    mode = getattr(memory, "hicache_host_memory_mode", None)
    if mode == "buffer_only":
        yield ("--hicache-host-memory-mode buffer_only keeps no host cache to serve; use the "
               "default mode")
    # Before the layout: these backends make SGLang rewrite the layout the user passed.
    backend = storage_backend or getattr(memory, "hicache_storage_backend", None)
    layout = getattr(memory, "hicache_mem_layout", None)
    problem = storage_backend_problem(
        backend, layout, _extra_config_of(memory) if backend == "dynamic" else {},
        host_allocator=host_allocator)
    if problem is not None:
        yield problem
    if layout not in SUPPORTED_MEM_LAYOUTS:
        yield (f"--hicache-mem-layout {layout} is not supported: the service's host pages are "
               f"block-split per layer, which SGLang's {' and '.join(SUPPORTED_MEM_LAYOUTS)} "
               f"layouts match; pass --hicache-mem-layout layer_first (or page_first_direct)")
    io_backend = getattr(memory, "hicache_io_backend", None)
    if io_backend not in ("kernel", "direct"):
        yield (f"--hicache-io-backend {io_backend} is not supported; use kernel or direct (the "
               f"service does the copies either way)")
    if getattr(memory, "enable_unified_memory", False):
        yield "--enable-unified-memory is not supported; turn it off"
    if getattr(params, "pp_size", 1) > 1:
        yield "pipeline parallelism (--pp-size > 1) is not supported; use --pp-size 1"
    if getattr(params, "attn_cp_size", 1) > 1:
        yield "attention context parallelism (--attn-cp-size > 1) is not supported"


def storage_backend_problem(backend: str | None, layout: str | None, extra_config: Any, *,
                            host_allocator: str | None = None) -> str | None:
    """Why the plug-in cannot serve storage backend ``backend`` with host layout ``layout``
    (``None``: it can), checked when SGLang builds the cache and when a backend is attached at
    runtime. ``extra_config``: the backend's extra config, parsed (a dict); ``host_allocator``:
    SGLang's ``get_allocator_type()`` where known, else read from ``extra_config``."""
    if not isinstance(extra_config, dict):
        extra_config = {}
    if host_allocator is None and backend == "dynamic" and extra_config.get("allocator") == "shm":
        host_allocator = "shm"
    if backend in _OWN_ALLOCATOR_BACKENDS or host_allocator in _OWN_ALLOCATOR_BACKENDS:
        how = backend if backend in _OWN_ALLOCATOR_BACKENDS else (
            f"{backend} (with a {host_allocator} allocator in its extra config)")
        return (f"--hicache-storage-backend {how} allocates the host memory itself (and "
                f"forces its own layout); use file, hf3fs, nixl (with --hicache-mem-layout "
                f"page_first_direct) or no storage backend")
    if layout == "layer_first" and (backend in _RAW_POINTER_BACKENDS or (
            backend == "dynamic" and bool(extra_config.get("interface_v1", 0)))):
        which = backend if backend != "dynamic" else "dynamic with interface_v1"
        return (f"--hicache-storage-backend {which} reads and writes host pages through raw "
                f"addresses that SGLang computes for a layer_first KV buffer of exactly the KV "
                f"pool's pages, and the service's KV view there spans the indexer's page count "
                f"per layer (one page more), so every layer after the first would be read from "
                f"and written to the wrong pages; use --hicache-mem-layout page_first_direct "
                f"with this backend")
    return None


def _extra_config_of(memory: Any) -> dict:
    """The storage backend's extra config as SGLang reads it (``{}`` when absent or when
    SGLang could not read it either: SGLang refuses such a config itself)."""
    text = getattr(memory, "hicache_storage_backend_extra_config", None)
    if not text:
        return {}
    try:
        config = _extra_config(text)
    except Exception:  # noqa: BLE001 - SGLang refuses a config it cannot read itself
        return {}
    return config if isinstance(config, dict) else {}


def _extra_config(text: str) -> object:
    """``--hicache-storage-backend-extra-config``: inline JSON, or ``@path`` to a JSON, TOML or
    YAML file, parsed by SGLang's own reader (inline JSON only where SGLang is absent)."""
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
    except ImportError:
        return json.loads(text)
    return HybridCacheController.parse_storage_backend_extra_config(text)[0]
