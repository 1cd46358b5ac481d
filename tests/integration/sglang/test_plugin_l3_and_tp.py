"""The plug-in under SGLang's L3 storage backend, and on two TP ranks.

L3: with ``--hicache-storage-backend file`` SGLang backs the host pages up to files itself
(``_finish_write_through_ack`` -> ``write_backup_storage`` -> the controller's backup thread ->
``HiCacheFile._write_page`` reading ``host_pool.get_data_page``) and prefetches them back into
host pages itself (the scheduler's ``_prefetch_kvcache`` -> ``prefetch_from_storage`` -> the
prefetch threads -> ``HiCacheFile._read_page`` writing ``set_from_flat_data_page``; the tree
inserts the pages on ``check_prefetch_progress``). With the plug-in on, the host pools those
calls read and write are views of the service's arenas, so the bytes the service backed up are
the bytes in the files, and the bytes prefetched from the files are the bytes the service loads.

TP: two processes (``tp_worker.py``), each one TP rank that builds the cache through SGLang's
own code with the real two-rank gloo group as ``tp_cache_group``: both ranks agree on the host
page count, round-trip their own bytes, and drain their acks through SGLang's all-reduce; ranks
whose SGLang host pools differ fail at start, both of them, with the plug-in's error.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName

from dsa_async.errors import UnsupportedSettingError
from dsa_async.integrations.sglang.engine import ServiceTransferEngine
from dsa_async.integrations.sglang.refusals import check_supported
from dsa_async.integrations.sglang.strategy import DsaAsyncStrategy

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}
HERE = Path(__file__).resolve().parent

#: SGLang skips storage prefetches shorter than its prefetch threshold (256 tokens by default,
#: ``unified_radix_cache.py`` ``prefetch_threshold``): four 64-token pages reach it.
L3_PAGES = 4


# ---- L3: SGLang's file backend over the service's arenas ---------------------------------


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte address a tensor's elements can touch."""
    start = tensor.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (extent + 1) * tensor.element_size()


def _is_view_of(tensor: torch.Tensor, arena: torch.Tensor) -> bool:
    """Whether ``tensor`` lies inside ``arena``'s bytes and shares its storage."""
    start, end = _span(tensor)
    arena_start, arena_end = _span(arena)
    same_storage = tensor.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    return same_storage and arena_start <= start and end <= arena_end


class SchedulerStandIn:
    """What ``Scheduler._prefetch_kvcache`` (``managers/scheduler.py:3342``) reads of the
    scheduler: its body runs unchanged, bound to this object, as the harness binds
    ``TpModelWorker``'s methods."""

    def __init__(self, tree_cache) -> None:
        self.enable_hicache_storage = True  # --hicache-storage-backend is set
        self.enable_lmcache = False
        self.tree_cache = tree_cache

    def prefetch_kvcache(self, req) -> None:
        Scheduler._prefetch_kvcache(self, req)


def _until(done, step, what: str, timeout_s: float = 120.0) -> int:
    """Run scheduler steps until ``done()``; the first L3 use in a fresh environment compiles
    SGLang's native hash extension, so the deadline is generous. Returns the steps run."""
    deadline = time.monotonic() + timeout_s
    steps = 0
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not done after {timeout_s} s and {steps} steps")
        step()
        steps += 1
        time.sleep(0.001)
    return steps


def _expected_files(seeded, page_tokens: int) -> tuple[list[bytes], list[bytes]]:
    """The bytes SGLang's file backend stores per page, from the seeded device bytes.

    A stored page is ``get_data_page(index, flat=True)`` of the host pool: every layer of the
    page, layer after layer (``pool_host/mla.py:1157``, ``pool_host/dsa.py:588``), in the
    layer_first and page_first_direct layouts alike."""
    tokens = seeded.kv[0].shape[0]
    kv = [
        torch.cat([layer[start:start + page_tokens] for layer in seeded.kv]).numpy().tobytes()
        for start in range(0, tokens, page_tokens)
    ]
    indexer = [
        torch.cat([layer[page] for layer in seeded.indexer]).numpy().tobytes()
        for page in range(seeded.indexer[0].shape[0])
    ]
    return kv, indexer


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_sglangs_raw_page_addresses_hold_each_page_or_their_backends_are_refused(
    dsa_hicache, mem_layout
):
    # SGLang's zero-copy storage backends (nixl, seaweedfs, simm, dynamic with interface_v1)
    # move pages through get_page_buffer_meta's addresses, the others through get_data_page.
    # Where the views the plug-in hands SGLang make the two disagree, those backends must be
    # refused (refusals.py); where they agree, both read the same bytes.
    from dsa_async.integrations.sglang.refusals import _RAW_POINTER_BACKENDS

    cache = dsa_hicache(num_layers=3, mem_layout=mem_layout, io_backend="direct", env=OPT_IN)
    kv = cache.host_pool("kv")
    torch.manual_seed(0)
    flat = kv.kv_buffer.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
    page_tokens = kv.page_size
    agree = True
    for page in (1, 2, kv.size // page_tokens - 1):
        indices = torch.arange(page * page_tokens, (page + 1) * page_tokens)
        addresses, sizes = kv.get_page_buffer_meta(indices)
        raw = b"".join(bytes((ctypes.c_char * size).from_address(address))
                       for address, size in zip(addresses, sizes))
        agree &= raw == kv.get_data_page(indices[0], flat=True).view(torch.uint8).numpy().tobytes()
    # page_first_direct is contiguous; layer_first's KV view spans one page more per layer
    assert agree == (mem_layout == "page_first_direct")
    for backend in _RAW_POINTER_BACKENDS:
        if not agree:
            with pytest.raises(UnsupportedSettingError, match=f"storage-backend {backend} reads"):
                check_supported(kvcache=cache.kv_pool, params=None, memory=SimpleNamespace(
                    hicache_mem_layout=mem_layout, hicache_io_backend="direct",
                    hicache_storage_backend=backend), storage_backend=backend)


@pytest.mark.parametrize("mem_layout", ["layer_first", "page_first_direct"])
def test_host_buffers_are_page_aligned_as_sglangs_own(dsa_hicache, mem_layout):
    # SGLang maps its host pools (page-aligned); nixl's O_DIRECT path checks the KV buffer's
    # alignment with is_stride_page_aligned and falls back to copies when it fails
    page_bytes = resource.getpagesize()
    cache = dsa_hicache(num_layers=3, mem_layout=mem_layout, io_backend="direct", env=OPT_IN)
    for name in ("kv", "indexer"):
        pool = cache.host_pool(name)
        buffer = pool.kv_buffer if name == "kv" else pool.index_k_with_scale_buffer
        assert buffer.data_ptr() % page_bytes == 0, name
    if mem_layout == "page_first_direct":
        assert cache.host_pool("kv").is_stride_page_aligned(page_bytes)


@pytest.mark.parametrize(
    ("mem_layout", "io_backend"),
    [
        pytest.param("layer_first", "direct", id="layer_first-direct"),
        pytest.param("page_first_direct", "direct", id="page_first_direct-direct"),
    ],
)
def test_l3_file_backend_reads_and_writes_the_bytes_the_service_moves(
    dsa_hicache, mem_layout, io_backend
):
    cache = dsa_hicache(
        num_layers=3, mem_layout=mem_layout, io_backend=io_backend, storage_backend="file",
        env=OPT_IN,
        # The scheduler admits a request only once its prefetch is complete (deterministic).
        extra_server_args={"hicache_storage_prefetch_policy": "wait_complete"},
    )
    assert isinstance(cache.selected_strategy, DsaAsyncStrategy)
    tree, controller = cache.tree_cache, cache.controller
    engine = controller.l2_transfer_engine
    assert isinstance(engine, ServiceTransferEngine)
    service = engine.service
    arenas = service.host_pool.arenas
    kv_host, indexer_host = cache.host_pool("kv"), cache.host_pool("indexer")

    # SGLang's L3 backend is attached to the host pools that are views of the service's arenas.
    storage = controller.storage_backend
    assert tree.enable_storage and type(storage) is HiCacheFile
    assert storage.registered_pools[PoolName.KV] is kv_host
    assert storage.registered_pools[PoolName.INDEXER] is indexer_host
    kv_is_view = _is_view_of(kv_host.kv_buffer, arenas["kv"])
    indexer_is_view = _is_view_of(indexer_host.index_k_with_scale_buffer, arenas["indexer"])
    assert kv_is_view, "SGLang's KV host buffer is not a view of the service's kv arena"
    assert indexer_is_view, "SGLang's indexer host buffer is not a view of the service's arena"

    submissions: list[float] = []
    engine.on_submit = submissions.append  # the engine's seam: one call per submission

    # device -> host: SGLang's write-through backup, copied by the service.
    tokens = cache.tokens(start=3000, num_pages=L3_PAGES)
    _device, seeded = cache.insert(tokens, seed=11)
    cache.pump()
    backups = len(submissions)
    assert backups >= 1

    # host -> L3: the write-through ack queued SGLang's storage backup; its backup thread wrote
    # the files and the scheduler steps drain the ack (check_hicache_events).
    assert tree.ongoing_backup, "the write-through ack queued no L3 backup"
    _until(lambda: not tree.ongoing_backup, cache.step, "SGLang's L3 backup")
    files = sorted(Path(storage.file_path).glob("*.bin"))
    stored_kv = sorted(f.read_bytes() for f in files if ".indexer_" not in f.name)
    stored_indexer = sorted(f.read_bytes() for f in files if ".indexer_" in f.name)
    expected_kv, expected_indexer = _expected_files(seeded, cache.settings.page_size_tokens)
    assert len(stored_kv) == len(stored_indexer) == L3_PAGES
    assert stored_kv == sorted(expected_kv), "the KV files are not the bytes the service backed up"
    assert stored_indexer == sorted(expected_indexer), (
        "the indexer files are not the bytes the service backed up")

    # Off the device, then off the host: only the files hold the bytes now.
    assert cache.evict_device(len(tokens)) == len(tokens)
    cache.pump()
    assert cache.match(tokens).host_hit_length == len(tokens)
    assert tree.evict_host(len(tokens)) == len(tokens)
    gone = cache.match(tokens)
    assert gone.device_prefix_len == 0 and gone.host_hit_length == 0
    cache.scrub_device()
    kv_host.kv_buffer.zero_()  # through SGLang's host buffers ...
    indexer_host.index_k_with_scale_buffer.zero_()
    arenas_zeroed = not any(arena.any() for arena in arenas.values())
    assert arenas_zeroed, "zeroing SGLang's host buffers left bytes in the service's arenas"

    # L3 -> host: the scheduler's prefetch of a waiting request, through SGLang's own code. The
    # request has one more token: SGLang never matches a request's last token.
    req = cache.new_req(tokens + [tokens[-1] + 1])
    SchedulerStandIn(tree).prefetch_kvcache(req)
    handle = req.cache_request_handle
    assert tree.has_ongoing_prefetch(handle), "SGLang issued no L3 prefetch"
    _until(lambda: tree.check_prefetch_progress(handle), cache.step, "SGLang's L3 prefetch")
    loaded_tokens, _start = tree.pop_prefetch_loaded_span(handle)
    cache.req_to_token_pool.free(req)
    assert loaded_tokens == len(tokens)
    prefetched = bool(arenas["kv"].any()) and bool(arenas["indexer"].any())
    assert prefetched, "SGLang's prefetch did not write the service's arenas"
    assert cache.match(tokens).host_hit_length == len(tokens)

    # host -> device: loaded back by the service, read through SGLang's device-pool getters.
    load = cache.load_back(tokens)
    got = cache.read_device_bytes(load.device_indices)
    cache.pump()
    cache.finish(load)
    assert load.loaded_tokens == len(tokens)
    assert len(submissions) > backups
    round_trip_exact = got.equal(seeded)
    assert round_trip_exact, "the bytes loaded back differ from the bytes seeded on the device"


# ---- two TP ranks ------------------------------------------------------------------------

#: How long one command may take on the ranks before the test fails (and the ranks are
#: killed); the start includes importing SGLang in two fresh processes.
COMMAND_TIMEOUT_S = 120.0
START_TIMEOUT_S = 240.0


class TwoRanks:
    """Two ``tp_worker.py`` processes (TP ranks 0 and 1) and their command channel."""

    WORLD_SIZE = 2

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.generation = 0
        self.procs: list[subprocess.Popen] = []
        self.replies: list[queue.Queue] = []
        self.logs: list[Path] = []

    # -- lifetime --

    def start(self) -> None:
        self.generation += 1
        run_dir = self.directory / f"run{self.generation}"
        run_dir.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k != "DSA_ASYNC_SGLANG"}
        # The ranks' own machine-wide ledger, so a reservation left behind is theirs to see.
        env["DSA_ASYNC_LEDGER"] = str(run_dir / "ledger")
        env["PYTHONUNBUFFERED"] = "1"
        store = run_dir / "store"
        self.procs, self.replies, self.logs = [], [], []
        try:
            for rank in range(self.WORLD_SIZE):
                log = run_dir / f"rank{rank}.log"
                with open(log, "wb") as stderr:
                    proc = subprocess.Popen(
                        [sys.executable, str(HERE / "tp_worker.py"), str(rank),
                         str(self.WORLD_SIZE), str(store), str(run_dir)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                        env=env, cwd=str(run_dir), text=True,
                    )
                self.procs.append(proc)
                self.logs.append(log)
                self.replies.append(self._reader(proc))
            ready = self._collect(START_TIMEOUT_S, "start")
            assert [r["result"]["ready"] for r in ready] == [0, 1], ready
        except BaseException:
            self.stop()
            raise

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """End both ranks: ask, then kill what is left; always reap."""
        for proc in self.procs:
            try:
                if proc.poll() is None:
                    proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                    proc.stdin.flush()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self.procs:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    # -- commands --

    def ask(self, cmd: str, **args) -> list[dict]:
        """Send one command to both ranks; return their replies (rank order). A rank that
        does not answer within COMMAND_TIMEOUT_S, or dies, fails the test; both are killed."""
        if not self.running():
            self.stop()
            self.start()
        line = json.dumps({"cmd": cmd, **args}) + "\n"
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        return self._collect(COMMAND_TIMEOUT_S, cmd)

    @staticmethod
    def _reader(proc: subprocess.Popen) -> queue.Queue:
        replies: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                replies.put(line)
            replies.put(None)  # end of output: the process ended

        threading.Thread(target=read, name=f"tp-worker-{proc.pid}", daemon=True).start()
        return replies

    def _collect(self, timeout_s: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        replies = []
        for rank, pending in enumerate(self.replies):
            try:
                line = pending.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
                problem = f"rank {rank} did not answer {what!r} within {timeout_s} s"
            else:
                problem = f"rank {rank} ended during {what!r}" if line is None else None
            if problem is not None:
                self.kill()
                pytest.fail(f"{problem}\n{self.log_tails()}")
            replies.append(json.loads(line))
        return replies

    def log_tails(self, chars: int = 4000) -> str:
        parts = []
        for rank, log in enumerate(self.logs):
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- rank {rank} stderr (tail) ---\n{text[-chars:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ranks = TwoRanks(tmp_path_factory.mktemp("tp2"))
    ranks.start()
    try:
        yield ranks
    finally:
        ranks.stop()


def _results(replies: list[dict], ranks: TwoRanks) -> list[dict]:
    failed = [(rank, r) for rank, r in enumerate(replies) if not r["ok"]]
    if failed:
        pytest.fail("\n".join(f"rank {rank}: {r['error_type']}: {r['error']}\n{r['traceback']}"
                              for rank, r in failed) + "\n" + ranks.log_tails())
    return [r["result"] for r in replies]


def _write_ack_counts(calls: list[dict]) -> list[tuple[int, int]]:
    """(this rank's ready write acks, the TP minimum) of each ack count SGLang all-reduced.

    ``_sync_hicache_ready_counts`` (``unified_radix_cache.py:3412``) reduces
    ``[write acks, load acks, digest, -digest]`` with MIN when no storage backend is set."""
    return [(c["before"][0], c["after"][0]) for c in calls if len(c["before"]) == 4]


def test_two_tp_ranks_agree_on_host_pages_and_round_trip_through_sglangs_all_reduce(two_ranks):
    slow_rank, delay_s = 1, 1.0
    results = _results(two_ranks.ask("round_trip", slow_rank=slow_rank, delay_s=delay_s, seed=40),
                       two_ranks)

    for rank, r in enumerate(results):
        assert r["is_plugin_strategy"] and r["engine_is_service"], r["strategy"]
        assert r["tp_cache_group_size"] == 2 and r["tp_cache_group_rank"] == rank
        assert r["tree_tp_world_size"] == 2
        # One host page count: the service holds SGLang's pools (the indexer sizes them, one
        # page over the KV pool's, hybrid DSA host sizing), the same on both ranks.
        assert r["service_capacity_pages"] == r["indexer_host_pages"] == r["kv_host_pages"] + 1
        assert r["kv_host_tokens"] == r["kv_host_pages"] * 64
        assert r["evicted_tokens"] == r["loaded_tokens"] == 3 * 64
        assert r["seeded_nonzero"] and r["bytes_equal"], f"rank {rank}: bytes differ"
        # Every all-reduce SGLang ran while acks drained went over both ranks, and each
        # rank's write ack and load ack drained through them.
        for phase in ("write_all_reduces", "load_all_reduces"):
            assert r[phase] and all(c["group_size"] == 2 for c in r[phase]), (rank, phase)
        assert sum(after for _, after in _write_ack_counts(r["write_all_reduces"])) == 1
        assert sum(c["after"][1] for c in r["load_all_reduces"] if len(c["after"]) == 4) == 1
        # A running service shows as its loop thread and its ledger reservation; after close,
        # neither is left.
        assert r["service_threads_while_running"] == ["dsa-async-sglang"], r
        assert len(r["ledger_entries_while_running"]) == 1, r
        assert r["service_threads_after_close"] == [] and r["ledger_entries_after_close"] == []
    assert results[0]["service_capacity_pages"] == results[1]["service_capacity_pages"]

    # The fast rank's ack was ready while the slow rank's backup still slept: SGLang's MIN over
    # the TP group held it back until both were done, and both ranks drained it in the same step.
    fast = _write_ack_counts(results[1 - slow_rank]["write_all_reduces"])
    slow = _write_ack_counts(results[slow_rank]["write_all_reduces"])
    assert any(mine == 1 and agreed == 0 for mine, agreed in fast), fast
    assert not any(mine == 1 and agreed == 0 for mine, agreed in slow), slow
    assert [agreed for _, agreed in fast] == [agreed for _, agreed in slow]


def test_tp_ranks_with_different_host_pools_both_fail_at_start(two_ranks):
    # --hicache-ratio 2 and 3 on a 1024-token device pool: 2048 and 3072 host tokens, plus
    # SGLang's padding page, i.e. 33 and 49 KV pages; the service holds the indexer's count,
    # one more (34 and 50).
    results = _results(two_ranks.ask("mismatch", ratios=[2.0, 3.0]), two_ranks)
    for rank, r in enumerate(results):
        assert r["raised"], f"rank {rank} started with host pools that differ across ranks: {r}"
        assert r["error_type"] == "UnsupportedSettingError", r
        assert r["error_module"].startswith("dsa_async"), r
        assert "SGLang sized their KV host pools at 33 to 49 pages" in r["error"], r["error"]
        # Nothing left running: no service loop thread, no reservation in the ledger.
        assert r["service_threads"] == [] and r["ledger_entries"] == [], r
    assert results[0]["error"] == results[1]["error"]


def test_a_rank_whose_budget_refuses_stops_every_rank(two_ranks):
    # The host budget is checked per rank (co-located ranks share the machine-wide ledger): a
    # rank that cannot start must not leave the other running alone, waiting for it in
    # SGLang's first all-reduce. Rank 1 is given a reserve no machine has.
    results = _results(two_ranks.ask("one_rank_refused", refused_rank=1), two_ranks)
    assert all(r["raised"] for r in results), results
    assert results[1]["error_type"] == "HostBudgetExceeded", results[1]
    assert results[0]["error_type"] == "UnsupportedSettingError", results[0]
    assert "another TP rank could not start its offload service" in results[0]["error"]
    for r in results:
        assert r["service_threads"] == [] and r["ledger_entries"] == [], r
