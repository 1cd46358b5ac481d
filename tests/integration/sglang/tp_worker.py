"""One TP rank of a two-rank SGLang scheduler, for ``test_plugin_l3_and_tp.py``.

Run with the SGLang venv's python: ``python tp_worker.py RANK WORLD_SIZE STORE_FILE WORKDIR``.
Each rank is its own process, as SGLang's TP ranks are: it joins a gloo world over a
``FileStore`` (a file in the test's temporary directory: no port), makes the groups the
scheduler hands the cache (``kv_cache_builder.py:402-405``: the TP and attention-TP groups over
both ranks, one-rank attention-CP and PP groups of its own), loads the plug-ins opted in as an
operator launches (``DSA_ASYNC_SGLANG=1``), and then builds SGLang's DSA hierarchical cache
through the harness (SGLang's own code, ``tp_size=2`` published with this rank's placement).

It then answers commands, one JSON object per line on stdin, with one JSON object per line on
the file descriptor its stdout had at start (everything else the process prints goes to
stderr): ``{"ok": true, "result": ...}`` or ``{"ok": false, "error_type": ..., "error": ...,
"traceback": ...}``. Commands (``{"cmd": NAME, ...}``) are the scenarios below; both ranks are
sent the same command, since their collectives must meet. End of input, ``{"cmd": "exit"}`` or
the death of the parent end the process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _protocol_stream():
    """Keep the original stdout for replies; send anything else written to fd 1 to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return reply


def _exit_when_orphaned(parent: int) -> None:
    """A worker whose test process died must not linger (e.g. stuck in a collective)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


REPLY = _protocol_stream()
_exit_when_orphaned(os.getppid())

sys.path.insert(0, str(HERE))
import cpu_shims  # noqa: E402,F401 - offline hub before transformers is imported
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dsa_hicache_harness import (  # noqa: E402
    CacheGroups,
    DsaHiCacheSettings,
    build_dsa_hicache,
    load_plugins_opted_in,
)

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}


def _groups(rank: int, world_size: int) -> CacheGroups:
    everyone = list(range(world_size))
    # new_group is collective over the default group: every rank makes every group, in order.
    tp = dist.new_group(ranks=everyone, backend="gloo")
    attn_tp = dist.new_group(ranks=everyone, backend="gloo")
    own = [dist.new_group(ranks=[r], backend="gloo") for r in everyone]
    own_pp = [dist.new_group(ranks=[r], backend="gloo") for r in everyone]
    return CacheGroups(tp=tp, attn_tp=attn_tp, attn_cp=own[rank], pp=own_pp[rank])


# ---- observation -------------------------------------------------------------------------


class AllReduceSpy:
    """Records SGLang's all-reduces while installed (delegates every call unchanged): the
    group's size, the op, and this rank's tensor before and after."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._original = None

    def __enter__(self) -> AllReduceSpy:
        self._original = original = dist.all_reduce

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            before = tensor.tolist()
            work = original(tensor, op=op, group=group, async_op=async_op)
            self.calls.append({"group_size": dist.get_world_size(group=group),
                               "op": str(op), "before": before, "after": tensor.tolist()})
            return work

        dist.all_reduce = all_reduce
        torch.distributed.all_reduce = all_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original
        torch.distributed.all_reduce = self._original


def _service_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "dsa-async-sglang" and t.is_alive()]


def _own_ledger_entries() -> list[dict[str, Any]]:
    """This process's reservations in the machine-wide ledger (``$DSA_ASYNC_LEDGER``, which the
    test points at a directory of the two ranks' own; the other rank's come and go with it)."""
    from dsa_async.host_memory.ledger import HostLedger, default_ledger_directory

    directory = default_ledger_directory()
    if not directory.exists():
        return []
    return [e.to_json() for e in HostLedger(directory).peek() if e.pid == os.getpid()]


# ---- scenarios ---------------------------------------------------------------------------


class Worker:
    def __init__(self, rank: int, world_size: int, workdir: Path) -> None:
        self.rank = rank
        self.world_size = world_size
        self.workdir = workdir
        self.groups = _groups(rank, world_size)
        self.builds = 0

    def _settings(self, **overrides: Any) -> DsaHiCacheSettings:
        fields = dict(num_layers=3, mem_layout="layer_first", io_backend="direct", env=OPT_IN,
                      extra_server_args={"tp_size": self.world_size})
        fields.update(overrides)
        return DsaHiCacheSettings(**fields)

    def _build(self, **overrides: Any):
        self.builds += 1
        return build_dsa_hicache(self._settings(**overrides),
                                 self.workdir / f"rank{self.rank}-build{self.builds}",
                                 self.groups)

    def round_trip(self, slow_rank: int, delay_s: float, seed: int) -> dict[str, Any]:
        """Build with the plug-in; write through, evict, scrub, load back, compare.

        ``slow_rank``'s service sleeps ``delay_s`` before each device-to-host copy (the
        service's ``fault_hook``), so the other rank's write ack is ready first and waits for
        SGLang's all-reduce (MIN over the TP group) to let it drain."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        from dsa_async.integrations.sglang import strategy as plugin_strategy
        from dsa_async.integrations.sglang.engine import ServiceTransferEngine
        from dsa_async.integrations.sglang.strategy import DsaAsyncStrategy
        from dsa_async.kinds import Direction

        def slow_backups(batch, first_layer) -> None:  # noqa: ARG001 - FaultHook signature
            if batch.direction is Direction.D2H:
                time.sleep(delay_s)

        if self.rank == slow_rank:
            plugin_strategy.SERVICE_OPTIONS["fault_hook"] = slow_backups
        try:
            cache = self._build()
        finally:
            plugin_strategy.SERVICE_OPTIONS.pop("fault_hook", None)
        try:
            engine = cache.controller.l2_transfer_engine
            service = engine.service
            stats = service.call_threadsafe(service.statistics).result(30)
            kv_host = cache.host_pool_group.get_pool(PoolName.KV)
            indexer_host = cache.host_pool_group.get_pool(PoolName.INDEXER)
            facts = {
                "strategy": type(cache.selected_strategy).__name__,
                "is_plugin_strategy": isinstance(cache.selected_strategy, DsaAsyncStrategy),
                "engine_is_service": isinstance(engine, ServiceTransferEngine),
                "tree_tp_world_size": cache.tree_cache.tp_world_size,
                "tp_cache_group_size": dist.get_world_size(group=cache.cache_init_params
                                                           .tp_cache_group),
                "tp_cache_group_rank": dist.get_rank(group=cache.cache_init_params.tp_cache_group),
                "service_capacity_pages": stats.capacity_pages,
                "kv_host_pages": kv_host.page_num,
                "kv_host_tokens": kv_host.size,
                "indexer_host_pages": indexer_host.indexer_page_num,
                # the probes the start-failure scenario relies on, while a service runs
                "service_threads_while_running": _service_threads(),
                "ledger_entries_while_running": _own_ledger_entries(),
            }

            tokens = cache.tokens(start=5000, num_pages=3)
            _device, seeded = cache.insert(tokens, seed=seed + self.rank)
            with AllReduceSpy() as spy:
                write_steps = cache.pump(timeout_s=60)
            facts["write_steps"] = write_steps
            facts["write_all_reduces"] = spy.calls
            facts["evicted_tokens"] = cache.evict_device(len(tokens))
            cache.pump(timeout_s=60)
            cache.scrub_device()
            load = cache.load_back(tokens)
            got = cache.read_device_bytes(load.device_indices)
            with AllReduceSpy() as spy:
                cache.pump(timeout_s=60)
            cache.finish(load)
            facts["load_all_reduces"] = spy.calls
            facts["loaded_tokens"] = load.loaded_tokens
            facts["bytes_equal"] = got.equal(seeded)
            facts["seeded_nonzero"] = bool(any(layer.any() for layer in seeded.kv))
        finally:
            cache.close()
        facts["service_threads_after_close"] = _service_threads()
        facts["ledger_entries_after_close"] = _own_ledger_entries()
        return facts

    def mismatch(self, ratios: list[float]) -> dict[str, Any]:
        """Build with a different --hicache-ratio per rank; report how the start failed."""
        outcome: dict[str, Any] = {}
        try:
            cache = self._build(hicache_ratio=ratios[self.rank])
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.update(raised=True, error_type=type(exc).__name__, error=str(exc),
                           error_module=type(exc).__module__)
        else:
            outcome.update(raised=False,
                           kv_host_pages=cache.host_pool_group.anchor_entry.host_pool.page_num)
            cache.close()
        outcome["service_threads"] = _service_threads()
        outcome["ledger_entries"] = _own_ledger_entries()
        return outcome


    def one_rank_refused(self, refused_rank: int) -> dict[str, Any]:
        """Build where ``refused_rank``'s host budget cannot hold the pool (a reserve larger
        than any machine); report how the start ended on this rank."""
        from dsa_async.integrations.sglang import strategy

        options = {"config": {"reserve_bytes": 1 << 60}} if self.rank == refused_rank else {}
        saved = dict(strategy.SERVICE_OPTIONS)
        strategy.SERVICE_OPTIONS.clear()
        strategy.SERVICE_OPTIONS.update(options)
        try:
            return self.mismatch(ratios=[2.0, 2.0])
        finally:
            strategy.SERVICE_OPTIONS.clear()
            strategy.SERVICE_OPTIONS.update(saved)


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    store_file, workdir = sys.argv[3], Path(sys.argv[4])
    load_plugins_opted_in()
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    worker = Worker(rank, world_size, workdir)
    REPLY.write(json.dumps({"ok": True, "result": {"ready": rank}}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        command = request.pop("cmd")
        if command == "exit":
            break
        try:
            result = getattr(worker, command)(**request)
            reply = {"ok": True, "result": result}
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            reply = {"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                     "traceback": traceback.format_exc()}
        REPLY.write(json.dumps(reply, default=repr) + "\n")
    dist.destroy_process_group()
    # Every cache was closed by its command. The interpreter's own teardown of SGLang's modules
    # takes many seconds here and does nothing a worker needs: end the process now.
    sys.stderr.flush()
    REPLY.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
