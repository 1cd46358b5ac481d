"""What the workload itself counted (the service's own figures are read from its registry).

Mutable, loop thread only: the forward-pass thread reports through the loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkloadCounters:
    conversations_started: int = 0
    conversations_finished: int = 0
    conversations_rejected: int = 0  #: arrived while the engine held its maximum
    turns_finished: int = 0
    tokens_appended: int = 0
    context_resets: int = 0  #: a conversation outgrew the device share and started over
    computed_pages: int = 0  #: pages written by the forward pass (new tokens or recompute)
    recomputed_pages: int = 0  #: of those, pages whose cached copy had been lost
    evictions: int = 0  #: backups requested
    evicted_pages: int = 0
    dropped_without_copy_pages: int = 0  #: left the device because the host copy was valid
    prefetches: int = 0
    prefetched_pages: int = 0  #: pages of prefetches that completed
    verified_pages: int = 0  #: prefetched pages checked against their recorded checksum
    mismatches: int = 0  #: checked pages whose bytes differ from what was backed up
    host_copies_lost: int = 0  #: host copies released under pressure before being used again
    failed_evictions: int = 0
    failed_prefetches: int = 0
    failed_steps: int = 0
    errors: int = 0  #: every failure above, plus refused requests

    @property
    def unverified_pages(self) -> int:
        return self.prefetched_pages - self.verified_pages
