"""Host pool sizing, and the atomic check-and-reserve against the machine's budget.

Pools (indexer, MLA KV, draft) share one page table, so every pool gets the same page count and
one *shared page* costs the sum of the pools' ``bytes_per_page``. Worked example, indexer and
fp8 KV pools of DeepSeek-V3.2 (61 layers, 64-token pages)::

    indexer: 64 tokens x 132 B x 61 layers =   515,328 B per page
    kv:      64 tokens x 656 B x 61 layers = 2,561,024 B per page
    shared page                            = 3,076,352 B
    --host-pool-gb 100  ->  100e9 // 3,076,352 = 32,506 pages

``plan_pools`` is pure arithmetic; ``reserve_host_pools`` probes, plans and records the
reservation under the ledger lock, so two processes asking for 60 % each cannot both pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, HostBudgetExceeded, shown
from ..geometry import PageGeometry
from .budget import (
    MEMSW_LIMIT_FILE,
    BudgetLimiter,
    BudgetSnapshot,
    CgroupLevel,
    check_probe_arguments,
    probe_host_budget,
)
from .ledger import HostLedger, LedgerEntry, Reservation

GB_BYTES = 10**9


@dataclass(frozen=True)
class PoolSizing:
    """One pool of a plan: its geometry and the (shared) page count."""

    geometry: PageGeometry
    num_pages: int

    @property
    def name(self) -> str:
        return self.geometry.name

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.geometry.bytes_per_token_per_layer

    @property
    def bytes_per_page_per_layer(self) -> int:
        return self.geometry.bytes_per_page_per_layer

    @property
    def bytes_per_page(self) -> int:
        return self.geometry.bytes_per_page

    @property
    def requested_bytes(self) -> int:
        return self.geometry.bytes_for_pages(self.num_pages)


@dataclass(frozen=True)
class PoolPlan:
    """The sizing of a set of pools against one budget snapshot.

    ``requested_bytes`` is one rank's pools; ``total_requested_bytes`` is what the budget must
    hold: ``ranks_per_host`` times it. ``available_bytes`` is the probe's figure minus the
    ledger's pending reservations. ``max_pages_that_fit`` is per rank.
    """

    pools: tuple[PoolSizing, ...]
    num_pages: int
    bytes_per_shared_page: int
    requested_bytes: int
    asked_bytes: int | None  #: the caller's byte figure before rounding down to whole pages
    auto: bool
    ranks_per_host: int
    total_requested_bytes: int
    budget: BudgetSnapshot
    pending_bytes: int
    available_bytes: int
    fits: bool
    max_pages_that_fit: int

    @property
    def max_bytes_that_fit(self) -> int:
        """One rank's bytes at ``max_pages_that_fit``."""
        return self.max_pages_that_fit * self.bytes_per_shared_page


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be an int > 0, got {shown(value)}")
    return value


def _not_negative(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0 (bytes), got {shown(value)}")
    return value


def _check_pools(pools: Sequence[PageGeometry] | PageGeometry) -> tuple[PageGeometry, ...]:
    if isinstance(pools, PageGeometry):  # one pool, as ServiceConfig takes it
        pools = (pools,)
    if (isinstance(pools, (str, bytes)) or not isinstance(pools, Iterable)
            or not (pools := tuple(pools))
            or not all(isinstance(p, PageGeometry) for p in pools)):
        raise ConfigError(f"pools must be a non-empty sequence of PageGeometry, got "
                          f"{shown(pools)}")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"pool names must be distinct, got {names}")
    page_sizes = {p.page_size_tokens for p in pools}
    if len(page_sizes) != 1:
        raise ConfigError(
            f"pools share one page table, so their page_size_tokens must match, got {page_sizes}"
        )
    return pools


def _check_sizing(pools: object, requested_bytes: object, num_pages: object,
                  max_pages: object) -> tuple[PageGeometry, ...]:
    """The pools, checked, after the sizing arguments' checks (``ConfigError``)."""
    pools = _check_pools(pools)  # type: ignore[arg-type]
    if requested_bytes is not None and num_pages is not None:
        raise ConfigError("give requested_bytes or num_pages, not both (neither means auto)")
    if requested_bytes is not None:
        _positive("requested_bytes", requested_bytes)
    if num_pages is not None:
        _positive("num_pages", num_pages)
    if max_pages is not None:
        _positive("max_pages", max_pages)
        if requested_bytes is not None or num_pages is not None:
            raise ConfigError("max_pages caps auto sizing; with requested_bytes or num_pages "
                              "given it would be ignored: drop it, or give neither")
    return pools


def plan_pools(
    pools: Sequence[PageGeometry],
    *,
    budget_snapshot: BudgetSnapshot,
    requested_bytes: int | None = None,
    num_pages: int | None = None,
    pending_bytes: int = 0,
    max_pages: int | None = None,
    ranks_per_host: int = 1,
) -> PoolPlan:
    """Size ``pools`` against a budget. Pure: reads nothing, writes nothing.

    Give ``requested_bytes`` (all pools together, rounded down to whole shared pages),
    ``num_pages``, or neither for *auto*: the largest page count that fits, at most
    ``max_pages``. ``pending_bytes`` are other reservations not yet allocated (the ledger's).
    ``ranks_per_host`` co-located ranks each take this plan.
    """
    pools = _check_sizing(pools, requested_bytes, num_pages, max_pages)
    if not isinstance(budget_snapshot, BudgetSnapshot):
        raise ConfigError(f"budget_snapshot must be a BudgetSnapshot (probe_host_budget()), got "
                          f"{shown(budget_snapshot)}")
    auto = requested_bytes is None and num_pages is None
    _not_negative("pending_bytes", pending_bytes)
    ranks_per_host = _positive("ranks_per_host", ranks_per_host)
    bytes_per_shared_page = sum(p.bytes_per_page for p in pools)
    available_bytes = max(0, budget_snapshot.available_bytes - pending_bytes)
    max_pages_that_fit = available_bytes // (bytes_per_shared_page * ranks_per_host)

    if requested_bytes is not None:  # the sizing arguments were checked above
        num_pages = requested_bytes // bytes_per_shared_page
        if num_pages == 0:
            raise ConfigError(
                f"a host pool of {format_bytes(requested_bytes)} holds no whole page; the smallest "
                f"size that holds one page of {'+'.join(p.name for p in pools)} is "
                f"{format_bytes(bytes_per_shared_page)}"
            )
    elif num_pages is None:
        cap = max_pages_that_fit if max_pages is None else min(max_pages, max_pages_that_fit)
        num_pages = max(1, cap)  # auto asks for at least one page, so "nothing fits" is a refusal

    one_rank_bytes = num_pages * bytes_per_shared_page
    total_requested_bytes = one_rank_bytes * ranks_per_host
    return PoolPlan(
        pools=tuple(PoolSizing(p, num_pages) for p in pools),
        num_pages=num_pages,
        bytes_per_shared_page=bytes_per_shared_page,
        requested_bytes=one_rank_bytes,
        asked_bytes=requested_bytes,
        auto=auto,
        ranks_per_host=ranks_per_host,
        total_requested_bytes=total_requested_bytes,
        budget=budget_snapshot,
        pending_bytes=pending_bytes,
        available_bytes=available_bytes,
        fits=total_requested_bytes <= available_bytes,
        max_pages_that_fit=max_pages_that_fit,
    )


def reserve_host_pools(
    pools: Sequence[PageGeometry],
    *,
    num_pages: int | None = None,
    requested_bytes: int | None = None,
    max_pages: int | None = None,
    root: str | os.PathLike[str] | None = None,
    ledger: HostLedger | None = None,
    reserve_bytes: int | None = None,
    hugepages: bool = False,
    label: str | None = None,
) -> tuple[PoolPlan, Reservation]:
    """Probe the budget, plan ``pools`` and record the reservation, all under the ledger lock.

    Sizing arguments as in ``plan_pools`` (neither ``num_pages`` nor ``requested_bytes`` means
    auto). Raises ``HostBudgetExceeded`` (nothing reserved) when the plan does not fit.
    Blocking: file reads, the ledger lock and a ledger write; call it from a worker thread.
    """
    # Every argument is checked before the ledger is touched (its directory made, locked).
    check_probe_arguments(root, reserve_bytes, hugepages)
    pools = _check_sizing(pools, requested_bytes, num_pages, max_pages)  # an iterator: once
    if ledger is not None and not isinstance(ledger, HostLedger):
        raise ConfigError(f"ledger must be a HostLedger or None, got {shown(ledger)}")
    if label is not None and not isinstance(label, str):
        raise ConfigError(f"label must be a str or None, got {shown(label)}")
    ledger = ledger if ledger is not None else HostLedger()
    with ledger.transaction() as txn:
        snapshot = probe_host_budget(root, reserve_bytes=reserve_bytes, hugepages=hugepages)
        plan = plan_pools(
            pools,
            budget_snapshot=snapshot,
            requested_bytes=requested_bytes,
            num_pages=num_pages,
            pending_bytes=txn.pending_bytes(),
            max_pages=max_pages,
        )
        if not plan.fits:
            raise HostBudgetExceeded(
                budget_exceeded_message(plan, txn.entries, ledger_path=ledger.path),
                max_pages_that_fit=plan.max_pages_that_fit,
                available_bytes=snapshot.available_bytes - plan.pending_bytes,
                bytes_per_page=plan.bytes_per_shared_page, reservations=tuple(txn.entries))
        reservation = txn.add(plan.requested_bytes, label=label or "+".join(p.name for p in plan.pools))
    return plan, reservation


# --- the refusal -------------------------------------------------------------------------------

HOST_POOL_SETTING = "--host-pool-gb / ServiceConfig.host_pool"
RESERVE_SETTING = "--reserve-gb / ServiceConfig.reserve_bytes"
_UNITS = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))


def human_bytes(nbytes: int) -> str:
    """Decimal units, as ``--host-pool-gb`` counts them: ``1.00 GB`` is 10**9 B."""
    for scale, unit in _UNITS:
        if abs(nbytes) >= scale:
            if abs(nbytes) >= 10**18 * scale:  # beyond any real host (and maybe any float)
                digits = str(abs(nbytes) // scale)
                sign = "-" if nbytes < 0 else ""
                return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1} {unit}"
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_bytes(nbytes: int) -> str:
    """``1.00 GB (1,000,000,000 B)``: human and exact."""
    return f"{human_bytes(nbytes)} ({nbytes:,} B)" if nbytes >= 1000 else f"{nbytes} B"


def binding_figures(level: CgroupLevel) -> tuple[int, int, int]:
    """(limit, usage, working set) of the file that sets ``level.headroom_bytes`` (its
    ``limit_file``): headroom = max(0, limit - working set), working set = max(0, usage -
    inactive file). Memory + swap when ``memory.memsw.limit_in_bytes`` binds (v1)."""
    if level.limit_file == MEMSW_LIMIT_FILE:
        limit, usage = level.memsw_limit_bytes, level.memsw_usage_bytes
        working_set = level.memsw_working_set_bytes
        assert limit is not None and usage is not None and working_set is not None
        return limit, usage, working_set
    assert level.limit_bytes is not None
    return level.limit_bytes, level.usage_bytes, level.working_set_bytes


def _limiter_lines(plan: PoolPlan) -> tuple[str, str]:
    """(what limits the budget, how to raise that limit)."""
    budget = plan.budget
    level = budget.limiter_level
    if level is not None:
        assert level.headroom_bytes is not None
        limit, usage, working_set = binding_figures(level)
        swap = " + swap" if level.limit_file == MEMSW_LIMIT_FILE else ""
        working = f"memory{swap} working set" if swap else "working set"
        return (
            f"cgroup {level.path} ({level.version.value}): {level.limit_file} "
            f"{format_bytes(limit)}, {working} {format_bytes(working_set)} "
            f"(usage {human_bytes(usage)} - inactive file "
            f"{human_bytes(level.inactive_file_bytes)}), headroom {format_bytes(level.headroom_bytes)}",
            f"raise the container's memory{swap} limit "
            f"({level.limit_file} of cgroup {level.path})",
        )
    if budget.limiter is BudgetLimiter.HUGEPAGES:  # not merely hugepage-backed: binding
        assert budget.hugepages_free_bytes is not None
        return (
            f"free hugepages {format_bytes(budget.hugepages_free_bytes)}",
            "reserve more hugepages (vm.nr_hugepages)",
        )
    return (
        f"MemAvailable {format_bytes(budget.mem_available_bytes)}",
        "free host memory held by other processes",
    )


def _available_formula(plan: PoolPlan) -> str:
    """``min(MemAvailable .., cgroup .. headroom ..) - reserve .. - other reservations ..``."""
    budget = plan.budget
    terms = [f"MemAvailable {human_bytes(budget.mem_available_bytes)}"]
    terms += [
        f"cgroup {lvl.path} headroom {human_bytes(lvl.headroom_bytes)}"
        for lvl in budget.levels
        if lvl.headroom_bytes is not None
    ]
    if budget.hugepages and budget.hugepages_free_bytes is not None:
        terms.append(f"free hugepages {human_bytes(budget.hugepages_free_bytes)}")
    smallest = f"min({', '.join(terms)})" if len(terms) > 1 else terms[0]
    return (
        f"{smallest} - reserve {human_bytes(budget.reserve_bytes)} "
        f"- other reservations {human_bytes(plan.pending_bytes)}"
    )


def _total_source(budget: BudgetSnapshot) -> str:
    """What sets ``limit_bytes``: MemTotal or the tightest cgroup limit."""
    tightest = [lvl for lvl in budget.levels if lvl.limit_bytes == budget.limit_bytes]
    if budget.limit_bytes < budget.mem_total_bytes and tightest:
        return f"memory limit of cgroup {tightest[0].path}: {tightest[0].memory_limit_file}"
    return "MemTotal"


def budget_exceeded_message(
    plan: PoolPlan,
    reservations: Sequence[LedgerEntry] = (),
    *,
    ledger_path: str | os.PathLike[str] | None = None,
) -> str:
    """The full text of ``HostBudgetExceeded`` for a plan that does not fit.

    ``reservations`` are the ledger's live entries; ``ledger_path`` names the ledger file.
    """
    budget = plan.budget
    what, raise_limit = _limiter_lines(plan)
    how = "auto: even one page does not fit" if plan.auto else "whole pages"
    if plan.asked_bytes is not None:
        how = f"asked {format_bytes(plan.asked_bytes)}, rounded down to whole pages"
    lines = [
        "host pool does not fit the host-memory budget; nothing was reserved, allocated or pinned",
        f"  requested: {format_bytes(plan.requested_bytes)} = {plan.num_pages:,} pages x "
        f"{plan.bytes_per_shared_page:,} B per shared page ({how})",
        *(f"    {sizing.geometry.arithmetic(plan.num_pages)}" for sizing in plan.pools),
    ]
    if plan.ranks_per_host > 1:
        total = format_bytes(plan.total_requested_bytes)
        lines.append(f"    x {plan.ranks_per_host} ranks per host = {total}")
    lines += [
        f"  available: {format_bytes(plan.available_bytes)} = {_available_formula(plan)}",
        f"  total: {format_bytes(budget.limit_bytes)} ({_total_source(budget)})",
        f"  limited by: {what}",
    ]
    if plan.pending_bytes or reservations:
        where = f" in {ledger_path}" if ledger_path is not None else ""
        lines.append(
            f"  other reservations{where}: {format_bytes(plan.pending_bytes)} not yet allocated"
        )
        lines += [
            f"    pid {e.pid} {e.label!r}: reserved {human_bytes(e.reserved_bytes)}, allocated "
            f"{human_bytes(e.allocated_bytes)}, pending {format_bytes(e.pending_bytes)}"
            for e in reservations
        ]
    fixes = []
    if plan.max_pages_that_fit > 0:
        per_rank = " per rank" if plan.ranks_per_host > 1 else ""
        fits = f"{plan.max_pages_that_fit:,} pages = {format_bytes(plan.max_bytes_that_fit)}{per_rank}"
        lines.append(f"  largest that fits: {fits}")
        fixes.append(f"lower {HOST_POOL_SETTING} to <= {_setting_gb(plan.max_bytes_that_fit)}")
    else:
        one_page = format_bytes(plan.bytes_per_shared_page)
        lines.append(f"  largest that fits: 0 pages - not even one page ({one_page}) fits")
    # The reserve that would let this request fit, when lowering it alone would.
    reserve_that_fits = (budget.available_before_reserve_bytes - plan.pending_bytes
                         - plan.total_requested_bytes)
    if 0 <= reserve_that_fits < budget.reserve_bytes:
        fixes.append(f"lower the reserve ({RESERVE_SETTING}, now "
                     f"{format_bytes(budget.reserve_bytes)}) to <= {_setting_gb(reserve_that_fits)}")
    if not plan.auto and plan.max_pages_that_fit > 0:  # auto would be refused too otherwise
        fixes.append("use auto")
    fixes.append(raise_limit)
    if plan.pending_bytes:
        fixes.append("stop the processes holding the other reservations")
    if plan.ranks_per_host > 1:
        fixes.append("run fewer ranks per host")
    lines.append(f"  to fix: {', or '.join(fixes)}")
    memlock = budget.memlock_limit_bytes
    memlock_text = "unlimited" if memlock is None else format_bytes(memlock)
    lines.append(f"  note: RLIMIT_MEMLOCK is {memlock_text} (information only; not used as a cap)")
    return "\n".join(lines)


def _setting_gb(nbytes: int) -> str:
    """A ``--host-pool-gb`` value no larger than ``nbytes``, with its exact bytes."""
    hundredths = nbytes * 100 // GB_BYTES
    if hundredths == 0:  # below 0.01 GB: every digit down to the byte (the flag takes them)
        if nbytes <= 0:
            return f"{nbytes:,} B"
        whole, rest = divmod(nbytes, GB_BYTES)
        return f"{whole}.{rest:09d}".rstrip("0") + f" GB ({nbytes:,} B)"
    return f"{hundredths // 100}.{hundredths % 100:02d} GB ({nbytes:,} B)"
