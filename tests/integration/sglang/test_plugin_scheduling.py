"""How SGLang's scheduler-side calls meet the service: per-layer gating, the producer ring,
retraction, host slots reused under a load, and teardown. The plug-in is on and the cache is
built by SGLang's own code (the harness) in every test."""

from __future__ import annotations

import threading

import pytest
import torch

from dsa_async.errors import TransferFailedError
from dsa_async.front_door.service import ServiceState
from dsa_async.integrations.sglang import strategy
from dsa_async.kinds import Direction

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}
WAIT_S = 20
LAYERS = 3


def _gate_h2d_layer(monkeypatch, gated_layer: int) -> threading.Event:
    """The next service's loads stop before ``gated_layer`` until the returned event is set
    (the service's fault hook runs on a copy thread before each layer or layer group; other
    copy threads may go on with later layers meanwhile, which stay not ready)."""
    gate = threading.Event()

    def hook(batch, first_layer: int) -> None:
        if batch.direction is Direction.H2D and first_layer == gated_layer:
            assert gate.wait(WAIT_S), "the test never opened the gate"

    monkeypatch.setitem(strategy.SERVICE_OPTIONS, "fault_hook", hook)
    return gate


def _backed_up(cache, tokens, seed):
    _device, seeded = cache.insert(tokens, seed=seed)
    cache.pump()
    cache.evict_device(len(tokens))
    cache.pump()
    return seeded


def test_a_delayed_layer_holds_its_getter_and_the_next_layer_is_not_there_yet(
        dsa_hicache, monkeypatch):
    gate = _gate_h2d_layer(monkeypatch, gated_layer=1)
    cache = dsa_hicache(num_layers=LAYERS, mem_layout="layer_first", io_backend="direct",
                        env=OPT_IN)
    tokens = cache.tokens(start=2000, num_pages=2)
    seeded = _backed_up(cache, tokens, seed=3)
    cache.scrub_device()
    load = cache.load_back(tokens)
    layer0 = cache.kv_pool.get_key_buffer(0)  # layer 0 is copied before the gate
    rows0 = layer0.view(torch.uint8).view(layer0.shape[0], -1)[load.device_indices]
    assert torch.equal(rows0, seeded.kv[0])

    got: dict[str, torch.Tensor] = {}
    readers = [threading.Thread(target=lambda i=i: got.setdefault(
        f"l{i}", cache.kv_pool.get_key_buffer(i))) for i in (1, 2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(0.5)
    # Layer 2's bytes may land meanwhile (the CPU engine copies layers on several threads),
    # but a layer is ready only once every layer before it is: neither getter returns yet.
    assert readers[0].is_alive(), "the getter of the gated layer returned before its copy"
    assert readers[1].is_alive(), "layer 2's getter returned before layer 1 was ready"
    assert not got
    gate.set()
    for reader in readers:
        reader.join(WAIT_S)
        assert not reader.is_alive()
    assert cache.read_device_bytes(load.device_indices).equal(seeded)
    cache.pump()
    cache.finish(load)


def test_three_loads_in_flight_use_the_three_producer_slots(dsa_hicache, monkeypatch):
    gate = _gate_h2d_layer(monkeypatch, gated_layer=0)
    cache = dsa_hicache(num_layers=LAYERS, mem_layout="layer_first", io_backend="direct",
                        env=OPT_IN)
    sequences = [cache.tokens(start=10_000 * (i + 1), num_pages=2) for i in range(3)]
    seeded = [_backed_up(cache, tokens, seed=10 + i) for i, tokens in enumerate(sequences)]
    cache.scrub_device()
    loads = [cache.load_back(tokens) for tokens in sequences]  # all three queued behind the gate
    counter = cache.controller.layer_done_counter
    assert sorted(load.consumer_index for load in loads) == [0, 1, 2]
    assert not any(slot.finish_event.query() for slot in counter.events)
    assert not cache.tree_cache.has_free_load_back_slot()  # SGLang's own ring check
    gate.set()
    for load, expected in zip(loads, seeded, strict=True):
        cache.worker.set_hicache_consumer(load.consumer_index)
        assert cache.read_device_bytes(load.device_indices).equal(expected)
    cache.pump()
    assert all(slot.finish_event.query() for slot in counter.events)
    for load in loads:
        cache.finish(load)


def test_retraction_backs_up_and_restores_a_running_request(dsa_hicache):
    cache = dsa_hicache(num_layers=LAYERS, mem_layout="page_first_direct", io_backend="direct",
                        env=OPT_IN)
    tokens = cache.tokens(start=500, num_pages=2)
    req = cache.new_req(tokens)
    device = cache.allocator.alloc(len(tokens))
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(tokens)] = device
    seeded = cache.seed_device_bytes(device, seed=21)
    backup = cache.tree_cache.backup_kv_cache(req)  # SGLang waits for it (synchronize)
    assert backup is not None
    cache.scrub_device()
    moved = cache.allocator.alloc(len(tokens))  # restored into other device slots
    cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :len(tokens)] = moved
    cache.tree_cache.restore_kv_cache(req, backup)
    restored = cache.read_device_bytes(moved)
    # The retraction path backs up seqlen - 1 tokens padded to whole pages: every page.
    assert restored.equal(seeded)


def test_host_slots_freed_and_reused_while_a_load_reads_them(dsa_hicache, monkeypatch):
    gate = _gate_h2d_layer(monkeypatch, gated_layer=0)
    cache = dsa_hicache(num_layers=LAYERS, mem_layout="layer_first", io_backend="direct",
                        env=OPT_IN)
    controller, host = cache.controller, cache.controller.mem_pool_host
    engine = controller.l2_transfer_engine
    loaded_from: list[torch.Tensor] = []
    submit = engine.submit_host_to_device

    def noting_host_slots(transfers, **kwargs):  # observes the call, changes nothing
        loaded_from.append(transfers[0].host_indices.clone())
        return submit(transfers, **kwargs)

    monkeypatch.setattr(engine, "submit_host_to_device", noting_host_slots)
    tokens = cache.tokens(start=7000, num_pages=2)
    seeded = _backed_up(cache, tokens, seed=5)
    cache.scrub_device()
    load = cache.load_back(tokens)  # gated: its copy has not read the host slots yet
    (host_slots,) = loaded_from
    # SGLang's host allocator hands the same slots to a new backup while the load is queued.
    host.free(host_slots)
    everything_free = host.alloc(host.available_size())  # the freed slots among them
    assert everything_free is not None and bool(torch.isin(host_slots, everything_free).all())
    again = host_slots
    other = cache.allocator.alloc(len(tokens))
    cache.worker.set_hicache_consumer(-1)  # the seeding reads back through the getters
    newer = cache.seed_device_bytes(other, seed=6)
    cache.worker.set_hicache_consumer(load.consumer_index)
    from sglang.srt.managers.cache_controller import CacheOperation

    controller.write_queue.append(CacheOperation(again, other, node_id=-1))
    controller.start_writing()  # the backup into the reused slots: after the load read them
    gate.set()
    assert cache.read_device_bytes(load.device_indices).equal(seeded)  # the old bytes
    # This backup belongs to no tree node: its ack is taken here, not by writing_check.
    controller.ack_write_queue.pop().finish_event.synchronize()
    arena = engine.service.host_pool.arenas["kv"]
    for layer in range(LAYERS):
        host_rows = arena[layer].reshape(-1, cache.kv_row_bytes())  # one row per host token
        assert torch.equal(host_rows[again], newer.kv[layer])  # the new bytes, landed after
    cache.pump()
    cache.finish(load)


def test_releasing_sglangs_host_pools_stops_the_service(dsa_hicache):
    cache = dsa_hicache(num_layers=2, mem_layout="layer_first", io_backend="direct", env=OPT_IN)
    service = cache.controller.l2_transfer_engine.service
    assert service.state is ServiceState.RUNNING
    cache.close()
    assert service.state is ServiceState.CLOSED
    assert "dsa-async-sglang" not in {t.name for t in threading.enumerate()}


def test_a_failed_copy_is_fatal_and_loud_in_sglangs_own_ack_check(dsa_hicache, monkeypatch,
                                                                  caplog):
    # SGLang has no per-request abort on this path and all-reduces acks over the TP ranks: a
    # failed backup must stop the scheduler step that looks at it, not pass as done.
    def failing_backups(batch, first_layer: int) -> None:  # noqa: ARG001 - fault hook
        if batch.direction is Direction.D2H:
            raise OSError("injected device fault")

    monkeypatch.setitem(strategy.SERVICE_OPTIONS, "fault_hook", failing_backups)
    cache = dsa_hicache(num_layers=2, mem_layout="layer_first", io_backend="direct",
                        env=OPT_IN)
    tokens = cache.tokens(start=900, num_pages=1)
    cache.insert(tokens, seed=2)
    with pytest.raises(TransferFailedError, match="fatal") as failed:
        cache.pump()
    assert "injected device fault" in repr(failed.value.__cause__)
    assert any(r.levelname == "CRITICAL" and "fatal" in r.getMessage() for r in caplog.records)
