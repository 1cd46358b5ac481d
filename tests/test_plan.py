import dataclasses
import re

import pytest
from fake_roots import GIB, MIB, Level, make_root, write_cgroup_v1, write_cgroup_v2, write_meminfo
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.config import PoolSize
from dsa_async.errors import ConfigError, HostBudgetExceeded
from dsa_async.geometry import KvDtype, dsa_indexer, mla_kv, model_pools
from dsa_async.host_memory.budget import BudgetLimiter, BudgetSnapshot, probe_host_budget
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.host_memory.plan import (
    budget_exceeded_message,
    format_bytes,
    human_bytes,
    plan_pools,
    reserve_host_pools,
)

INDEXER = dsa_indexer()
GB = 10**9


@pytest.fixture
def root(tmp_path):
    return make_root(tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)


@pytest.fixture
def budget(root):
    return probe_host_budget(root, reserve_bytes=0, read_memlock=lambda: 8 * MIB)


STATIC_BUDGET = BudgetSnapshot(
    root="/fake",
    mem_total_bytes=2**46,
    mem_available_bytes=2**46,
    levels=(),
    hugepages=False,
    hugepages_free_bytes=None,
    memlock_limit_bytes=None,
    reserve_bytes=0,
    limit_bytes=2**46,
    available_before_reserve_bytes=2**46,
    available_bytes=2**46,
    limiter=BudgetLimiter.MEM_AVAILABLE,
    limiter_cgroup_path=None,
    limiter_level=None,
)


def with_available(budget, available_bytes):
    return dataclasses.replace(budget, available_bytes=available_bytes)


# --- arithmetic ------------------------------------------------------------------------------


def test_indexer_plan_matches_the_deepseek_v32_figures(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=GB)
    (pool,) = plan.pools
    assert (pool.bytes_per_token_per_layer, pool.bytes_per_page_per_layer, pool.bytes_per_page) == (
        132,
        8448,
        515_328,
    )
    assert plan.num_pages == pool.num_pages == GB // 515_328 == 1940
    assert plan.requested_bytes == pool.requested_bytes == 1940 * 515_328
    assert plan.asked_bytes == GB and not plan.auto
    assert plan.fits and plan.available_bytes == 48 * GIB


def test_kv_pool_shares_the_indexer_page_count(budget):
    pools = model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8)
    plan = plan_pools(pools, budget_snapshot=budget, requested_bytes=100 * GB)
    assert plan.bytes_per_shared_page == 515_328 + 64 * 656 * 61 == 3_076_352
    assert [p.num_pages for p in plan.pools] == [32_506, 32_506]
    assert plan.requested_bytes == sum(p.requested_bytes for p in plan.pools) == 32_506 * 3_076_352


def test_draft_layer_adds_a_layer_to_every_pool(budget):
    plan = plan_pools(
        model_pools("deepseek-v3.2", kv_dtype=KvDtype.BF16, with_draft=True), budget_snapshot=budget
    )
    assert [p.geometry.num_layers for p in plan.pools] == [62, 62]
    assert plan.bytes_per_shared_page == 8448 * 62 + 64 * 1152 * 62


def test_explicit_page_count(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, num_pages=10)
    assert plan.requested_bytes == 10 * 515_328 and plan.asked_bytes is None and not plan.auto


def test_auto_takes_the_largest_page_count_that_fits(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, pending_bytes=GIB)
    assert plan.auto and plan.fits
    assert plan.num_pages == plan.max_pages_that_fit == 47 * GIB // 515_328
    assert (plan.num_pages + 1) * 515_328 > plan.available_bytes


def test_auto_is_capped_by_max_pages(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, max_pages=100)
    assert plan.num_pages == 100 and plan.fits and plan.max_pages_that_fit > 100


def test_auto_refuses_when_not_one_page_fits(budget):
    plan = plan_pools([INDEXER], budget_snapshot=with_available(budget, 1000))
    assert plan.num_pages == 1 and not plan.fits and plan.max_pages_that_fit == 0
    message = budget_exceeded_message(plan)
    assert "not even one page (515.33 kB (515,328 B)) fits" in message
    assert "use auto" not in message


def test_pending_reservations_and_ranks_shrink_what_fits(budget):
    plan = plan_pools(
        [INDEXER],
        budget_snapshot=budget,
        requested_bytes=11 * GB,
        pending_bytes=8 * GIB,
        ranks_per_host=4,
    )
    assert plan.available_bytes == 40 * GIB
    assert plan.total_requested_bytes == 4 * plan.requested_bytes
    assert not plan.fits
    assert plan.max_pages_that_fit == 40 * GIB // (4 * 515_328)


def test_size_below_one_page_names_the_smallest_size(budget):
    with pytest.raises(
        ConfigError,
        match=r"no whole page.*smallest size that holds one page of indexer\+kv is 3.08 MB \(3,076,352",
    ):
        plan_pools(
            model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8),
            budget_snapshot=budget,
            requested_bytes=3_000_000,
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(requested_bytes=GB, num_pages=1), "not both"),
        (dict(requested_bytes=0), "requested_bytes"),
        (dict(num_pages=-1), "num_pages"),
        (dict(max_pages=0), "max_pages"),
        (dict(ranks_per_host=0), "ranks_per_host"),
        (dict(pending_bytes=-1), "pending_bytes"),
        (dict(pending_bytes=1.5), "pending_bytes must be an int"),
        (dict(pending_bytes=float("nan")), "pending_bytes must be an int"),
        (dict(pending_bytes=True), "pending_bytes must be an int"),
        (dict(pending_bytes=None), "pending_bytes must be an int"),
        (dict(max_pages="x"), "max_pages"),
        (dict(num_pages=3, max_pages=1), "max_pages caps auto sizing"),
        (dict(requested_bytes=GB, max_pages=1), "max_pages caps auto sizing"),
        (dict(budget_snapshot=None), "budget_snapshot must be a BudgetSnapshot"),
        (dict(pools=None), "pools must be a non-empty sequence"),
        (dict(pools=5), "pools must be a non-empty sequence"),
        (dict(pools="indexer"), "pools must be a non-empty sequence"),
    ],
)
def test_bad_sizing_arguments_are_config_errors(budget, kwargs, match):
    kwargs = {"pools": [INDEXER], "budget_snapshot": budget, **kwargs}
    with pytest.raises(ConfigError, match=match):
        plan_pools(kwargs.pop("pools"), **kwargs)


def test_one_pool_may_be_given_alone(budget):
    assert plan_pools(INDEXER, budget_snapshot=budget, num_pages=2) == plan_pools(
        [INDEXER], budget_snapshot=budget, num_pages=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_pages=0), "num_pages"),
        (dict(num_pages=3, max_pages=1), "max_pages caps auto sizing"),
        (dict(reserve_bytes=-1), "reserve_bytes"),
        (dict(hugepages="yes"), "hugepages"),
        (dict(root=5), "root must be a directory path"),
        (dict(pools=None), "pools must be a non-empty sequence"),
        (dict(ledger="ledger-dir"), "ledger must be a HostLedger"),
        (dict(label=5), "label must be a str"),
    ],
)
def test_a_refused_reservation_argument_leaves_no_ledger_behind(root, tmp_path, kwargs, match):
    ledger_dir = tmp_path / "ledger"
    kwargs = {"pools": [INDEXER], "root": root, "ledger": HostLedger(ledger_dir), **kwargs}
    with pytest.raises(ConfigError, match=match):
        reserve_host_pools(kwargs.pop("pools"), **kwargs)
    assert not ledger_dir.exists()  # refused before the ledger was made or locked


def test_pools_must_share_a_page_size_and_have_distinct_names(budget):
    with pytest.raises(ConfigError, match="page_size_tokens"):
        plan_pools([INDEXER, mla_kv(page_size_tokens=32)], budget_snapshot=budget)
    with pytest.raises(ConfigError, match="distinct"):
        plan_pools([INDEXER, dsa_indexer()], budget_snapshot=budget)
    with pytest.raises(ConfigError, match="non-empty"):
        plan_pools([], budget_snapshot=budget)


@settings(max_examples=200, deadline=None)
@given(
    available_bytes=st.integers(0, 2**44),
    asked_bytes=st.integers(3_076_352, 2**45),
    ranks=st.integers(1, 8),
)
def test_rounding_and_fitting_are_consistent(available_bytes, asked_bytes, ranks):
    snapshot = with_available(STATIC_BUDGET, available_bytes)
    pools = model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8)
    plan = plan_pools(pools, budget_snapshot=snapshot, requested_bytes=asked_bytes, ranks_per_host=ranks)
    assert plan.requested_bytes <= asked_bytes < plan.requested_bytes + plan.bytes_per_shared_page
    assert plan.fits == (plan.num_pages <= plan.max_pages_that_fit)
    auto = plan_pools(pools, budget_snapshot=snapshot, ranks_per_host=ranks)
    assert auto.fits == (auto.max_pages_that_fit > 0)
    assert (auto.max_pages_that_fit + 1) * auto.bytes_per_shared_page * ranks > available_bytes


# --- the refusal -----------------------------------------------------------------------------


def test_refusal_names_requested_available_total_arithmetic_largest_fit_and_setting(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=100 * GB, pending_bytes=2 * GIB)
    message = budget_exceeded_message(plan)
    assert "Not enough host memory" not in message
    assert (
        f"requested: {format_bytes(plan.requested_bytes)} = {plan.num_pages:,} pages x 515,328 B"
        in message
    )
    assert "asked 100.00 GB (100,000,000,000 B), rounded down to whole pages" in message
    assert INDEXER.arithmetic(plan.num_pages) in message
    assert f"available: {format_bytes(46 * GIB)}" in message
    assert f"total: {format_bytes(64 * GIB)} (MemTotal)" in message
    assert f"limited by: MemAvailable {format_bytes(48 * GIB)}" in message
    assert (
        f"largest that fits: {plan.max_pages_that_fit:,} pages = {format_bytes(plan.max_bytes_that_fit)}"
        in message
    )
    assert "lower --host-pool-gb / ServiceConfig.host_pool to <= 49.39 GB (49,391,612,160 B)" in message
    assert "use auto" in message
    assert "RLIMIT_MEMLOCK is 8.39 MB (8,388,608 B) (information only" in message
    assert "other reservations: 2.15 GB (2,147,483,648 B) not yet allocated" in message


def test_refusal_names_the_limiting_cgroup_with_its_limit_and_working_set(root):
    write_cgroup_v2(
        root, "/pod/ctr", {"/pod": Level(4 * GIB, 3 * GIB, GIB), "/pod/ctr": Level(None, GIB)}
    )
    budget = probe_host_budget(root, reserve_bytes=0)
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=5 * GB)
    message = budget_exceeded_message(plan)
    assert (
        "limited by: cgroup /pod (v2): memory.max 4.29 GB (4,294,967,296 B), working set 2.15 GB"
        in message
    )
    assert f"total: {format_bytes(4 * GIB)} (memory limit of cgroup /pod: memory.max)" in message
    assert "raise the container's memory limit (memory.max of cgroup /pod)" in message


def _v1_memsw(root, memsw_usage_bytes):
    """v1, memory.limit 8 GiB, usage 6 GiB, inactive file 1/4 GiB: memory headroom 2.25 GiB;
    memory + swap limit 10 GiB."""
    write_cgroup_v1(root, "/docker/abc", {"/docker/abc": Level(8 * GIB, 6 * GIB, GIB // 4)})
    level_dir = root / "sys/fs/cgroup/memory/docker/abc"
    (level_dir / "memory.memsw.limit_in_bytes").write_text(f"{10 * GIB}\n")
    (level_dir / "memory.memsw.usage_in_bytes").write_text(f"{memsw_usage_bytes}\n")


def _v2_high(root, high):
    """v2, memory.max 8 GiB, usage 3 GiB, inactive file 1/4 GiB, memory.high ``high``."""
    write_cgroup_v2(root, "/svc", {"/svc": Level(8 * GIB, 3 * GIB, GIB // 4)})
    (root / "sys/fs/cgroup/svc/memory.high").write_text(f"{high}\n")


#: tree, (the file that binds, its limit, usage, working set = usage - 1/4 GiB)
BINDING_CASES = {
    "v1-memsw-binds": (lambda root: _v1_memsw(root, 19 * GIB // 2),
                       ("memory.memsw.limit_in_bytes", 10 * GIB, 19 * GIB // 2, 37 * GIB // 4)),
    "v1-memory-binds": (lambda root: _v1_memsw(root, 7 * GIB),
                        ("memory.limit_in_bytes", 8 * GIB, 6 * GIB, 23 * GIB // 4)),
    "v2-high-binds": (lambda root: _v2_high(root, 4 * GIB),
                      ("memory.high", 4 * GIB, 3 * GIB, 11 * GIB // 4)),
    "v2-max-binds": (lambda root: _v2_high(root, "max"),
                     ("memory.max", 8 * GIB, 3 * GIB, 11 * GIB // 4)),
}
_EXACT = r"[^()]*\(([\d,]+) B\)"
_HUMAN = r"(\d+(?:\.\d+)?) (TB|GB|MB|kB|B)"
_UNIT = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "kB": 10**3, "B": 1}


def _exact(text):
    return int(text.replace(",", ""))


def _human(number, unit):
    """(value, rounding slack) of a human_bytes figure."""
    return float(number) * _UNIT[unit], 0.005 * _UNIT[unit]


@pytest.mark.parametrize("case", BINDING_CASES)
def test_refusal_prints_the_figures_of_the_file_that_binds_and_they_add_up(root, case):
    """The limiter line shows the binding file's own limit, usage and working set (memory +
    swap when memory.memsw binds), so limit - working set = headroom, usage - inactive file =
    working set, and available = headroom - reserve - other reservations, for the numbers
    printed."""
    build, (limit_file, limit, usage, working_set) = BINDING_CASES[case]
    build(root)
    budget = probe_host_budget(root, reserve_bytes=GIB // 8)
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=100 * GB,
                      pending_bytes=GIB // 16)
    message = budget_exceeded_message(plan)
    limited = re.search(
        rf"limited by: cgroup \S+ \(v\d\): (\S+) {_EXACT}, (?:memory \+ swap )?working set "
        rf"{_EXACT} \(usage {_HUMAN} - inactive file {_HUMAN}\), headroom {_EXACT}\n", message)
    assert limited, message
    got_file, got_limit, got_ws, usage_n, usage_u, inactive_n, inactive_u, headroom = \
        limited.groups()
    assert got_file == limit_file and f"limit ({limit_file} of cgroup" in message
    memsw = limit_file == "memory.memsw.limit_in_bytes"
    assert ("memory + swap working set" in message) is memsw
    total_file = "memory.limit_in_bytes" if case.startswith("v1") else limit_file
    total = 4 * GIB if case == "v2-high-binds" else 8 * GIB  # memory + swap is never the total
    assert f"total: {format_bytes(total)} (memory limit of cgroup " in message
    assert f": {total_file})\n" in message
    assert (_exact(got_limit), _exact(got_ws)) == (limit, working_set)
    assert _exact(got_limit) - _exact(got_ws) == _exact(headroom)
    (usage_b, usage_slack), (inactive_b, inactive_slack) = (_human(usage_n, usage_u),
                                                            _human(inactive_n, inactive_u))
    assert abs(usage_b - usage) <= usage_slack
    assert abs(usage_b - inactive_b - _exact(got_ws)) <= usage_slack + inactive_slack

    available = re.search(
        rf"available: {_EXACT} = min\(MemAvailable {_HUMAN}, cgroup \S+ headroom {_HUMAN}\) "
        rf"- reserve {_HUMAN} - other reservations {_HUMAN}\n", message)
    assert available, message
    got_available, *figures = available.groups()
    (mem_available, _), (cgroup_headroom, slack), (reserve, _), (pending, _) = (
        _human(*figures[i:i + 2]) for i in range(0, 8, 2))
    assert abs(cgroup_headroom - _exact(headroom)) <= slack < mem_available - cgroup_headroom
    assert _exact(got_available) == _exact(headroom) - GIB // 8 - GIB // 16
    assert abs(_exact(got_available) - (cgroup_headroom - reserve - pending)) <= 3 * slack


def test_refusal_names_free_hugepages(tmp_path):
    root = tmp_path / "r"
    write_meminfo(
        root, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB, hugepages_total=4, hugepages_free=4
    )
    budget = probe_host_budget(root, reserve_bytes=0, hugepages=True)
    message = budget_exceeded_message(plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=GB))
    assert "limited by: free hugepages 8.39 MB (8,388,608 B)" in message
    assert "vm.nr_hugepages" in message


def test_a_hugepage_backed_pool_limited_by_memavailable_names_memavailable(tmp_path):
    """The refusal names the figure that binds (``BudgetSnapshot.limiter``), not hugepages
    because the arena would be hugepage-backed: with plenty of free hugepages and little
    MemAvailable, more hugepages would not help."""
    root = tmp_path / "r"
    write_meminfo(root, mem_total_bytes=4 * GIB, mem_available_bytes=200 * MIB,
                  hugepages_total=1000, hugepages_free=1000)
    budget = probe_host_budget(root, reserve_bytes=0, hugepages=True)
    assert budget.limiter is BudgetLimiter.MEM_AVAILABLE
    message = budget_exceeded_message(plan_pools([INDEXER], budget_snapshot=budget,
                                                 requested_bytes=GB))
    assert f"limited by: MemAvailable {format_bytes(200 * MIB)}" in message
    assert "vm.nr_hugepages" not in message and "free host memory" in message


@pytest.mark.parametrize("available_bytes", [515_328, 6 * MIB, 9_999_999, 10**7, 3 * GIB])
def test_the_suggested_setting_can_be_given_as_is_and_fits(available_bytes):
    """The "to fix" value for --host-pool-gb is one the flag takes (GB, never a byte count),
    and asking for exactly it fits."""
    from dsa_async.cli.plan import host_pool_bytes

    budget = with_available(STATIC_BUDGET, available_bytes)
    message = budget_exceeded_message(plan_pools([INDEXER], budget_snapshot=budget,
                                                 requested_bytes=10 * GB))
    suggested = re.search(r"to <= ([0-9.]+) GB \(", message)
    assert suggested, message
    asked = host_pool_bytes(suggested.group(1))
    assert plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=asked).fits


@pytest.mark.parametrize("pool", [PoolSize(pages=1000), PoolSize.auto()], ids=["pages", "auto"])
def test_a_refusal_the_reserve_causes_names_the_reserve_and_a_value_that_fits(root, pool):
    """MemAvailable is 48 GiB and the reserve takes all of it: lowering the reserve is the
    fix (with a value that fits when given as is), and "use auto" is not (nothing fits)."""
    from dsa_async.cli.numbers import reserve_bytes

    budget = probe_host_budget(root, reserve_bytes=48 * GIB, read_memlock=lambda: None)
    plan = plan_pools([INDEXER], budget_snapshot=budget, num_pages=pool.pages)
    assert not plan.fits and plan.max_pages_that_fit == 0
    message = budget_exceeded_message(plan)
    fix = message.split("to fix: ")[1].splitlines()[0]
    assert "use auto" not in fix, fix
    suggested = re.search(r"lower the reserve \(--reserve-gb / ServiceConfig.reserve_bytes, "
                          r"now 51.54 GB \(51,539,607,552 B\)\) to <= ([0-9.]+) GB \(", fix)
    assert suggested, fix
    lowered = probe_host_budget(root, reserve_bytes=reserve_bytes(suggested.group(1)),
                                read_memlock=lambda: None)
    assert plan_pools([INDEXER], budget_snapshot=lowered, num_pages=pool.pages).fits


def test_a_refusal_the_reserve_alone_cannot_fix_does_not_name_it(root):
    budget = probe_host_budget(root, reserve_bytes=GIB, read_memlock=lambda: None)
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=60 * GIB)
    assert not plan.fits
    assert "reserve" not in budget_exceeded_message(plan).split("to fix: ")[1]


def test_refusal_for_many_ranks_says_so(budget):
    plan = plan_pools([INDEXER], budget_snapshot=budget, requested_bytes=10 * GB, ranks_per_host=8)
    message = budget_exceeded_message(plan)
    assert f"x 8 ranks per host = {format_bytes(plan.total_requested_bytes)}" in message
    assert "per rank" in message and "fewer ranks per host" in message


# --- check-and-reserve -----------------------------------------------------------------------


def test_reserve_records_the_plan_in_the_ledger(root, tmp_path):
    ledger = HostLedger(tmp_path / "ledger")
    pools = model_pools("deepseek-v3.2", kv_dtype=KvDtype.FP8)
    plan, reservation = reserve_host_pools(pools, requested_bytes=10 * GB, root=root, ledger=ledger)
    with reservation:
        (entry,) = ledger.entries()
        assert entry.reserved_bytes == reservation.reserved_bytes == plan.requested_bytes
        assert entry.label == "indexer+kv"
        assert plan.budget.reserve_bytes == GIB
    assert ledger.entries() == ()


def test_refused_reservation_leaves_the_ledger_untouched(root, tmp_path):
    ledger = HostLedger(tmp_path / "ledger")
    with ledger.reserve(GIB, label="other") as other:
        with pytest.raises(
            HostBudgetExceeded, match=r"(?s)other reservations in .*ledger.json.*'other'"
        ):
            reserve_host_pools([INDEXER], requested_bytes=60 * GB, root=root, ledger=ledger)
        assert [e.entry_id for e in ledger.entries()] == [other.entry_id]


@pytest.mark.parametrize("size", [{"num_pages": 10**400}, {"requested_bytes": 10**400}])
def test_a_pool_of_any_size_is_refused_as_over_budget(root, tmp_path, size):
    """A pool far beyond any float (a Python int has no bound) is refused like any other
    over-budget pool, its size shown in scientific notation: the message is built without
    float overflow."""
    with pytest.raises(HostBudgetExceeded, match=r"requested: \d\.\d{3}e\+\d+ TB"):
        reserve_host_pools([INDEXER], root=root, ledger=HostLedger(tmp_path / "ledger"),
                           **size)
    assert human_bytes(-10**400) == "-1.000e+388 TB"


def test_reserve_auto_fits_what_is_left(root, tmp_path):
    ledger = HostLedger(tmp_path / "ledger")
    with ledger.reserve(8 * GIB, label="other"):
        plan, reservation = reserve_host_pools(
            [INDEXER], root=root, ledger=ledger, reserve_bytes=0, max_pages=10**9
        )
        with reservation:
            assert plan.auto and plan.num_pages == 40 * GIB // 515_328


@pytest.mark.parametrize("given", [dict(pages=3), dict(bytes=GB)])
def test_a_pool_size_with_a_cap_it_would_ignore_is_refused(given):
    with pytest.raises(ConfigError, match="PoolSize.max_pages caps auto sizing"):
        PoolSize(**given, max_pages=1)
    assert PoolSize(max_pages=1).is_auto


@pytest.mark.parametrize("form", [list, tuple, iter, lambda pools: (p for p in pools)])
def test_pools_may_be_any_iterable(root, tmp_path, form):
    plan, reservation = reserve_host_pools(form([INDEXER]), num_pages=2, root=root,
                                           ledger=HostLedger(tmp_path / "ledger"))
    try:
        assert plan.num_pages == 2 and [p.geometry for p in plan.pools] == [INDEXER]
    finally:
        reservation.release()
