"""Build SGLang 0.5.23's DSA hierarchical cache through SGLang's own code, and drive it.

``build_dsa_hicache(settings, workdir)`` goes the way an SGLang scheduler process does
(``managers/scheduler.py:6323`` ``run_scheduler_process`` -> ``mem_cache/kv_cache_builder.py``
``build_kv_cache``):

1. ``load_plugins()`` -- entry points of the ``sglang.srt.plugins`` group run here, so a plug-in
   installed in the venv registers its strategy before anything is built;
2. ``ServerArgs`` for a small DeepSeek-V3.2 model (a local ``config.json``), published with
   ``publish(role="scheduler")``;
3. the device pools the KV-cache configurator would build for it
   (``kv_cache_configurator.py:2320`` ``_build_dsa_kv_pool``): SGLang's ``DSATokenToKVPool``
   (MLA KV + DSA indexer), ``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``;
4. ``CacheInitParams`` + ``TreeCacheBuildContext`` -> ``registry.create_tree_cache`` ->
   ``UnifiedRadixCache.init_hicache`` -> ``hybrid_pool_assembler``'s strategy selection
   (``_select_strategy``: registered strategies first, then ``_DsaStrategy``) -> host pools +
   ``HybridCacheController``; ``_apply_stack_result`` and ``registry.py:197`` register the
   controller's layer counter on the device pool and on the worker. The process groups are a
   one-rank gloo group, or, for one rank of several processes, that rank's real groups
   (``CacheGroups``, ``build_dsa_hicache(..., groups=)``);
5. the controller's fences set to the forward stream as ``managers/scheduler.py:616-623`` does.

The driving helpers (``DsaHiCache.insert``, ``pump``, ``evict_device``, ``load_back``,
``read_device_bytes`` ...) only call the radix tree's and the worker's scheduler-facing methods
and read the controller's attributes when they are needed, never a cached engine or counter: a
plug-in that replaces ``cache_controller.l2_transfer_engine`` and ``layer_done_counter`` is
driven by them unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist

from cpu_shims import (
    gpu_capability_for_arg_resolution,
    host_pools_without_page_locking,
    install_torchvision_stub,
)

install_torchvision_stub()

# SGLang imports come after the torchvision stub (see cpu_shims).
from sglang.srt.configs.model_config import (
    ModelConfig,
    dsa_layer_skips_topk,
    get_dsa_index_head_dim,
    get_dsa_index_kpool,
    get_dsa_index_kpool_compress,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.kv_cache_configurator import (
    _should_elide_dsa_index_k,
    calculate_mla_kv_cache_dim,
)
from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import SpawnRanks, get_model, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import get_device_module

#: DSA requires 64-token physical indexer pages (``memory_pool.py`` ``DSATokenToKVPool``).
DSA_PAGE_SIZE_TOKENS = 64


def deepseek_v32_config(num_layers: int, **overrides: Any) -> dict[str, Any]:
    """A DeepSeek-V3.2 ``config.json`` with V3.2's attention geometry and tiny everything else.

    The cache only reads the attention geometry: ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64
    (576 elements of MLA KV per token per layer) and ``index_head_dim`` 128 (128 B of fp8 keys +
    4 B of scale per token per layer in the indexer). ``overrides`` reach every field, e.g.
    ``index_kpool=2`` or ``indexer_types=["full", "shared"]`` for configurations a plug-in must
    refuse.
    """
    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 128,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 2048,
        "max_position_embeddings": 4096,
        "vocab_size": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


@dataclasses.dataclass(frozen=True)
class DsaHiCacheSettings:
    """What a test may ask of the cache; every field maps to a server flag or pool parameter."""

    num_layers: int = 2
    page_size_tokens: int = DSA_PAGE_SIZE_TOKENS
    #: device pool capacity (``DSATokenToKVPool(size=...)``), in pages
    device_pool_pages: int = 16
    #: ``--hicache-ratio``: host pool tokens = device tokens x ratio (+1 padding page)
    hicache_ratio: float = 2.0
    #: ``--hicache-size`` in GB; overrides the ratio when > 0
    hicache_size_gb: int = 0
    #: ``--hicache-write-policy``: write_through, write_through_selective or write_back
    write_policy: str = "write_through"
    #: ``--hicache-mem-layout`` (SGLang's default is page_first)
    mem_layout: str = "page_first"
    #: ``--hicache-io-backend`` (SGLang's default is kernel)
    io_backend: str = "kernel"
    #: ``--hicache-storage-backend``: None, or "file" (kept under the build's workdir)
    storage_backend: Optional[str] = None
    #: ``--kv-cache-dtype``; "auto" resolves from ``gpu_capability`` as SGLang does
    kv_cache_dtype: str = "auto"
    #: the GPU that SGLang's DSA argument resolution is told about (see cpu_shims)
    gpu_capability: tuple[int, int] = (9, 0)
    max_running_requests: int = 8
    #: where SGLang's device pools live: "cpu" here; "cuda" on a machine with a GPU (then the
    #: CPU-only stand-ins for host allocation and the GPU capability are not used)
    device: str = "cpu"
    #: environment variables set for the build and the cache's lifetime (e.g. DSA_ASYNC_SGLANG)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: further ``config.json`` fields (see ``deepseek_v32_config``)
    model_config_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: further ``ServerArgs`` fields, e.g. {"hicache_host_memory_mode": "buffer_only"}
    extra_server_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device_pool_tokens(self) -> int:
        return self.device_pool_pages * self.page_size_tokens


class SchedulerWorkerStandIn:
    """The two tp-worker methods the cache path calls, run as SGLang's own code.

    ``registry.py:197`` hands the controller's layer counter to
    ``tp_worker.register_hicache_layer_transfer_counter``; each forward batch calls
    ``tp_worker.set_hicache_consumer(batch.hicache_consumer_index)`` (``managers/tp_worker.py:637``)
    before the model's layers read the pools. Both bodies are ``TpModelWorker``'s own
    (``tp_worker.py:540-545``), bound to this object; the model runner is reduced to the
    forward stream that the scheduler uses as the controller's fence.
    """

    def __init__(self, forward_stream: Any) -> None:
        self.hicache_layer_transfer_counter = None
        self.model_runner = SimpleNamespace(forward_stream=forward_stream)

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        TpModelWorker.register_hicache_layer_transfer_counter(self, counter)

    def set_hicache_consumer(self, consumer_index: int) -> None:
        TpModelWorker.set_hicache_consumer(self, consumer_index)


_SINGLE_RANK_GROUP: Any = None


def single_rank_gloo_group() -> Any:
    """A one-rank gloo process group for the cache's TP/PP/CP groups (in-process store, no port)."""
    global _SINGLE_RANK_GROUP
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if _SINGLE_RANK_GROUP is None:
        _SINGLE_RANK_GROUP = dist.new_group(ranks=[0], backend="gloo")
    return _SINGLE_RANK_GROUP


@dataclasses.dataclass(frozen=True)
class CacheGroups:
    """The process groups one rank hands SGLang's cache, as the scheduler does.

    ``kv_cache_builder.py:402-405`` fills ``CacheInitParams`` with the CPU (gloo) groups
    ``tp_cache_group`` (the DP-TP group), ``attn_tp_cache_group``, ``attn_cp_cache_group`` and
    ``pp_cache_group``; the tree-cache context gets the TP size, rank and group. A build without
    ``CacheGroups`` uses one one-rank group for all four (``single_rank_gloo_group``); a build on
    one rank of several passes the real groups of that rank (e.g. tp and attn_tp over all ranks,
    attn_cp and pp one-rank groups of its own for plain tensor parallelism).
    """

    tp: Any
    attn_tp: Any
    attn_cp: Any
    pp: Any

    @classmethod
    def single_rank(cls) -> CacheGroups:
        group = single_rank_gloo_group()
        return cls(tp=group, attn_tp=group, attn_cp=group, pp=group)

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(group=self.tp)

    @property
    def tp_size(self) -> int:
        return dist.get_world_size(group=self.tp)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class LoadBack:
    """A request whose host hit SGLang is loading back (``init_load_back`` + ``ready_to_load``)."""

    req: Any
    loaded_tokens: int
    consumer_index: int
    device_indices: torch.Tensor


@dataclasses.dataclass
class DeviceBytes:
    """Bytes of some tokens as SGLang's device-pool getters return them, per layer.

    ``kv[layer]`` is ``[tokens, kv_row_bytes]`` uint8 (MLA KV rows); ``indexer[layer]`` is
    ``[pages, index_page_bytes]`` uint8 (whole indexer pages: 64 x 128 B keys, then 64 x 4 B
    scales).
    """

    kv: list[torch.Tensor]
    indexer: list[torch.Tensor]

    def equal(self, other: DeviceBytes) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.kv, other.kv, strict=True)) and all(
            torch.equal(a, b) for a, b in zip(self.indexer, other.indexer, strict=True)
        )


class DsaHiCache:
    """SGLang's DSA hierarchical cache on one CPU rank, with scheduler-like driving helpers."""

    def __init__(self, settings: DsaHiCacheSettings, workdir: Path,
                 groups: Optional[CacheGroups] = None) -> None:
        """``groups``: the process groups of this rank when it is one of several TP ranks
        (each rank a process that builds its own cache); ``None``: one CPU rank."""
        self.settings = settings
        self.workdir = Path(workdir)
        self._groups = groups
        self._exit = contextlib.ExitStack()
        self._next_rid = 0
        try:
            self._build()
        except BaseException:
            self._exit.close()
            raise

    # ---- construction (the scheduler's path) ----

    def _build(self) -> None:
        s = self.settings
        env = dict(s.env)
        if s.storage_backend == "file":
            # HiCacheFile's directory (hicache_storage.py:733), as SGLang's own test kit sets it.
            env.setdefault(
                "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(self.workdir / "hicache-file")
            )
        self._exit.enter_context(_environment(env))

        load_plugins()  # what run_scheduler_process does first (scheduler.py:6323)

        model_dir = self.workdir / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(
            json.dumps(deepseek_v32_config(s.num_layers, **s.model_config_overrides), indent=1)
        )
        server_args_fields = dict(
            model_path=str(model_dir),
            device=s.device,
            page_size=s.page_size_tokens,
            kv_cache_dtype=s.kv_cache_dtype,
            max_running_requests=s.max_running_requests,
            skip_tokenizer_init=True,
            enable_hierarchical_cache=True,
            hicache_ratio=s.hicache_ratio,
            hicache_size=s.hicache_size_gb,
            hicache_write_policy=s.write_policy,
            hicache_mem_layout=s.mem_layout,
            hicache_io_backend=s.io_backend,
            hicache_storage_backend=s.storage_backend,
        )
        server_args_fields.update(s.extra_server_args)
        on_cpu = s.device == "cpu"
        with (gpu_capability_for_arg_resolution(s.gpu_capability) if on_cpu
              else contextlib.nullcontext()):
            self.server_args = ServerArgs(**server_args_fields)
            # The launcher's placement: the rank in the default group of a multi-rank build.
            world_rank = dist.get_rank() if self._groups is not None else 0
            publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))
        self.model_config = ModelConfig.from_server_args(self.server_args)

        self.groups = self._groups if self._groups is not None else CacheGroups.single_rank()
        self.group = self.groups.tp
        self.kv_pool, self.allocator, self.req_to_token_pool = self._build_device_pools()

        self.forward_stream = get_device_module().Stream()
        self.worker = SchedulerWorkerStandIn(self.forward_stream)
        with host_pools_without_page_locking() if on_cpu else contextlib.nullcontext():
            self.tree_cache = self._build_tree_cache()
        self._exit.callback(self._release)

        # managers/scheduler.py:616-623: copies wait for the forward stream in both directions.
        controller = self.tree_cache.cache_controller
        controller.load_fence_stream = self.forward_stream
        controller.write_fence_stream = self.forward_stream

    #: whether the model is a DSA one (the tree-cache context's ``is_dsa``)
    IS_DSA = True

    def _build_device_pools(self):
        """The KV pool (:meth:`_build_kv_pool`), the paged allocator and the request-to-token
        pool, as ``KVCacheConfigurator`` builds them."""
        s = self.settings
        mc = self.model_config
        _, self.kv_cache_dtype = configure_kv_cache_dtype(
            server_args_kv_cache_dtype=get_model().kv_cache_dtype,
            model=None,
            model_dtype=mc.dtype,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend=None,
        )
        kv_pool = self._build_kv_pool()
        allocator = PagedTokenToKVPoolAllocator(
            s.device_pool_tokens,
            page_size=s.page_size_tokens,
            dtype=self.kv_cache_dtype,
            device=s.device,
            kvcache=kv_pool,
            need_sort=False,
        )
        req_to_token_pool = ReqToTokenPool(
            size=s.max_running_requests,
            max_context_len=mc.context_len,
            device=s.device,
            enable_memory_saver=False,
        )
        return kv_pool, allocator, req_to_token_pool

    def _build_kv_pool(self):
        """The device pool for a DSA model (``kv_cache_configurator`` ``_build_dsa_kv_pool``)."""
        s = self.settings
        mc = self.model_config
        hf_config = mc.hf_config
        layers = range(0, mc.num_hidden_layers)
        pool_kwargs = {}
        if _should_elide_dsa_index_k(is_draft_worker=False):
            pool_kwargs["skip_topk_layers"] = [dsa_layer_skips_topk(hf_config, i) for i in layers]
        kv_pool = DSATokenToKVPool(
            s.device_pool_tokens,
            page_size=s.page_size_tokens,
            dtype=self.kv_cache_dtype,
            kv_lora_rank=mc.kv_lora_rank,
            qk_rope_head_dim=mc.qk_rope_head_dim,
            layer_num=mc.num_hidden_layers,
            device=s.device,
            kv_cache_dim=calculate_mla_kv_cache_dim(
                model_config=mc, kv_cache_dtype=self.kv_cache_dtype
            ),
            enable_memory_saver=False,
            start_layer=0,
            end_layer=mc.num_hidden_layers,
            index_head_dim=get_dsa_index_head_dim(hf_config),
            index_kpool=get_dsa_index_kpool(hf_config),
            index_kpool_compress=get_dsa_index_kpool_compress(hf_config),
            tail_extra_slots=0,
            max_running_requests=s.max_running_requests,
            **pool_kwargs,
        )
        return kv_pool

    def _build_tree_cache(self):
        self.cache_init_params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.settings.page_size_tokens,
            tp_cache_group=self.groups.tp,
            attn_cp_cache_group=self.groups.attn_cp,
            attn_tp_cache_group=self.groups.attn_tp,
            pp_cache_group=self.groups.pp,
        )
        context = TreeCacheBuildContext(
            server_args=self.server_args,
            params=self.cache_init_params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=True,
            disable_radix_cache=False,
            tp_worker=self.worker,
            model_config=self.model_config,
            tp_size=self.groups.tp_size,
            tp_rank=self.groups.tp_rank,
            tp_group=self.groups.tp,
            is_dsa=self.IS_DSA,
        )
        return create_tree_cache(context)

    def _release(self) -> None:
        cache = self.tree_cache
        atexit.unregister(cache.shutdown)  # init_hicache registers it (unified_radix_cache.py)
        cache.shutdown()  # detaches an L3 backend: stops its threads
        cache.release_host_resources()

    def close(self) -> None:
        self._exit.close()

    # ---- what SGLang built ----

    @property
    def controller(self):
        return self.tree_cache.cache_controller

    @property
    def host_pool_group(self):
        return self.tree_cache.host_pool_group

    def host_pool(self, name: str):
        """``"kv"`` (``MLATokenToKVPoolHost``) or ``"indexer"`` (``DSAIndexerPoolHost``)."""

        return self.host_pool_group.get_pool(PoolName(name))

    @property
    def selected_strategy(self):
        """The strategy ``hybrid_pool_assembler._select_strategy`` picks for this cache now."""

        return hybrid_pool_assembler._select_strategy(
            self.kv_pool, set(self.tree_cache.components)
        )

    # ---- device bytes ----

    def kv_row_bytes(self) -> int:
        return self.kv_pool.kv_buffer[0][0].numel() * self.kv_pool.kv_buffer[0].element_size()

    def _kv_rows(self, layer: int) -> torch.Tensor:
        buffer = self.kv_pool.kv_buffer[layer]
        return buffer.view(torch.uint8).view(buffer.shape[0], -1)

    def seed_device_bytes(self, device_indices: torch.Tensor, seed: int) -> DeviceBytes:
        """Write seeded random bytes into the MLA KV rows and the indexer pages of these tokens.

        This is what the forward pass would have written; it writes the raw device buffers
        (``kv_buffer``, ``index_k_with_scale_buffer``), as the model's kernels do.
        """
        generator = torch.Generator().manual_seed(seed)
        pages = self._pages_of(device_indices)
        for layer in range(self.kv_pool.layer_num):
            rows = self._kv_rows(layer)
            rows[device_indices] = torch.randint(
                0, 256, (len(device_indices), rows.shape[1]), dtype=torch.uint8,
                generator=generator,
            )
            index_pages = self.kv_pool.index_k_with_scale_buffer[layer]
            if index_pages.shape[0] == 0:  # a shared-top-k layer holds no index keys
                continue
            index_pages[pages] = torch.randint(
                0, 256, (len(pages), index_pages.shape[1]), dtype=torch.uint8,
                generator=generator,
            )
        return self.read_device_bytes(device_indices)

    def scrub_device(self, value: int = 0) -> None:
        """Overwrite every device KV row and indexer page (so a load must bring the bytes back)."""
        for layer in range(self.kv_pool.layer_num):
            self._kv_rows(layer).fill_(value)
            self.kv_pool.index_k_with_scale_buffer[layer].fill_(value)

    def read_device_bytes(self, device_indices: torch.Tensor) -> DeviceBytes:
        """Read these tokens through SGLang's device-pool getters, layer by layer.

        ``get_key_buffer`` (``memory_pool.py``) and ``get_index_k_with_scale_buffer``
        (``index_key_cache.py:97``) call ``layer_transfer_counter.wait_until(layer)`` first, as
        the model's attention does: a read after ``load_back`` waits for that layer's load.
        """
        pages = self._pages_of(device_indices)
        kv, indexer = [], []
        for layer in range(self.kv_pool.layer_num):
            keys = self.kv_pool.get_key_buffer(layer)
            rows = keys.view(torch.uint8).view(keys.shape[0], -1)
            kv.append(rows[device_indices].clone())
            index_pages = self.kv_pool.get_index_k_with_scale_buffer(layer)
            indexer.append(index_pages[pages].clone() if index_pages.shape[0] else index_pages)
        return DeviceBytes(kv=kv, indexer=indexer)

    def _pages_of(self, device_indices: torch.Tensor) -> torch.Tensor:
        return torch.unique(device_indices // self.settings.page_size_tokens)

    # ---- the scheduler's flow ----

    def tokens(self, start: int, num_pages: int) -> list[int]:
        """A token sequence of whole pages (the tree keys on page-aligned prefixes)."""
        return list(range(start, start + num_pages * self.settings.page_size_tokens))

    def insert(self, tokens: Sequence[int], seed: int) -> tuple[torch.Tensor, DeviceBytes]:
        """Insert a finished request's tokens with seeded device bytes, as cache_finished_req does.

        Device slots come from SGLang's paged allocator; the insert goes through
        ``UnifiedRadixCache.insert``. Under write_through the insert queues the node's backup
        (``controller.write(..., flush=False)``); ``pump()`` submits it, as the scheduler's
        ``check_hicache_events`` does each step.
        """

        device_indices = self.allocator.alloc(len(tokens))
        if device_indices is None:
            raise RuntimeError(f"device pool has no room for {len(tokens)} tokens")
        seeded = self.seed_device_bytes(device_indices, seed)
        result = self.tree_cache.insert(
            InsertParams(key=RadixKey(array("q", tokens)), value=device_indices)
        )
        if result.prefix_len:
            # Tokens already in the tree keep their old slots; SGLang frees the duplicates.
            self.allocator.free(device_indices[: result.prefix_len])
        return device_indices, seeded

    def step(self) -> None:
        """One scheduler step's cache work: ``check_hicache_events`` (scheduler.py:3889).

        It flushes queued backups (``start_writing`` -> ``l2_transfer_engine.submit_device_to_host``),
        all-reduces the number of finished write/load acks over the TP group, and runs
        ``writing_check`` / ``loading_check`` for them.
        """
        self.tree_cache.check_hicache_events()

    def in_flight(self) -> bool:
        cache, controller = self.tree_cache, self.controller
        return bool(
            controller.write_queue
            or controller.load_queue
            or controller.ack_write_queue
            or controller.ack_load_queue
            or cache.ongoing_write_through
            or cache.ongoing_load_back
        )

    def pump(self, timeout_s: float = 30.0) -> int:
        """Run scheduler steps until every write and load is acknowledged; return the steps run.

        Polls like the scheduler loop does (the acks complete on their own streams or threads);
        raises ``TimeoutError`` if they do not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        steps = 0
        while True:
            self.step()
            steps += 1
            if not self.in_flight():
                return steps
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"HiCache transfers still in flight after {timeout_s} s and {steps} steps: "
                    f"{len(self.controller.ack_write_queue)} write acks, "
                    f"{len(self.controller.ack_load_queue)} load acks, "
                    f"{len(self.tree_cache.ongoing_write_through)} write-throughs, "
                    f"{len(self.tree_cache.ongoing_load_back)} load-backs pending"
                )
            time.sleep(0.0005)

    def evict_device(self, num_tokens: int) -> int:
        """Evict device memory through ``UnifiedRadixCache.evict`` (write_back backs up first)."""

        return self.tree_cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def match(self, tokens: Sequence[int], req: Any = None):
        return self.tree_cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req)
        )

    def new_req(self, tokens: Sequence[int]):
        """A waiting request for ``tokens`` with a request slot, as the scheduler makes one."""

        req = Req(
            rid=f"harness-{self._next_rid}",
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        self._next_rid += 1
        self.req_to_token_pool.alloc([req])
        return req

    def load_back(self, tokens: Sequence[int]) -> LoadBack:
        """Admit a request whose prefix is on host: match, ``init_load_back``, start loading.

        As ``schedule_policy.py:1517`` + ``scheduler.py:4353`` + ``tp_worker.py:637`` do:
        ``match_prefix`` finds the host hit, ``init_load_back`` allocates device slots and
        queues the load (``controller.load``), ``ready_to_load_host_cache`` starts it
        (``start_loading`` -> ``layer_done_counter.update_producer`` ->
        ``l2_transfer_engine.submit_host_to_device``) and returns the producer index that the
        forward batch then consumes (``set_hicache_consumer``). Reads through
        ``read_device_bytes`` afterwards wait per layer on that producer's events.
        """

        req = self.new_req(tokens)
        match = self.match(tokens, req=req)
        req.prefix_len = match.device_prefix_len
        req.last_node = match.last_device_node
        req.last_host_node = match.last_host_node
        req.best_match_node = match.best_match_node
        req.host_hit_length = match.host_hit_length
        req.swa_host_hit_length = match.swa_host_hit_length
        req.mamba_host_hit_length = match.mamba_host_hit_length
        loaded = self.tree_cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node,
                host_hit_length=req.host_hit_length,
                req=req,
            )
        )
        if loaded is None:
            raise RuntimeError("init_load_back declined (buffer mode admission retry)")
        req.host_loaded_length, req.last_node = loaded
        consumer_index = self.tree_cache.ready_to_load_host_cache()
        self.worker.set_hicache_consumer(consumer_index)
        return LoadBack(
            req=req,
            loaded_tokens=req.host_loaded_length,
            consumer_index=consumer_index,
            device_indices=self.tree_cache.path_device_indices(req.last_node),
        )

    def finish(self, load: LoadBack) -> None:
        """The batch is done: consumers stop waiting and the request slot is returned."""
        self.worker.set_hicache_consumer(-1)
        self.req_to_token_pool.free(load.req)


def load_plugins_opted_in() -> None:
    """Load SGLang's plug-ins once for this process as an operator who wants this one launches
    (``DSA_ASYNC_SGLANG=1``), then restore the variable: each build opts in or not through its
    own ``env``, which the strategy reads when SGLang builds the cache."""
    had = os.environ.get("DSA_ASYNC_SGLANG")
    os.environ["DSA_ASYNC_SGLANG"] = "1"
    try:
        load_plugins()
    finally:
        if had is None:
            del os.environ["DSA_ASYNC_SGLANG"]
        else:
            os.environ["DSA_ASYNC_SGLANG"] = had


def build_dsa_hicache(settings: DsaHiCacheSettings, workdir: Path,
                      groups: Optional[CacheGroups] = None) -> DsaHiCache:
    return DsaHiCache(settings, workdir, groups)
