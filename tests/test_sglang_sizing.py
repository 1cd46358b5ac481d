"""The SGLang plug-in's budget advice: the largest --hicache-size / --hicache-ratio it names fit
the budget by SGLang 0.5.23's own sizing rule, and the next value up does not (pure arithmetic;
the same rule runs through SGLang's real build in tests/integration/sglang)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.errors import HostBudgetExceeded
from dsa_async.host_memory.ledger import LedgerEntry
from dsa_async.host_memory.plan import HOST_POOL_SETTING
from dsa_async.integrations.sglang.sizing import HostPoolSizing, RankPeers, in_sglang_terms


def _sglang_service_pages(sizing: HostPoolSizing, *, size_gb=0, ratio=0.0) -> int:
    """SGLang's rule written out (pool_host/base.py): KV tokens from the size or the ratio, a
    padding page, and the indexer's page more; that is the service's page count."""
    if size_gb > 0:
        tokens = int(size_gb * 1e9 // sizing.kv_bytes_per_token)
    else:
        tokens = int(sizing.device_tokens * ratio)
    page_num = tokens // sizing.page_tokens + 1
    return page_num + 1


sizings = st.builds(
    HostPoolSizing,
    kv_bytes_per_token=st.sampled_from([656 * 61, 1152 * 61, 656 * 62, 1152 * 2, 656 * 3]),
    page_tokens=st.just(64),
    device_tokens=st.integers(64, 10**7),
    hicache_size_gb=st.sampled_from([0, 8]))


@settings(max_examples=300, deadline=None)
@given(sizing=sizings, max_pages=st.integers(1, 4 * 10**6))
def test_the_named_values_fit_and_the_next_ones_do_not(sizing, max_pages):
    size_gb = sizing.largest_size_gb(max_pages)
    if size_gb is None:
        assert _sglang_service_pages(sizing, size_gb=1) > max_pages
    else:
        assert _sglang_service_pages(sizing, size_gb=size_gb) <= max_pages
        assert _sglang_service_pages(sizing, size_gb=size_gb + 1) > max_pages
    ratio = sizing.largest_ratio(max_pages)
    if ratio is None:
        assert _sglang_service_pages(sizing, ratio=0.01) > max_pages
    else:
        assert float(f"{ratio:.2f}") == ratio  # in hundredths, as named
        assert _sglang_service_pages(sizing, ratio=ratio) <= max_pages
        assert _sglang_service_pages(sizing, ratio=round(ratio + 0.01, 2)) > max_pages


def _refusal(max_pages):
    return HostBudgetExceeded(
        f"host pool refused\n  largest that fits: {max_pages} pages = 9.99 GB\n"
        f"  to fix: lower {HOST_POOL_SETTING} to <= 9.99 GB (9,990,000,000 B), or use auto, or "
        f"raise the container's memory limit", max_pages_that_fit=max_pages)


def test_the_refusal_names_the_setting_in_use_first():
    by_size = HostPoolSizing(kv_bytes_per_token=1152 * 61, page_tokens=64,
                             device_tokens=640_000, hicache_size_gb=100)
    message = str(in_sglang_terms(_refusal(100_000), by_size))
    fix = message.splitlines()[-1]
    size_gb = by_size.largest_size_gb(100_000)
    assert fix.startswith(f"  to fix: lower SGLang's --hicache-size to <= {size_gb} (GB per rank")
    assert "set --hicache-size 0 and --hicache-ratio <= " in fix
    assert fix.endswith(", or raise the container's memory limit")
    assert "9.99 GB" not in fix and "use auto" not in fix and "--host-pool-gb" not in message
    by_ratio = HostPoolSizing(kv_bytes_per_token=1152 * 61, page_tokens=64,
                              device_tokens=640_000, hicache_size_gb=0)
    fix = str(in_sglang_terms(_refusal(100_000), by_ratio)).splitlines()[-1]
    assert fix.startswith("  to fix: lower SGLang's --hicache-ratio to <= ")
    assert f"set --hicache-size <= {size_gb} (GB per rank" in fix


def test_when_nothing_fits_no_value_is_named():
    sizing = HostPoolSizing(kv_bytes_per_token=1152 * 61, page_tokens=64,
                            device_tokens=640_000, hicache_size_gb=0)
    fix = str(in_sglang_terms(_refusal(1), sizing)).splitlines()[-1]
    assert fix == "  to fix: raise the container's memory limit"


def _entry(pid: int, reserved_bytes: int, allocated_bytes: int, start_ticks: int = 1
           ) -> LedgerEntry:
    return LedgerEntry(entry_id=f"e{pid}", pid=pid, start_time_ticks=start_ticks,
                       label="kv+indexer",
                       reserved_bytes=reserved_bytes, allocated_bytes=allocated_bytes)


@settings(max_examples=200, deadline=None)
@given(ranks=st.integers(2, 8), data=st.data())
def test_with_several_ranks_on_a_host_every_rank_fits_the_value_named(ranks, data):
    # The refused rank found what its server's earlier ranks had left; the flags size every
    # rank alike and the refusal releases them all, so the value named must fit all at once.
    page_bytes = 515_328
    host_bytes = data.draw(st.integers(page_bytes, 10**12))  # free for the server at its start
    request_bytes = data.draw(st.integers(page_bytes, 10**12))
    earlier = data.draw(st.integers(0, ranks - 1))  # ranks that reserved before the refusal
    held = [min(request_bytes, host_bytes // ranks) for _ in range(earlier)]
    # memory other processes took meanwhile: it may leave less free than the peers reserved
    used_elsewhere = data.draw(st.integers(0, host_bytes))
    siblings = [_entry(1000 + i, b, data.draw(st.sampled_from([0, b]))) for i, b in enumerate(held)]
    unrelated = _entry(99, 7 * page_bytes, 0)  # another process's pool: not this server's
    same_pid_elsewhere = _entry(2000, 9 * page_bytes, 0, start_ticks=5)  # not the remote rank
    available_bytes = host_bytes - used_elsewhere - sum(held)  # unfloored, as refusals carry it
    refusal = HostBudgetExceeded(
        "refused", max_pages_that_fit=max(0, available_bytes) // page_bytes,
        available_bytes=available_bytes, bytes_per_page=page_bytes,
        reservations=(*siblings, unrelated, same_pid_elsewhere))
    processes = {(os.getpid(), 1), *((e.pid, e.start_time_ticks) for e in siblings), (2000, 1)}
    pages, counted = RankPeers(frozenset(processes), ranks).per_rank_max_pages(refusal)
    assert counted == ranks
    truly_free = host_bytes - used_elsewhere  # once every rank of the server let go
    assert ranks * pages * page_bytes <= truly_free < ranks * (pages + 1) * page_bytes


def test_the_refusal_says_the_values_hold_for_every_rank_on_the_host():
    sizing = HostPoolSizing(kv_bytes_per_token=1152 * 61, page_tokens=64,
                            device_tokens=640_000, hicache_size_gb=200)
    page_bytes = 515_328 + 64 * 1152 * 61
    refusal = HostBudgetExceeded(
        f"host pool refused\n  to fix: lower {HOST_POOL_SETTING} to <= 49.00 GB (49,000,000,000 "
        f"B), or use auto, or stop the processes holding the other reservations",
        max_pages_that_fit=100_000, available_bytes=100_000 * page_bytes,
        bytes_per_page=page_bytes, reservations=(_entry(1001, 60_000 * page_bytes, 0),))
    alone = str(in_sglang_terms(refusal, sizing)).splitlines()[-1]
    shared = str(in_sglang_terms(refusal, sizing, RankPeers(frozenset({(1001, 1)}), 8))).splitlines()[-1]
    assert "ranks of this server" not in alone
    assert shared.startswith("  to fix: with 8 ranks of this server on this host, lower SGLang's "
                             f"--hicache-size to <= {sizing.largest_size_gb(20_000)} (GB")
