"""A host budget refusal in SGLang's terms: the largest ``--hicache-size`` / ``--hicache-ratio``
that fits, computed with SGLang 0.5.23's own sizing rule.

SGLang sizes the MLA KV host pool alone from its flags (``pool_host/base.py``): with
``--hicache-size H`` (whole GB per rank) it holds ``int(H * 1e9 // kv_bytes_per_token)`` tokens,
otherwise ``int(device_tokens * ratio)``; then ``tokens // page_tokens + 1`` pages (one of them
padding). The DSA indexer host pool has one page more, and that is the service's page count, so
the indexer's bytes come on top of what ``--hicache-size`` names: the service's own largest pool
in GB is not a value for that flag. Pure arithmetic; nothing here blocks.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...errors import HostBudgetExceeded
from ...host_memory.plan import HOST_POOL_SETTING

#: SGLang's settings that size the host pool the plug-in asks for (per rank).
SGLANG_HOST_POOL_SETTING = "SGLang's --hicache-size (GB per rank) or --hicache-ratio"

#: The service's own "lower the pool" fix in a refusal's ``to fix:`` line.
_LOWER_POOL = re.compile(re.escape(f"lower {HOST_POOL_SETTING} to <= ") + r".*?(?=, or |$)",
                         re.MULTILINE)


@dataclass(frozen=True)
class HostPoolSizing:
    """What SGLang sizes the host pools from, on one rank."""

    kv_bytes_per_token: int  #: the KV host pool's bytes per token, every layer
    page_tokens: int
    device_tokens: int  #: the device KV pool's capacity, which --hicache-ratio multiplies
    hicache_size_gb: int  #: --hicache-size (0: the ratio sizes the pool)

    def service_pages(self, *, size_gb: int | None = None, ratio: float | None = None) -> int:
        """The service's pages for SGLang's host pools sized by ``size_gb`` or ``ratio``."""
        if size_gb is not None:
            tokens = int(size_gb * 1e9 // self.kv_bytes_per_token)
        else:
            assert ratio is not None
            tokens = int(self.device_tokens * ratio)
        return tokens // self.page_tokens + 2  # KV pages with SGLang's padding page, +1

    def largest_size_gb(self, max_pages: int) -> int | None:
        """The largest ``--hicache-size`` (>= 1 GB) whose pools fit ``max_pages``, or None."""
        # tokens <= (max_pages - 1) * page_tokens - 1 is what fits; start just above that
        size = (max_pages - 1) * self.page_tokens * self.kv_bytes_per_token // 10**9 + 1
        while size >= 1 and self.service_pages(size_gb=size) > max_pages:
            size -= 1
        return size if size >= 1 else None

    def largest_ratio(self, max_pages: int) -> float | None:
        """The largest ``--hicache-ratio`` in hundredths (> 0) that fits, or None."""
        if self.device_tokens <= 0:
            return None
        cents = (max_pages - 1) * self.page_tokens * 100 // self.device_tokens + 1
        while cents >= 1 and self.service_pages(ratio=cents / 100) > max_pages:
            cents -= 1
        return cents / 100 if cents >= 1 else None

    def lower_fix(self, max_pages: int) -> str | None:
        """The refusal's "lower the pool" fix as SGLang's flags, the one in use first; None
        when no value of either fits."""
        size_gb, ratio = self.largest_size_gb(max_pages), self.largest_ratio(max_pages)
        size_note = "GB per rank: the KV host pool alone, the indexer pool comes on top"
        if self.hicache_size_gb > 0:  # the size is in use; the ratio applies once it is 0
            fixes = [f"lower SGLang's --hicache-size to <= {size_gb} ({size_note})"
                     if size_gb else None,
                     f"set --hicache-size 0 and --hicache-ratio <= {ratio:.2f}"
                     if ratio else None]
        else:
            fixes = [f"lower SGLang's --hicache-ratio to <= {ratio:.2f}" if ratio else None,
                     f"set --hicache-size <= {size_gb} ({size_note})" if size_gb else None]
        return ", or ".join(fix for fix in fixes if fix) or None


@dataclass(frozen=True)
class RankPeers:
    """This server's TP ranks as the budget sees them: their processes as ``(pid, start
    ticks)`` (this rank's included; the start time tells a rank from an unrelated process of
    the same pid on another host), and how many ranks SGLang places on each host."""

    processes: frozenset[tuple[int, int]]
    ranks_per_host: int = 1

    def per_rank_max_pages(self, refusal: HostBudgetExceeded) -> tuple[int, int] | None:
        """``(pages, ranks)``: the largest pool per rank that fits when each of ``ranks`` ranks
        of this server on the host holds one, or None without the refusal's figures.

        The flags size every rank alike, and a refusal releases every rank's pool. So the
        budget to share is what the refused rank found left plus what this server's other
        ranks held in the ledger then (reserved, allocated or not: the probe saw both gone),
        split between them and the ranks still to come."""
        if refusal.available_bytes is None or not refusal.bytes_per_page:
            return None
        own = os.getpid()
        peers = [e for e in refusal.reservations
                 if (e.pid, e.start_time_ticks) in self.processes and e.pid != own]
        held_bytes = sum(e.reserved_bytes for e in peers)
        ranks = max(self.ranks_per_host, 1 + len({e.pid for e in peers}))
        shared_bytes = max(0, refusal.available_bytes + held_bytes)
        return shared_bytes // (ranks * refusal.bytes_per_page), ranks


def in_sglang_terms(refusal: HostBudgetExceeded, sizing: HostPoolSizing | None = None,
                    peers: RankPeers | None = None) -> HostBudgetExceeded:
    """The service's budget refusal with its fixes named as SGLang's flags: the host pool
    follows --hicache-size / --hicache-ratio there (the service's own size setting and its
    auto sizing are not SGLang's to set). With ``sizing`` and the refusal's figures, the fix
    gives the largest flag values that fit, in SGLang's own sizing, for every rank of the
    server on this host (``peers``; this rank alone without it)."""
    message = str(refusal)
    max_pages, ranks = refusal.max_pages_that_fit, 1
    if peers is not None and (shared := peers.per_rank_max_pages(refusal)) is not None:
        max_pages, ranks = shared
    if sizing is not None and max_pages is not None:
        fix = sizing.lower_fix(max_pages)
        if fix and ranks > 1:  # the values hold for every rank at once
            fix = f"with {ranks} ranks of this server on this host, {fix}"
        message = _LOWER_POOL.sub(lambda _match: fix or "", message, count=1)
        message = message.replace("to fix: , or ", "to fix: ")
    message = message.replace(HOST_POOL_SETTING, SGLANG_HOST_POOL_SETTING)
    message = message.replace(", or use auto", "").replace("to fix: use auto, or ", "to fix: ")
    renamed = HostBudgetExceeded(
        message, max_pages_that_fit=max_pages, available_bytes=refusal.available_bytes,
        bytes_per_page=refusal.bytes_per_page, reservations=refusal.reservations)
    renamed.__cause__ = refusal.__cause__
    return renamed
