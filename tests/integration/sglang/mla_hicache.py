"""SGLang 0.5.23's hierarchical cache of an MLA-only model (DeepSeek-V3, no DSA indexer).

Modelled on ``dsa_hicache_harness.py`` and built the same way (plug-ins, ``ServerArgs`` +
``publish``, device pools, ``create_tree_cache`` -> ``init_hicache`` -> strategy selection), with
the two steps that differ for a model without the DSA indexer: the device pool the KV-cache
configurator builds for it (``kv_cache_configurator.py:2471`` ``_build_mla_kv_pool``: an
``MLATokenToKVPool``) and ``is_dsa=False`` in the tree-cache context. SGLang then selects its
``_PlainKvStrategy`` (``hybrid_pool_assembler.py:2296``: full attention, not a DSA/SWA/hybrid
pool), an MLA KV host pool and a ``HybridCacheController`` with its own transfer engine.

The harness cannot do this through ``model_config_overrides`` alone: it always builds a
``DSATokenToKVPool`` (which needs the indexer's geometry) and a DSA tree-cache context.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dsa_hicache_harness import DsaHiCache, DsaHiCacheSettings

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.runtime_context import get_model

#: ``config.json`` fields that turn the harness's DeepSeek-V3.2 into a DeepSeek-V3 with the same
#: MLA geometry and no indexer. SGLang tells a DSA model by its architecture *and* a set
#: ``index_topk`` (``configs/model_config.py:191-211`` ``is_deepseek_dsa``); the indexer's other
#: fields are cleared too, so nothing of the indexer is left to be read.
DEEPSEEK_V3_WITHOUT_INDEXER: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "index_topk": None,
    "index_head_dim": None,
    "index_n_heads": None,
}


class MlaHiCache(DsaHiCache):
    """SGLang's own hierarchical cache of an MLA-only model, on one CPU rank.

    The inherited driving helpers that touch the DSA indexer (``seed_device_bytes``,
    ``read_device_bytes``) do not apply; what SGLang built is read through ``tree_cache``,
    ``controller``, ``host_pool("kv")`` and ``selected_strategy``.
    """

    def _build_device_pools(self):
        """The pools ``KVCacheConfigurator`` builds for an MLA model (``_build_mla_kv_pool``)."""
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
        kv_pool = MLATokenToKVPool(
            s.device_pool_tokens,
            page_size=s.page_size_tokens,
            dtype=self.kv_cache_dtype,
            kv_lora_rank=mc.kv_lora_rank,
            qk_rope_head_dim=mc.qk_rope_head_dim,
            layer_num=mc.num_hidden_layers,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=mc.num_hidden_layers,
        )
        allocator = PagedTokenToKVPoolAllocator(
            s.device_pool_tokens,
            page_size=s.page_size_tokens,
            dtype=self.kv_cache_dtype,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
        )
        req_to_token_pool = ReqToTokenPool(
            size=s.max_running_requests,
            max_context_len=mc.context_len,
            device="cpu",
            enable_memory_saver=False,
        )
        return kv_pool, allocator, req_to_token_pool

    def _build_tree_cache(self):
        self.cache_init_params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.settings.page_size_tokens,
            tp_cache_group=self.group,
            attn_cp_cache_group=self.group,
            attn_tp_cache_group=self.group,
            pp_cache_group=self.group,
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
            tp_size=1,
            tp_rank=0,
            tp_group=self.group,
            is_dsa=False,
        )
        return create_tree_cache(context)


def build_mla_hicache(settings: DsaHiCacheSettings, workdir: Path) -> MlaHiCache:
    """Build an MLA-only model's hierarchical cache; ``settings.model_config_overrides`` are
    applied on top of ``DEEPSEEK_V3_WITHOUT_INDEXER``."""
    overrides = {**DEEPSEEK_V3_WITHOUT_INDEXER, **settings.model_config_overrides}
    return MlaHiCache(dataclasses.replace(settings, model_config_overrides=overrides), workdir)
