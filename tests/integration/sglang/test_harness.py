"""The harness builds SGLang 0.5.23's own DSA hierarchical cache, and shows what runs on a CPU.

No plug-in is installed yet: these tests pin down the stack a plug-in will be dropped into
(strategy selection, controller, host pools, transfer seam) and what SGLang's own transfer
engine does here. SGLang's copy ops come from ``sgl_kernel`` and are bound only on CUDA, HIP and
XPU, so on this machine SGLang's own engine cannot move a byte: the round-trip test therefore
checks what really happens (the backups SGLang hands its engine, and that engine's failure),
and no test writes host bytes itself.
"""

from __future__ import annotations

import os

import pytest
import torch

from sglang.srt.managers.cache_controller import LayerDoneCounter
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.l2_transfer import L2TransferEngine
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

#: DeepSeek-V3.2 indexer page, one layer: 64 tokens x (128 B fp8 keys + 4 B fp32 scale)
INDEX_PAGE_BYTES = 64 * 132
#: MLA KV row in bf16: (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B
KV_ROW_BYTES_BF16 = 576 * 2

LAYOUTS = [
    pytest.param("page_first", "kernel", id="page_first-kernel"),
    pytest.param("layer_first", "kernel", id="layer_first-kernel"),
    pytest.param("layer_first", "direct", id="layer_first-direct"),
    pytest.param("page_first_direct", "direct", id="page_first_direct-direct"),
]


@pytest.mark.parametrize("num_layers", [2, 4])
@pytest.mark.parametrize(("mem_layout", "io_backend"), LAYOUTS)
def test_cache_is_built_by_sglang_with_its_own_transfer_engine_when_not_opted_in(
    dsa_hicache, monkeypatch, num_layers, mem_layout, io_backend
):
    monkeypatch.delenv("DSA_ASYNC_SGLANG", raising=False)
    cache = dsa_hicache(num_layers=num_layers, mem_layout=mem_layout, io_backend=io_backend)

    assert type(cache.tree_cache) is UnifiedRadixCache
    assert type(cache.kv_pool) is DSATokenToKVPool
    assert type(cache.selected_strategy) is hybrid_pool_assembler._DsaStrategy
    controller = cache.controller
    assert type(controller) is HybridCacheController
    assert type(controller.l2_transfer_engine) is L2TransferEngine
    assert type(controller.layer_done_counter) is LayerDoneCounter
    assert controller.transfer_layer_id_max == num_layers
    assert controller.io_backend == io_backend

    # The counter every reader waits on is the controller's (_apply_stack_result, registry.py).
    assert cache.kv_pool.layer_transfer_counter is controller.layer_done_counter
    assert cache.worker.hicache_layer_transfer_counter is controller.layer_done_counter
    assert controller.load_fence_stream is cache.forward_stream
    assert controller.write_fence_stream is cache.forward_stream

    kv_host, indexer_host = cache.host_pool("kv"), cache.host_pool("indexer")
    assert type(kv_host) is MLATokenToKVPoolHost
    assert type(indexer_host) is DSAIndexerPoolHost
    assert cache.host_pool_group.anchor_entry.name is PoolName.KV
    assert indexer_host.decl.indices_from_pool is PoolName.KV
    assert kv_host.layout == indexer_host.layout == mem_layout
    assert kv_host.layer_num == indexer_host.layer_num == num_layers
    assert kv_host.size == indexer_host.size
    assert kv_host.size_per_token == KV_ROW_BYTES_BF16 * num_layers
    assert indexer_host.indexer_page_stride_size == INDEX_PAGE_BYTES
    # --hicache-ratio 2: twice the device tokens, plus SGLang's padding page
    assert kv_host.size == 2 * cache.settings.device_pool_tokens + 64


def test_settings_reach_sglang_as_its_own_flags(dsa_hicache, monkeypatch):
    monkeypatch.delenv("DSA_HARNESS_PROBE", raising=False)
    cache = dsa_hicache(
        num_layers=3,
        write_policy="write_back",
        hicache_ratio=3.0,
        storage_backend="file",
        env={"DSA_HARNESS_PROBE": "1"},
    )

    assert cache.tree_cache.is_write_back
    assert cache.controller.write_policy == "write_back"
    assert cache.controller.enable_storage
    assert type(cache.controller.storage_backend).__name__ == "HiCacheFile"
    assert cache.host_pool("kv").size == 3 * cache.settings.device_pool_tokens + 64
    assert cache.kv_pool.layer_num == 3
    assert os.environ["DSA_HARNESS_PROBE"] == "1"
    cache.close()
    assert "DSA_HARNESS_PROBE" not in os.environ


def test_a_registered_stack_strategy_is_selected_before_sglangs_dsa_strategy(
    dsa_hicache, monkeypatch
):
    """The path a plug-in takes: ``register_stack_strategy`` from its ``register()``."""
    monkeypatch.setattr(
        hybrid_pool_assembler, "_STRATEGIES", list(hybrid_pool_assembler._STRATEGIES)
    )
    builds = []

    class RecordingDsaStrategy(hybrid_pool_assembler._DsaStrategy):
        def build(self, *, cache, kvcache, **kwargs):
            builds.append(kvcache)
            return super().build(cache=cache, kvcache=kvcache, **kwargs)

    strategy = RecordingDsaStrategy()
    hybrid_pool_assembler.register_stack_strategy(strategy)
    cache = dsa_hicache()

    assert cache.selected_strategy is strategy
    assert builds == [cache.kv_pool]
    assert type(cache.controller) is HybridCacheController


@pytest.mark.parametrize(("mem_layout", "io_backend"), LAYOUTS)
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_sglang_engine_is_handed_kv_and_indexer_backups_but_cannot_copy_on_cpu(
    dsa_hicache, write_policy, mem_layout, io_backend
):
    """The backup reaches SGLang's own engine with both pools, paired page for page; there,
    the copy op (from sgl_kernel, bound only on CUDA/HIP/XPU) is missing on this machine."""
    cache = dsa_hicache(write_policy=write_policy, mem_layout=mem_layout, io_backend=io_backend)
    engine = cache.controller.l2_transfer_engine
    handed = []
    real_submit = engine.submit_device_to_host

    def recording_submit(transfers):  # a spy: SGLang's own method still runs
        handed.append(list(transfers))
        return real_submit(transfers)

    engine.submit_device_to_host = recording_submit
    tokens = cache.tokens(5000, num_pages=3)
    device_indices, _ = cache.insert(tokens, seed=1)

    with pytest.raises(AttributeError, match="synchronize") as failure:
        if write_policy == "write_through":
            cache.step()  # check_hicache_events flushes the queued write-through
        else:
            cache.evict_device(len(tokens))  # write-back backs the leaf up before evicting
    # L2TransferEngine._submission re-raises after stream.synchronize(), which a CPU stream
    # lacks; the error it was handling is the missing sgl_kernel copy op.
    cause = failure.value.__context__
    assert isinstance(cause, NameError)
    assert cause.name.startswith("transfer_kv")

    assert len(handed) == 1
    kv, indexer = handed[0]
    assert type(kv.host_pool) is MLATokenToKVPoolHost
    assert type(indexer.host_pool) is DSAIndexerPoolHost
    assert kv.device_pool is indexer.device_pool is cache.kv_pool
    # The indexer rides on the KV pool's host slots: same host and device token indices.
    assert torch.equal(indexer.host_indices.cpu(), kv.host_indices.cpu())
    assert torch.equal(kv.device_indices.cpu().sort().values, device_indices.sort().values)
    host = kv.host_indices.cpu()
    assert len(host) == len(tokens)
    assert bool((host.view(-1, 64)[:, 0] % 64 == 0).all())  # whole host pages
    assert torch.equal(host.view(-1, 64) % 64, torch.arange(64).expand(3, 64))
