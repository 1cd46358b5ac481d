"""What the plug-in refuses, what it leaves to SGLang, and that it stays off unless asked.

Refusals through SGLang's own build (``dsa_hicache(..., env=OPT_IN)``): the setting is passed as
SGLang's own flag or model config field, SGLang resolves its arguments (e.g.
``arg_groups/hicache_hook.py:171-195`` rewrites page_first + direct into page_first_direct and
page_first_direct + kernel into direct, so only the pairs that stay unsupported are refused),
builds its device pools and reaches the plug-in's ``build`` through ``create_tree_cache`` ->
``init_hicache`` -> ``attach_hybrid_pool_to_unified_cache``, which logs the error and re-raises
it unwrapped (``hybrid_pool_assembler.py:2525-2556``). Each test asserts the error names the
flag and that the service allocated nothing: it was never started, its (private) ledger was
never touched and no thread was left behind. Several of these settings SGLang cannot build on
its own either (page_first_kv_split, page_head, mooncake/mori/npu_memcache/tensorcast without
their packages or daemon): there the plug-in refuses first, before SGLang's own error.

Refusals checked with ``check_supported`` directly, on a real SGLang pool, params, memory and
parallel context from a harness build (opted out, SGLang's own cache), with only the one value
that reveals the case changed. These settings cannot be built by SGLang 0.5.23 on one CPU rank:

- HIP: needs a ROCm torch (SGLang's DSA pool asserts HIP page sizes from ``is_hip()``, fixed at
  import);
- DCP (``--dcp-size > 1``): SGLang's own argument resolution refuses DCP with HiCache for DSA
  models ("DSA DCP does not support HiSparse or HiCache"), and it needs several ranks; the
  plug-in's check is a guard for the widened indices (``kvcache.dcp_replicated``);
- page-interleaved KV sharding (``--enable-kv-cache-sharding``): only on PD prefill workers,
  with a shard group of several ranks;
- MTP draft device pools (``--speculative-algorithm``): they come from a draft model runner
  (model weights, a GPU);
- HiSparse and layer-split DSA pools (``--enable-hisparse``, ``--enable-dsa-cache-layer-split``):
  built by SGLang's KV-cache configurator on GPU/CP ranks (the harness builds the plain pool);
- ``--pp-size`` / ``--attn-cp-size`` > 1: several ranks; ``CacheInitParams.pp_size`` /
  ``attn_cp_size`` come from the scheduler's parallel context (``kv_cache_builder.py:417-419``),
  which a one-rank build cannot have.

Also here: an MLA-only model (DeepSeek-V3 without the DSA indexer) with the plug-in opted in is
left to SGLang (``mla_hicache.py``); without ``DSA_ASYNC_SGLANG`` at build time SGLang builds its
own cache although the plug-in is registered; and SGLang's ``load_plugins`` registers nothing
without the variable (a fresh process: plug-ins load once per process, and this one loaded them
opted in) and exactly one strategy with it (this process, conftest).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from dsa_hicache_harness import DsaHiCacheSettings
from mla_hicache import build_mla_hicache
from sglang.srt.managers.cache_controller import LayerDoneCounter
from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.l2_transfer import L2TransferEngine
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_memory, get_parallel

from dsa_async.errors import UnsupportedSettingError
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.integrations import loop_thread
from dsa_async.integrations.sglang import refusals, strategy
from dsa_async.integrations.sglang.strategy import DsaAsyncStrategy

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}
SERVICE_THREAD = "dsa-async-sglang"
_ASSEMBLER_LOGGER = hybrid_pool_assembler.__name__
_HERE = Path(__file__).resolve().parent


class ServiceWatch:
    """Everything the service would allocate, watched over one build.

    The next build's service keeps its ledger in a private directory (``SERVICE_OPTIONS``), so
    "never touched" is visible after the fact (the directory is created by the first ledger
    access and kept after a release); ``ServiceThread.start`` is spied (still called through);
    threads are compared with those alive before the build.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.ledger_directory = tmp_path / "ledger"
        monkeypatch.setattr(strategy, "SERVICE_OPTIONS",
                            {"config": {"ledger_directory": str(self.ledger_directory)}})
        self.starts: list[str] = []
        real_start = loop_thread.ServiceThread.start

        def start(*args, **kwargs):
            self.starts.append(kwargs.get("name"))
            return real_start(*args, **kwargs)

        monkeypatch.setattr(loop_thread.ServiceThread, "start", start)
        self._threads_before = set(threading.enumerate())

    def new_threads(self) -> list[str]:
        return sorted(t.name for t in threading.enumerate()
                      if t not in self._threads_before and t.is_alive())

    def ledger_entries(self) -> tuple:
        return HostLedger(self.ledger_directory).peek()

    def assert_nothing_allocated(self) -> None:
        assert self.starts == [], "the service was started"
        assert not self.ledger_directory.exists(), "the service's ledger was touched"
        assert self.ledger_entries() == ()
        assert self.new_threads() == []
        assert SERVICE_THREAD not in {t.name for t in threading.enumerate()}


@pytest.fixture
def watch(monkeypatch, tmp_path) -> ServiceWatch:
    return ServiceWatch(monkeypatch, tmp_path)


def plugin_strategy() -> DsaAsyncStrategy:
    """The strategy SGLang's ``load_plugins`` registered in this process (conftest, opted in)."""
    ours = [s for s in hybrid_pool_assembler._STRATEGIES if isinstance(s, DsaAsyncStrategy)]
    assert len(ours) == 1, ours
    return ours[0]


def refused_by_sglangs_build(dsa_hicache, caplog, **settings) -> str:
    """Build with the plug-in opted in; return the refusal's message.

    The error must come out of SGLang's assembler as the plug-in raised it (SGLang logs it and
    re-raises; it does not wrap it)."""
    caplog.set_level(logging.ERROR, logger=_ASSEMBLER_LOGGER)
    with pytest.raises(UnsupportedSettingError) as refused:
        dsa_hicache(env=OPT_IN, **settings)
    assert type(refused.value) is UnsupportedSettingError
    logged = [r for r in caplog.records if r.name == _ASSEMBLER_LOGGER
              and r.getMessage() == "attach_hybrid_pool_to_unified_cache failed"]
    assert len(logged) == 1 and logged[0].exc_info[1] is refused.value
    message = str(refused.value)
    assert message.startswith("dsa_async SGLang plug-in: ")
    assert message.endswith("or unset DSA_ASYNC_SGLANG to let SGLang build its own cache")
    return message


# --- refused through SGLang's own build ----------------------------------------------------------

@pytest.mark.parametrize(("mem_layout", "io_backend"), [
    # SGLang's defaults: resolution keeps page_first with the kernel backend.
    pytest.param("page_first", "kernel", id="page_first-kernel"),
    # NPU/MHA layouts: SGLang's DSA host pools cannot build them either (AttributeError /
    # "Unsupported layout"); the plug-in refuses first.
    pytest.param("page_first_kv_split", "kernel", id="page_first_kv_split-kernel"),
    pytest.param("page_first_kv_split", "direct", id="page_first_kv_split-direct"),
    pytest.param("page_head", "kernel", id="page_head-kernel"),
    pytest.param("page_head", "direct", id="page_head-direct"),
])
def test_unsupported_host_layout_is_refused_before_anything_is_allocated(
        dsa_hicache, caplog, watch, mem_layout, io_backend):
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout=mem_layout,
                                       io_backend=io_backend)
    # what SGLang's argument resolution published (and the plug-in read): the pair unchanged
    assert (get_memory().hicache_mem_layout, get_memory().hicache_io_backend) == (
        mem_layout, io_backend)
    assert f"--hicache-mem-layout {mem_layout} is not supported" in message
    assert "--hicache-mem-layout layer_first" in message  # what to pass instead
    watch.assert_nothing_allocated()


@pytest.mark.parametrize(("mem_layout", "io_backend"), [
    pytest.param("page_first", "direct", id="page_first-direct"),
    pytest.param("page_first_direct", "kernel", id="page_first_direct-kernel"),
])
def test_pairs_sglang_resolves_into_a_supported_layout_are_served(
        dsa_hicache, watch, mem_layout, io_backend):
    """The counterpart of the layout refusal: these pairs end up page_first_direct + direct."""
    cache = dsa_hicache(mem_layout=mem_layout, io_backend=io_backend, env=OPT_IN)
    assert (get_memory().hicache_mem_layout, get_memory().hicache_io_backend) == (
        "page_first_direct", "direct")
    assert cache.selected_strategy is plugin_strategy()
    assert watch.starts == [SERVICE_THREAD]


def test_kernel_ascend_io_backend_is_refused(dsa_hicache, caplog, watch):
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout="layer_first",
                                       io_backend="kernel_ascend")
    assert "--hicache-io-backend kernel_ascend is not supported" in message
    watch.assert_nothing_allocated()


def test_buffer_only_host_memory_mode_is_refused(dsa_hicache, caplog, watch):
    # buffer_only needs a storage backend (SGLang refuses it without one, at argument
    # resolution); "file" is the one that runs here.
    message = refused_by_sglangs_build(
        dsa_hicache, caplog, mem_layout="layer_first", storage_backend="file",
        extra_server_args={"hicache_host_memory_mode": "buffer_only"})
    assert "--hicache-host-memory-mode buffer_only" in message
    watch.assert_nothing_allocated()


#: SGLang 0.5.23's --hicache-storage-backend choices whose host memory the backend allocates
#: (``pool_host/common.py`` ``get_allocator_from_storage``), named here rather than read from
#: refusals.py so that one dropped there fails here.
OWN_ALLOCATOR_BACKENDS = ("mooncake", "mori", "shm", "tensorcast", "npu_memcache")


@pytest.mark.parametrize("backend", OWN_ALLOCATOR_BACKENDS)
def test_storage_backend_with_its_own_host_allocator_is_refused(
        dsa_hicache, caplog, watch, backend):
    # page_first_direct + direct, so the layout (which SGLang rewrites for mooncake and
    # npu_memcache from layer_first to page_first) is not what is refused. Without the plug-in,
    # SGLang builds shm here and fails later on the others (mooncake, mori, npu_memcache: package
    # not installed; tensorcast: no daemon address).
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout="page_first_direct",
                                       io_backend="direct", storage_backend=backend)
    assert f"--hicache-storage-backend {backend} allocates the host memory itself" in message
    watch.assert_nothing_allocated()


@pytest.mark.parametrize("backend", ["mooncake", "npu_memcache"])
def test_a_backend_that_rewrites_the_layout_is_named_not_the_layout(dsa_hicache, caplog, watch,
                                                                    backend):
    # SGLang turns layer_first into page_first for these; the refusal names the backend the
    # user chose, not a layout the user never passed.
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout="layer_first",
                                       io_backend="direct", storage_backend=backend)
    assert f"--hicache-storage-backend {backend} allocates the host memory itself" in message
    watch.assert_nothing_allocated()


def test_a_dynamic_backend_asking_for_shared_memory_is_refused(dsa_hicache, caplog, watch):
    message = refused_by_sglangs_build(
        dsa_hicache, caplog, mem_layout="page_first_direct", io_backend="direct",
        storage_backend="dynamic",
        extra_server_args={"hicache_storage_backend_extra_config": '{"allocator": "shm"}'})
    assert "--hicache-storage-backend dynamic (with a shm allocator" in message
    watch.assert_nothing_allocated()


#: Backends that move pages through ``get_page_buffer_meta`` addresses (SGLang 0.5.23:
#: ``seaweedfs_store.py`` ``_get_into``/``_put_from``, ``hicache_simm.py``, ``hicache_nixl.py``
#: zero copy), computed for a contiguous layer_first KV buffer of the KV pool's own size.
RAW_POINTER_BACKENDS = ("nixl", "seaweedfs", "simm")


@pytest.mark.parametrize("backend", RAW_POINTER_BACKENDS)
def test_a_raw_address_backend_is_refused_with_layer_first(dsa_hicache, caplog, watch,
                                                           backend):
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout="layer_first",
                                       io_backend="direct", storage_backend=backend)
    assert f"--hicache-storage-backend {backend} reads and writes host pages" in message
    assert "use --hicache-mem-layout page_first_direct" in message
    watch.assert_nothing_allocated()


@pytest.mark.parametrize("given", ["inline", "json_file", "toml_file"])
def test_a_dynamic_backend_on_sglangs_zero_copy_interface_is_refused_with_layer_first(
        dsa_hicache, caplog, watch, tmp_path, given):
    # SGLang reads the extra config inline or from a file named with @ (its own parser)
    extra = '{"interface_v1": 1}'
    if given == "json_file":
        (tmp_path / "extra.json").write_text(extra)
        extra = f"@{tmp_path / 'extra.json'}"
    elif given == "toml_file":
        (tmp_path / "extra.toml").write_text("interface_v1 = 1\n")
        extra = f"@{tmp_path / 'extra.toml'}"
    message = refused_by_sglangs_build(
        dsa_hicache, caplog, mem_layout="layer_first", io_backend="direct",
        storage_backend="dynamic",
        extra_server_args={"hicache_storage_backend_extra_config": extra})
    assert "--hicache-storage-backend dynamic with interface_v1 reads and writes" in message
    watch.assert_nothing_allocated()


def test_index_kpool_above_one_is_refused(dsa_hicache, caplog, watch):
    # SGLang's DSA pool needs 64-token indexer pages: page_size / index_kpool == 64.
    message = refused_by_sglangs_build(dsa_hicache, caplog, mem_layout="layer_first",
                                       page_size_tokens=128,
                                       model_config_overrides={"index_kpool": 2})
    assert "index_kpool=2 (model config)" in message
    watch.assert_nothing_allocated()


@pytest.mark.parametrize(("num_layers", "overrides", "field"), [
    pytest.param(2, {"indexer_types": ["full", "shared"]}, "indexer_types", id="indexer_types"),
    # configs/model_config.py:522: layer l skips when (l - 1) % freq != 0 (layer 2 of 3 here)
    pytest.param(3, {"index_topk_freq": 2}, "index_topk_freq", id="index_topk_freq"),
])
def test_layers_sharing_top_k_are_refused(dsa_hicache, caplog, watch, num_layers, overrides,
                                          field):
    message = refused_by_sglangs_build(dsa_hicache, caplog, num_layers=num_layers,
                                       mem_layout="layer_first",
                                       model_config_overrides=overrides)
    assert "skip_topk_layers" in message and field in message
    watch.assert_nothing_allocated()


def test_unified_memory_is_refused(dsa_hicache, caplog, watch):
    # SGLang's argument resolution rejects --enable-unified-memory with the CPU's torch_native
    # attention backend, so a GPU backend is named. The harness still builds a paged allocator
    # (SGLang's unified one needs CUDA); the refusal reads the published memory settings.
    message = refused_by_sglangs_build(
        dsa_hicache, caplog, mem_layout="layer_first",
        extra_server_args={"enable_unified_memory": True, "attention_backend": "flashmla"})
    assert "--enable-unified-memory is not supported" in message
    watch.assert_nothing_allocated()


def test_the_watch_sees_what_a_served_build_allocates(dsa_hicache, watch):
    """The same watch over a build the plug-in serves: the service starts, holds a ledger
    reservation and a thread; once SGLang releases its host pools, both are gone."""
    cache = dsa_hicache(mem_layout="layer_first", io_backend="direct", env=OPT_IN)
    assert cache.selected_strategy is plugin_strategy()
    assert watch.starts == [SERVICE_THREAD]
    assert SERVICE_THREAD in watch.new_threads()
    (entry,) = watch.ledger_entries()
    assert entry.pid == os.getpid() and entry.reserved_bytes > 0
    cache.close()
    assert watch.ledger_entries() == ()
    assert SERVICE_THREAD not in {t.name for t in threading.enumerate()}


# --- refused by check_supported on SGLang's own objects ------------------------------------------

@pytest.fixture
def sglang_objects(dsa_hicache, monkeypatch):
    """A real pool, params, memory and parallel context: SGLang's own supported cache."""
    monkeypatch.delenv("DSA_ASYNC_SGLANG", raising=False)
    cache = dsa_hicache(mem_layout="layer_first")
    assert type(cache.selected_strategy) is hybrid_pool_assembler._DsaStrategy
    objects = dict(kvcache=cache.kv_pool, params=cache.cache_init_params, memory=get_memory(),
                   storage_backend=None, parallel=get_parallel())
    refusals.check_supported(**objects)  # unchanged, nothing is refused
    return objects


def _refused(objects) -> str:
    with pytest.raises(UnsupportedSettingError) as refused:
        refusals.check_supported(**objects)
    return str(refused.value)


def test_hip_is_refused(sglang_objects, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    assert "ROCm/HIP builds are not supported" in _refused(sglang_objects)


def test_mtp_draft_device_pools_are_refused(sglang_objects, monkeypatch):
    params = sglang_objects["params"]
    monkeypatch.setattr(params, "mtp_draft_device_pools", (sglang_objects["kvcache"],))
    assert "--speculative-algorithm" in _refused(sglang_objects)


def test_sidecar_draft_device_pools_are_refused(sglang_objects, monkeypatch):
    """A draft model whose KV pools SGLang keeps beside the target's (its SIDECAR HiCache mode):
    refused at start, before SGLang sizes and allocates host buffers for them."""
    params = sglang_objects["params"]
    monkeypatch.setattr(params, "sidecar_draft_device_pools", (sglang_objects["kvcache"],))
    assert "--speculative-algorithm" in _refused(sglang_objects)


def test_dcp_widened_indices_are_refused(sglang_objects, monkeypatch):
    monkeypatch.setattr(sglang_objects["kvcache"], "dcp_replicated", True)
    assert "--dcp-size 1" in _refused(sglang_objects)


@pytest.mark.parametrize(("pool_class", "flag"), [
    pytest.param(PageInterleaveDSATokenToKVPool, "--enable-kv-cache-sharding", id="kv-sharding"),
    pytest.param(HiSparseDSATokenToKVPool, "--enable-hisparse", id="hisparse"),
    pytest.param(LayerSplitDSATokenToKVPool, "--enable-dsa-cache-layer-split", id="layer-split"),
])
def test_dsa_pool_subclasses_are_refused(sglang_objects, pool_class, flag):
    """SGLang's configurator builds these subclasses of the DSA pool for these flags (and
    ``matches`` takes them, as SGLang's ``_DsaStrategy`` does): here the pool SGLang built, as
    an instance of that class with the same state (a ``__class__`` assignment is refused by
    Python for the page-interleaved pool's layout)."""
    kvcache = sglang_objects["kvcache"]
    as_subclass = pool_class.__new__(pool_class)
    as_subclass.__dict__.update(vars(kvcache))
    assert isinstance(as_subclass, type(kvcache))
    assert flag in _refused({**sglang_objects, "kvcache": as_subclass})


def test_layer_sharded_pool_is_refused(sglang_objects, monkeypatch):
    monkeypatch.setattr(sglang_objects["kvcache"], "layer_shard_enabled", True, raising=False)
    assert "--enable-dsa-cache-layer-split" in _refused(sglang_objects)


@pytest.mark.parametrize(("field", "flag"), [
    pytest.param("pp_size", "--pp-size", id="pp"),
    pytest.param("attn_cp_size", "--attn-cp-size", id="attn-cp"),
])
def test_multi_rank_parallelism_is_refused(sglang_objects, monkeypatch, field, flag):
    monkeypatch.setattr(sglang_objects["params"], field, 2)
    assert flag in _refused(sglang_objects)


# --- left to SGLang -------------------------------------------------------------------------------

@pytest.fixture
def mla_hicache(tmp_path):
    built = []

    def build(**settings):
        cache = build_mla_hicache(DsaHiCacheSettings(**settings), tmp_path / f"mla-{len(built)}")
        built.append(cache)
        return cache

    yield build
    for cache in reversed(built):
        cache.close()


def test_a_model_without_the_dsa_indexer_is_left_to_sglang(mla_hicache, watch, caplog,
                                                           monkeypatch):
    ours = plugin_strategy()
    monkeypatch.setattr(ours, "_declined", set())  # it logs once per pool type and process
    caplog.set_level(logging.INFO, logger=strategy.__name__)

    cache = mla_hicache(mem_layout="layer_first", env=OPT_IN)

    assert type(cache.kv_pool) is MLATokenToKVPool
    assert type(cache.selected_strategy) is hybrid_pool_assembler._PlainKvStrategy
    assert type(cache.controller) is HybridCacheController
    assert type(cache.controller.l2_transfer_engine) is L2TransferEngine
    assert type(cache.controller.layer_done_counter) is LayerDoneCounter
    assert type(cache.host_pool("kv")) is MLATokenToKVPoolHost
    declined = [r for r in caplog.records if r.name == strategy.__name__]
    assert [(r.levelno, r.getMessage()) for r in declined] == [(
        logging.INFO,
        "dsa_async: MLATokenToKVPool is not a DSA model's cache; SGLang builds its own")]
    watch.assert_nothing_allocated()


def test_without_the_opt_in_at_build_time_sglang_builds_its_own_cache(dsa_hicache, watch,
                                                                       monkeypatch):
    plugin_strategy()  # registered: the plug-in was loaded opted in (conftest)
    monkeypatch.delenv("DSA_ASYNC_SGLANG", raising=False)

    # layer_first + direct: a setting the plug-in serves, so only the opt-in decides
    cache = dsa_hicache(mem_layout="layer_first", io_backend="direct")

    assert type(cache.selected_strategy) is hybrid_pool_assembler._DsaStrategy
    assert type(cache.controller.l2_transfer_engine) is L2TransferEngine
    assert type(cache.controller.layer_done_counter) is LayerDoneCounter
    watch.assert_nothing_allocated()


#: Run in a fresh venv python: SGLang's own ``load_plugins()`` with our ``register`` spied on
#: (the entry point resolves the module attribute when SGLang loads it), then the strategies.
_LOAD_PLUGINS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import cpu_shims
cpu_shims.install_torchvision_stub()  # before SGLang is imported (see cpu_shims)
import dsa_async.integrations.sglang as plugin
calls = []
real_register = plugin.register
def register():
    calls.append("called")
    real_register()
    calls.append("returned")
plugin.register = register
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
print(json.dumps({
    "calls": calls,
    "strategies": [type(s).__name__ for s in hybrid_pool_assembler._STRATEGIES],
    "strategy_module_imported": "dsa_async.integrations.sglang.strategy" in sys.modules,
}))
"""


def test_sglangs_plugin_loading_registers_nothing_without_the_opt_in():
    """A fresh process (this one loaded the plug-ins opted in, once, as SGLang does per
    process): SGLang's ``load_plugins`` calls ``register()``, which registers nothing. The
    slow part is the process importing SGLang."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DSA_ASYNC_SGLANG", "SGLANG_PLUGINS")}  # SGLang loads every plug-in
    run = subprocess.run([sys.executable, "-c", _LOAD_PLUGINS, str(_HERE)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])

    builtins = [type(s).__name__ for s in hybrid_pool_assembler._STRATEGIES
                if not isinstance(s, DsaAsyncStrategy)]
    assert builtins[-3:] == ["_DsaStrategy", "_MiniMaxSparseStrategy", "_PlainKvStrategy"]
    assert seen == {"calls": ["called", "returned"], "strategies": builtins,
                    "strategy_module_imported": False}


def test_sglangs_plugin_loading_registers_one_strategy_when_opted_in():
    """What SGLang's ``load_plugins`` did in this process, with ``DSA_ASYNC_SGLANG=1``
    (conftest): exactly one strategy, first, so it is asked before SGLang's own."""
    ours = [s for s in hybrid_pool_assembler._STRATEGIES if isinstance(s, DsaAsyncStrategy)]
    assert len(ours) == 1
    assert hybrid_pool_assembler._STRATEGIES[0] is ours[0]


# --- a storage backend attached at runtime (SGLang's admin endpoint) ----------------------------


@pytest.mark.parametrize(("mem_layout", "backend", "extra", "says"), [
    ("layer_first", "seaweedfs", None, "--hicache-storage-backend seaweedfs reads and writes"),
    ("layer_first", "dynamic", '{"interface_v1": 1}', "dynamic with interface_v1 reads"),
    ("page_first_direct", "mooncake", None, "mooncake allocates the host memory itself"),
    ("page_first_direct", "dynamic", '{"allocator": "shm"}', "with a shm allocator"),
])
def test_a_backend_attached_at_runtime_meets_the_same_refusals(dsa_hicache, mem_layout, backend,
                                                                extra, says):
    cache = dsa_hicache(num_layers=3, mem_layout=mem_layout, io_backend="direct", env=OPT_IN)
    ok, message = cache.tree_cache.attach_storage_backend(
        storage_backend=backend, storage_backend_extra_config_json=extra)
    assert not ok and says in message and "dsa_async SGLang plug-in" in message
    assert not cache.controller.enable_storage  # nothing attached
