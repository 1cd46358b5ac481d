"""The SGLang plug-in's round trips on the CUDA backend, through SGLang 0.5.23's own cache.

For machines with both a GPU and SGLang 0.5.23 installed (the GPU test machine has no network,
so it cannot install SGLang: there the module is skipped). The cache is built by the same harness
as tests/integration/sglang, with SGLang's device pools on the GPU: the service then runs its
CUDA engine, SGLang's device indices stay on the GPU (read by the engine after the copy's
producers), and the getters' per-layer waits are GPU-side.
"""

from __future__ import annotations

import sys
from pathlib import Path

import warnings

import pytest
import torch

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 (pip install --no-deps sglang==0.5.23)")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device; none is available here", allow_module_level=True)

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "sglang"))

with warnings.catch_warnings():  # importing SGLang warns about its platform; not the cache path
    warnings.simplefilter("ignore")
    from dsa_hicache_harness import (  # noqa: E402
        DsaHiCacheSettings,
        build_dsa_hicache,
        load_plugins_opted_in,
    )

from dsa_async.integrations.sglang.engine import ServiceTransferEngine  # noqa: E402
from dsa_async.kinds import Backend  # noqa: E402

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded_opted_in():
    load_plugins_opted_in()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize(("mem_layout", "io_backend"), [
    ("layer_first", "direct"), ("layer_first", "kernel"), ("page_first_direct", "direct")])
def test_round_trip_of_kv_and_indexer_bytes_on_the_gpu(tmp_path, write_policy, mem_layout,
                                                       io_backend):
    settings = DsaHiCacheSettings(num_layers=4, device="cuda", write_policy=write_policy,
                                  mem_layout=mem_layout, io_backend=io_backend, env=OPT_IN)
    cache = build_dsa_hicache(settings, tmp_path / "cache")
    try:
        engine = cache.controller.l2_transfer_engine
        assert isinstance(engine, ServiceTransferEngine)
        assert engine.service.backend is Backend.CUDA
        tokens = cache.tokens(start=3000, num_pages=3)
        device, seeded = cache.insert(tokens, seed=11)
        assert device.is_cuda  # SGLang's own indices, read by the engine on the GPU
        cache.pump()
        cache.evict_device(settings.device_pool_tokens)
        cache.pump()
        cache.scrub_device()
        load = cache.load_back(tokens)
        got = cache.read_device_bytes(load.device_indices)  # after GPU-side per-layer waits
        cache.pump()
        cache.finish(load)
        assert got.equal(seeded)
    finally:
        cache.close()
