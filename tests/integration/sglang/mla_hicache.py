"""SGLang 0.5.23's hierarchical cache of an MLA-only model (DeepSeek-V3, no DSA indexer).

Built by ``dsa_hicache_harness.py`` (plug-ins, ``ServerArgs`` + ``publish``, device pools,
``create_tree_cache`` -> ``init_hicache`` -> strategy selection), with the two steps that differ
for a model without the DSA indexer: the device pool the KV-cache configurator builds for it
(``kv_cache_configurator.py:2471`` ``_build_mla_kv_pool``: an ``MLATokenToKVPool``) and
``is_dsa=False`` in the tree-cache context. SGLang then selects its
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

from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

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

    IS_DSA = False

    def _build_kv_pool(self):
        """The device pool for an MLA model (``kv_cache_configurator`` ``_build_mla_kv_pool``)."""
        s = self.settings
        mc = self.model_config
        return MLATokenToKVPool(
            s.device_pool_tokens,
            page_size=s.page_size_tokens,
            dtype=self.kv_cache_dtype,
            kv_lora_rank=mc.kv_lora_rank,
            qk_rope_head_dim=mc.qk_rope_head_dim,
            layer_num=mc.num_hidden_layers,
            device=s.device,
            enable_memory_saver=False,
            start_layer=0,
            end_layer=mc.num_hidden_layers,
        )


def build_mla_hicache(settings: DsaHiCacheSettings, workdir: Path) -> MlaHiCache:
    """Build an MLA-only model's hierarchical cache; ``settings.model_config_overrides`` are
    applied on top of ``DEEPSEEK_V3_WITHOUT_INDEXER``."""
    overrides = {**DEEPSEEK_V3_WITHOUT_INDEXER, **settings.model_config_overrides}
    return MlaHiCache(dataclasses.replace(settings, model_config_overrides=overrides), workdir)
