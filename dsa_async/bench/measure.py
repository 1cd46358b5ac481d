"""Interleaved-pair timing: the only way a ratio is measured in the bench.

These machines are noisy (a contiguous copy varies by about 20 % from run to run), so a figure is
never one time divided by another. The reference and the subject run alternately — warm-up
(reference, subject), then ``pairs`` times (reference, subject) — and each figure is the median
of the per-pair ratios. Drift in the machine (other load, frequency, page cache) hits both halves
of a pair alike and cancels in its ratio; the median drops the outlying pairs.

Worked example: reference times ``[1.0, 1.0, 2.0]`` s and subject times ``[2.0, 4.0, 2.0]`` s give
pair ratios ``reference / subject = [0.5, 0.25, 1.0]``, median ``0.5``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: The fewest pairs a reported figure may rest on.
MIN_PAIRS = 5


@dataclass(frozen=True)
class PairTimings:
    """Seconds per run, pair by pair (``reference_s[i]`` ran just before ``subject_s[i]``)."""

    reference_s: tuple[float, ...]
    subject_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.reference_s) != len(self.subject_s) or not self.reference_s:
            raise ValueError(
                f"need the same non-zero number of reference and subject times, got "
                f"{len(self.reference_s)} and {len(self.subject_s)}"
            )
        if min(self.reference_s) <= 0 or min(self.subject_s) <= 0:
            raise ValueError("every time must be > 0 s")

    @property
    def num_pairs(self) -> int:
        return len(self.reference_s)

    def speedup(self) -> float:
        """Median over pairs of ``reference / subject``: above 1 the subject is faster."""
        return median_pair_ratio(self.reference_s, self.subject_s)

    def cost(self) -> float:
        """Median over pairs of ``subject / reference``: above 1 the subject is slower."""
        return median_pair_ratio(self.subject_s, self.reference_s)

    def median_reference_s(self) -> float:
        return statistics.median(self.reference_s)

    def median_subject_s(self) -> float:
        return statistics.median(self.subject_s)


def median_pair_ratio(numerator_s: Sequence[float], denominator_s: Sequence[float]) -> float:
    """Median of ``numerator_s[i] / denominator_s[i]`` over the pairs."""
    if len(numerator_s) != len(denominator_s) or not numerator_s:
        raise ValueError("median_pair_ratio needs two equally long, non-empty sequences")
    return float(statistics.median(n / d for n, d in zip(numerator_s, denominator_s)))


def interleaved_pairs(
    reference: Callable[[], object],
    subject: Callable[[], object],
    pairs: int,
    *,
    warmup: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    check_stop: Callable[[], None] = lambda: None,
) -> PairTimings:
    """Time ``reference`` and ``subject`` alternately, ``pairs`` times each, after one warm-up.

    Each callable must do the whole operation and return only when it is complete (on a GPU:
    after synchronizing). What it returns is dropped after the clock stops.
    The garbage collector is paused while timing, so a collection cannot land in one half of a pair.
    ``check_stop`` runs before each pair (``BenchContext.check_stop``: it raises to stop early).
    """
    if pairs < MIN_PAIRS:
        raise ValueError(f"pairs={pairs}: a figure needs at least {MIN_PAIRS} interleaved pairs")

    def timed(fn: Callable[[], object]) -> float:
        started = clock()
        result = fn()
        elapsed = clock() - started
        del result  # freed outside the timed region (unmapping memory is not the subject)
        return elapsed

    if warmup:
        timed(reference)
        timed(subject)
    reference_s: list[float] = []
    subject_s: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(pairs):
            check_stop()
            reference_s.append(timed(reference))
            subject_s.append(timed(subject))
    finally:
        if gc_was_enabled:
            gc.enable()
    return PairTimings(tuple(reference_s), tuple(subject_s))
