"""Write-through and write-back round trips through SGLang's own cache with the plug-in on.

Built by SGLang's own code after ``register()`` with ``DSA_ASYNC_SGLANG=1``: the strategy SGLang
selects is the plug-in's, the controller's engine and layer counter are the service's, SGLang's
host pools are views of the service's arenas. Bytes are seeded on the device pools (MLA KV and
indexer), backed up and loaded back by SGLang's own scheduler-facing calls, and read back
through SGLang's device-pool getters.
"""

from __future__ import annotations

import pytest

from dsa_async.integrations.sglang.engine import ServiceTransferEngine
from dsa_async.integrations.sglang.layer_counter import ServiceLayerCounter
from dsa_async.integrations.sglang.strategy import DsaAsyncStrategy

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}
LAYOUTS = [
    pytest.param("layer_first", "direct", id="layer_first-direct"),
    pytest.param("layer_first", "kernel", id="layer_first-kernel"),
    pytest.param("page_first_direct", "direct", id="page_first_direct-direct"),
]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize(("mem_layout", "io_backend"), LAYOUTS)
def test_round_trip_of_kv_and_indexer_bytes(dsa_hicache, write_policy, mem_layout, io_backend):
    cache = dsa_hicache(num_layers=3, write_policy=write_policy, mem_layout=mem_layout,
                        io_backend=io_backend, env=OPT_IN)
    assert isinstance(cache.selected_strategy, DsaAsyncStrategy)
    assert isinstance(cache.controller.l2_transfer_engine, ServiceTransferEngine)
    assert isinstance(cache.controller.layer_done_counter, ServiceLayerCounter)
    assert cache.kv_pool.layer_transfer_counter is cache.controller.layer_done_counter

    tokens = cache.tokens(start=1000, num_pages=3)
    _device, seeded = cache.insert(tokens, seed=7)
    cache.pump()
    cache.evict_device(len(tokens))
    cache.pump()
    cache.scrub_device()
    load = cache.load_back(tokens)
    got = cache.read_device_bytes(load.device_indices)
    cache.pump()
    cache.finish(load)
    assert got.equal(seeded)
