"""``dsa-async plan``: size the host pools of a model against this machine's budget.

Only plans: it reads the ledger's current reservations but never writes the ledger.
Exit 0 when the plan fits, 3 when it does not (the full refusal on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..geometry import MODELS, KvDtype, model_pools
from ..host_memory.budget import MEMSW_LIMIT_FILE, BudgetSnapshot, probe_host_budget
from ..host_memory.ledger import HostLedger, LedgerEntry
from ..host_memory.plan import (
    PoolPlan,
    budget_exceeded_message,
    format_bytes,
    human_bytes,
    plan_pools,
)
from .exit_codes import EXIT_DOES_NOT_FIT
from .numbers import host_pool_bytes, positive_int, reserve_bytes

EXIT_FITS = 0


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="size the host pools against this machine's memory budget",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--model", choices=MODELS, default=MODELS[0], help="model preset (default %(default)s)"
    )
    parser.add_argument(
        "--host-pool-gb",
        dest="host_pool_bytes",
        type=host_pool_bytes,
        required=True,
        metavar="GB|auto",
        help="total host pool over all planned pools, in GB (10^9 B), or 'auto' (largest that fits)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=[m.value for m in KvDtype],
        help="also plan the MLA KV pool (same page count as the indexer); without it only the indexer",
    )
    parser.add_argument(
        "--with-draft", action="store_true", help="add the MTP draft layer to every pool"
    )
    parser.add_argument(
        "--ranks-per-host",
        type=positive_int,
        default=1,
        metavar="N",
        help="co-located ranks that each take this pool; the budget must hold N times it (default 1)",
    )
    parser.add_argument(
        "--reserve-gb",
        dest="reserve_bytes",
        type=reserve_bytes,
        default=None,
        metavar="GB",
        help="memory kept free for everything else (default min(1 GiB, 5%% of the tightest limit))",
    )
    parser.add_argument("--hugepages", action="store_true", help="the arena is hugepage-backed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Probe, read the ledger (read-only), plan, print. Blocking; a command-line call."""
    kv_dtype = KvDtype(args.kv_dtype) if args.kv_dtype is not None else None
    pools = model_pools(args.model, kv_dtype=kv_dtype, with_draft=args.with_draft)
    snapshot = probe_host_budget(reserve_bytes=args.reserve_bytes, hugepages=args.hugepages)
    ledger = HostLedger()
    reservations = ledger.peek()
    plan = plan_pools(
        pools,
        budget_snapshot=snapshot,
        requested_bytes=args.host_pool_bytes,
        pending_bytes=sum(e.pending_bytes for e in reservations),
        ranks_per_host=args.ranks_per_host,
    )
    if args.json:
        print(json.dumps(plan_as_dict(plan, reservations, model=args.model, ledger=ledger), indent=2))
    else:
        print(plan_as_text(plan, model=args.model))
    if plan.fits:
        return EXIT_FITS
    print(budget_exceeded_message(plan, reservations, ledger_path=ledger.path), file=sys.stderr)
    return EXIT_DOES_NOT_FIT


def budget_as_dict(budget: BudgetSnapshot) -> dict[str, Any]:
    return {
        "root": budget.root,
        "mem_total_bytes": budget.mem_total_bytes,
        "mem_available_bytes": budget.mem_available_bytes,
        "limit_bytes": budget.limit_bytes,
        "reserve_bytes": budget.reserve_bytes,
        "available_before_reserve_bytes": budget.available_before_reserve_bytes,
        "available_bytes": budget.available_bytes,
        "limiter": budget.limiter.value,
        "limiter_cgroup_path": budget.limiter_cgroup_path,
        "hugepages": budget.hugepages,
        "hugepages_free_bytes": budget.hugepages_free_bytes,
        "memlock_limit_bytes": budget.memlock_limit_bytes,
        "cgroups": [
            {
                "path": lvl.path,
                "version": lvl.version.value,
                "limit_bytes": lvl.limit_bytes,
                "usage_bytes": lvl.usage_bytes,
                "inactive_file_bytes": lvl.inactive_file_bytes,
                "working_set_bytes": lvl.working_set_bytes,
                "headroom_bytes": lvl.headroom_bytes,
                "limit_file": lvl.limit_file,
                "memsw_limit_bytes": lvl.memsw_limit_bytes,
                "memsw_usage_bytes": lvl.memsw_usage_bytes,
                "memsw_working_set_bytes": lvl.memsw_working_set_bytes,
            }
            for lvl in budget.levels
        ],
    }


def plan_as_dict(
    plan: PoolPlan, reservations: tuple[LedgerEntry, ...], *, model: str, ledger: HostLedger
) -> dict[str, Any]:
    """The plan as JSON-ready data; every byte count an int."""
    return {
        "model": model,
        "pools": [
            {
                "name": p.name,
                "bytes_per_token_per_layer": p.bytes_per_token_per_layer,
                "bytes_per_page_per_layer": p.bytes_per_page_per_layer,
                "num_layers": p.geometry.num_layers,
                "page_size_tokens": p.geometry.page_size_tokens,
                "bytes_per_page": p.bytes_per_page,
                "num_pages": p.num_pages,
                "requested_bytes": p.requested_bytes,
            }
            for p in plan.pools
        ],
        "num_pages": plan.num_pages,
        "bytes_per_shared_page": plan.bytes_per_shared_page,
        "asked_bytes": plan.asked_bytes,
        "auto": plan.auto,
        "requested_bytes": plan.requested_bytes,
        "ranks_per_host": plan.ranks_per_host,
        "total_requested_bytes": plan.total_requested_bytes,
        "pending_bytes": plan.pending_bytes,
        "available_bytes": plan.available_bytes,
        "fits": plan.fits,
        "max_pages_that_fit": plan.max_pages_that_fit,
        "max_bytes_that_fit": plan.max_bytes_that_fit,
        "budget": budget_as_dict(plan.budget),
        "ledger": str(ledger.path),
        "reservations": [
            {
                "pid": e.pid,
                "label": e.label,
                "reserved_bytes": e.reserved_bytes,
                "allocated_bytes": e.allocated_bytes,
                "pending_bytes": e.pending_bytes,
            }
            for e in reservations
        ],
    }


def plan_as_text(plan: PoolPlan, *, model: str) -> str:
    """A table of the pools, the budget and the verdict."""
    budget = plan.budget
    header = ("pool", "B/token/layer", "B/page/layer", "layers", "B/page", "pages", "bytes")
    rows = [
        (
            p.name,
            p.bytes_per_token_per_layer,
            p.bytes_per_page_per_layer,
            p.geometry.num_layers,
            p.bytes_per_page,
            p.num_pages,
            p.requested_bytes,
        )
        for p in plan.pools
    ]
    cells = [header] + [(r[0], *(f"{v:,}" for v in r[1:])) for r in rows]
    cells.append(
        (
            "all pools",
            "",
            "",
            "",
            f"{plan.bytes_per_shared_page:,}",
            f"{plan.num_pages:,}",
            f"{plan.requested_bytes:,}",
        )
    )
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    table = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
    how = "auto (largest that fits)" if plan.auto else f"asked {format_bytes(plan.asked_bytes or 0)}"
    lines = [
        f"dsa-async plan: {model}, {len(plan.pools)} pool(s) sharing one page table",
        "",
        *table,
        "",
    ]
    lines.append(f"requested:   {format_bytes(plan.requested_bytes)} per rank ({how}, whole pages)")
    if plan.ranks_per_host > 1:
        lines.append(
            f"             x {plan.ranks_per_host} ranks per host = "
            f"{format_bytes(plan.total_requested_bytes)} checked against the budget"
        )
    lines += [
        f"available:   {format_bytes(plan.available_bytes)} = probe "
        f"{human_bytes(budget.available_bytes)} - other reservations {human_bytes(plan.pending_bytes)}",
        f"  MemTotal {human_bytes(budget.mem_total_bytes)}, "
        f"MemAvailable {human_bytes(budget.mem_available_bytes)}, "
        f"tightest limit {human_bytes(budget.limit_bytes)}, "
        f"reserve {human_bytes(budget.reserve_bytes)}, "
        f"limited by {budget.limiter.value}"
        + (f" ({budget.limiter_cgroup_path})" if budget.limiter_cgroup_path else ""),
    ]
    for lvl in budget.levels:
        limit = "no limit" if lvl.limit_bytes is None else (
            f"{lvl.memory_limit_file} {human_bytes(lvl.limit_bytes)}")
        line = (f"  cgroup {lvl.path} ({lvl.version.value}): {limit}, "
                f"working set {human_bytes(lvl.working_set_bytes)}")
        memsw_working_set = lvl.memsw_working_set_bytes
        if memsw_working_set is not None:
            memsw = "no limit" if lvl.memsw_limit_bytes is None else (
                f"{MEMSW_LIMIT_FILE} {human_bytes(lvl.memsw_limit_bytes)}")
            line += f"; memory + swap: {memsw}, working set {human_bytes(memsw_working_set)}"
        if lvl.headroom_bytes is not None:
            line += f"; headroom {human_bytes(lvl.headroom_bytes)} ({lvl.limit_file} binds)"
        lines.append(line)
    memlock = (
        "unlimited" if budget.memlock_limit_bytes is None else human_bytes(budget.memlock_limit_bytes)
    )
    lines.append(f"  RLIMIT_MEMLOCK {memlock} (information only)")
    lines.append(
        f"largest that fits: {plan.max_pages_that_fit:,} pages = "
        f"{format_bytes(plan.max_bytes_that_fit)} per rank"
    )
    lines.append("verdict: fits" if plan.fits else "verdict: does NOT fit (details on stderr)")
    return "\n".join(lines)
