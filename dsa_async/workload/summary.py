"""The end-of-run summary: a frozen record, its text form and its JSON form.

Traffic, padding and prefetch timeliness are the service's own figures (its registry); pages
prefetched, verified and mismatched are the workload's; ``leaked_pages`` compares the service's
statistics after everything was released with the snapshot taken right after start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..front_door.service import ServiceStatistics
from ..host_memory.plan import human_bytes
from .counters import WorkloadCounters
from .output_files import write_text_file
from .readings import ServiceReadings


#: The stop reasons that are signals (``signal.Signals`` names, as the runner records them).
_SIGNAL_NAMES = frozenset({"SIGINT", "SIGTERM"})


@dataclass(frozen=True)
class ServeSummary:
    backend: str
    workload: str
    num_layers: int
    device_pages: int
    host_pool_pages: int
    bytes_per_page: int
    stop_reason: str
    duration_s: float
    requests_d2h: int
    requests_h2d: int
    bytes_d2h: int
    bytes_h2d: int
    gbps_d2h: float
    gbps_h2d: float
    padding_bytes: int
    padding_overhead: float  #: padding bytes / all bytes moved
    prefetch_layers_on_time: int
    prefetch_layers_late: int
    prefetch_layers_wasted: int
    prefetched_pages: int
    verified_pages: int
    mismatches: int
    leaked_pages: int
    statistics_match: bool  #: service statistics at the end == the snapshot after start
    device_pages_in_use: int  #: the workload's own page table at the end (0 when consistent)
    turns: int
    tokens_appended: int
    conversations_started: int
    conversations_finished: int
    conversations_rejected: int
    context_resets: int
    evicted_pages: int
    dropped_without_copy_pages: int
    computed_pages: int
    recomputed_pages: int
    host_copies_lost: int
    host_pages_reclaimed: int
    failed_requests: int
    cancelled_requests: int
    errors: int
    forward_pass_busy_s: float
    forward_pass_waited_s: float
    forward_steps: int  #: steps the forward pass ran, failed ones included
    failed_steps: int
    forward_pass_error: str | None  #: the first failed step's error
    metrics_url: str | None = None

    @property
    def failures(self) -> tuple[str, ...]:
        """Why the run failed; empty when it did not."""
        return tuple(why for bad, why in (
            (not self.forward_steps, "no forward step ran, so nothing was verified: "
                                     + self._why_no_step()),
            (self.failed_steps, f"{self.failed_steps:,} of {self.forward_steps:,} forward steps "
                                f"failed (first: {self.forward_pass_error})"),
            (self.mismatches, f"{self.mismatches:,} prefetched pages differ from their backup"),
            (self.leaked_pages, f"{self.leaked_pages:,} pages leaked"),
            (not self.statistics_match, "the service's statistics differ from the start"),
            (self.verified_pages != self.prefetched_pages,
             f"{self.verified_pages:,} of {self.prefetched_pages:,} prefetched pages verified"),
        ) if bad)

    def _why_no_step(self) -> str:
        if self.stop_reason in _SIGNAL_NAMES:
            return (f"{self.stop_reason} stopped the run before the first step; let it run "
                    f"longer before stopping it")
        return "run longer (--duration-s), or give a trace whose turns arrive within the run"

    @property
    def ok(self) -> bool:
        """At least one forward step ran and every one succeeded, every prefetched page
        verified, none mismatched, nothing leaked."""
        return not self.failures

    @classmethod
    def build(cls, *, readings: ServiceReadings, counters: WorkloadCounters,
              start: ServiceStatistics, end: ServiceStatistics | None, duration_s: float,
              **fields) -> ServeSummary:
        """``end``: the statistics after releasing everything (``None``: could not be taken,
        counted as a mismatch)."""
        moved = readings.bytes_d2h + readings.bytes_h2d
        seconds = max(duration_s, 1e-9)
        leaked = 0 if end is None else (end.used_pages - start.used_pages) + end.in_flight_pages
        return cls(
            duration_s=duration_s,
            requests_d2h=readings.requests_d2h, requests_h2d=readings.requests_h2d,
            bytes_d2h=readings.bytes_d2h, bytes_h2d=readings.bytes_h2d,
            gbps_d2h=readings.bytes_d2h / seconds / 1e9, gbps_h2d=readings.bytes_h2d / seconds / 1e9,
            padding_bytes=readings.padding_bytes,
            padding_overhead=readings.padding_bytes / moved if moved else 0.0,
            prefetch_layers_on_time=readings.prefetch_layers_on_time,
            prefetch_layers_late=readings.prefetch_layers_late,
            prefetch_layers_wasted=readings.prefetch_layers_wasted,
            prefetched_pages=counters.prefetched_pages, verified_pages=counters.verified_pages,
            mismatches=counters.mismatches, leaked_pages=leaked,
            statistics_match=end is not None and end == start,
            turns=counters.turns_finished, tokens_appended=counters.tokens_appended,
            conversations_started=counters.conversations_started,
            conversations_finished=counters.conversations_finished,
            conversations_rejected=counters.conversations_rejected,
            context_resets=counters.context_resets, evicted_pages=counters.evicted_pages,
            dropped_without_copy_pages=counters.dropped_without_copy_pages,
            computed_pages=counters.computed_pages, recomputed_pages=counters.recomputed_pages,
            host_copies_lost=counters.host_copies_lost,
            failed_requests=readings.failed_requests,
            cancelled_requests=readings.cancelled_requests,
            errors=counters.errors,  # failed requests are among them: counted once
            **fields)

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["ok"] = self.ok
        data["failures"] = list(self.failures)
        return data

    def write_json(self, path: str | Path, setting: str = "--json-summary") -> None:
        """Write the summary as one JSON object (blocking file write); ``OutputWriteError``
        naming ``setting`` when the write fails."""
        write_text_file(path, setting, json.dumps(self.as_dict(), indent=2) + "\n")

    def as_text(self) -> str:
        layers = self.prefetch_layers_on_time + self.prefetch_layers_late + self.prefetch_layers_wasted

        def share(n: int) -> str:
            return f"{n:,} ({n / layers:.1%})" if layers else f"{n:,}"

        def traffic(what: str, requests: int, nbytes: int, gbps: float) -> str:
            return f"  {what:<15} {requests:>8,} requests  {human_bytes(nbytes):>10}  {gbps:6.2f} GB/s"

        differ = "" if self.statistics_match else " (service statistics differ from the start)"
        lines = [
            (f"dsa-async serve summary ({self.stop_reason} after {self.duration_s:.1f} s; "
             f"{self.backend}, {self.workload}, {self.num_layers} layers, {self.device_pages} "
             f"device pages, {self.host_pool_pages} host pages of {human_bytes(self.bytes_per_page)})"),
            traffic("d2h (evict):", self.requests_d2h, self.bytes_d2h, self.gbps_d2h),
            traffic("h2d (prefetch):", self.requests_h2d, self.bytes_h2d, self.gbps_h2d),
            (f"  padding:        {human_bytes(self.padding_bytes)} "
             f"({self.padding_overhead:.1%} of the bytes moved)"),
            (f"  prefetch layers: on time {share(self.prefetch_layers_on_time)}, "
             f"late {share(self.prefetch_layers_late)}, "
             f"wasted {share(self.prefetch_layers_wasted)}"),
            (f"  pages: prefetched {self.prefetched_pages:,}, verified {self.verified_pages:,}, "
             f"MISMATCHES {self.mismatches}, leaked {self.leaked_pages}{differ}"),
            (f"  workload: {self.turns:,} turns, {self.tokens_appended:,} tokens, conversations "
             f"{self.conversations_started:,} started / {self.conversations_finished:,} finished / "
             f"{self.conversations_rejected:,} turned away, {self.context_resets} context resets"),
            (f"  cache: evicted {self.evicted_pages:,} pages, dropped without a copy "
             f"{self.dropped_without_copy_pages:,}, computed {self.computed_pages:,} "
             f"(recomputed {self.recomputed_pages:,}), host copies lost to pressure "
             f"{self.host_copies_lost:,} ({self.host_pages_reclaimed:,} pages reclaimed)"),
            (f"  forward pass: {self.forward_steps:,} steps ({self.failed_steps:,} failed), "
             f"busy {self.forward_pass_busy_s:.1f} s, waited for layers "
             f"{self.forward_pass_waited_s:.2f} s; errors {self.errors} "
             f"(failed requests {self.failed_requests}, cancelled {self.cancelled_requests})"),
            f"  verdict: {'OK' if self.ok else 'FAILED: ' + '; '.join(self.failures)}",
        ]
        return "\n".join(lines)
