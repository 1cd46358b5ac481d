"""Prometheus metric families updated once per copy batch, cheaply.

``prometheus_client.Histogram.observe`` walks the buckets in Python and takes two locks per
value, and each ``Counter.inc`` checks its state and takes a lock; the service records a copy
batch's figures (and the latency of each of its requests) at once, where those costs added up
to a tenth of a request's. ``BatchHistogram`` buckets a whole batch with ``bisect`` under one
lock; ``BatchCounter`` adds to a fixed set of labelled series under one lock. The exposition
is the same as ``Histogram``'s and ``Counter``'s (``_bucket`` with cumulative ``le`` labels,
``_sum``, ``_count``; ``_total``); every series exists, at zero, from the first scrape. No
``_created`` series.

Thread-safe: the loop records, the scrape thread collects. Never blocks beyond a short lock.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BatchHistogram(Collector):
    """Histogram ``name`` with one label, ``label_name``, taking each of ``label_values``."""

    def __init__(self, name: str, documentation: str, label_name: str,
                 label_values: Sequence[str], buckets: Sequence[float]) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds) or not bounds:
            raise ValueError(f"buckets must be distinct and ascending, got {list(buckets)!r}")
        if bounds[-1] == math.inf:
            bounds.pop()  # +Inf is always there
        self.name = name
        self._documentation = documentation
        self._label_name = label_name
        self._bounds = bounds
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self._lock = threading.Lock()
        # Per label value: non-cumulative counts per bucket (the last one is +Inf), and the sum.
        self._counts = {v: [0] * (len(bounds) + 1) for v in label_values}
        self._sums = dict.fromkeys(label_values, 0.0)

    def observe_many(self, label_value: str, values: Sequence[float]) -> None:
        """Observe every value of ``values`` (each ``>= 0``) for ``label_value``. Non-blocking."""
        bounds, find = self._bounds, bisect.bisect_left  # le: value <= bound
        counts = self._counts[label_value]
        total = sum(values)
        with self._lock:
            for value in values:
                counts[find(bounds, value)] += 1
            self._sums[label_value] += total

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self._documentation, labels=[self._label_name])]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snapshot = [(v, list(c), self._sums[v]) for v, c in self._counts.items()]
        family = HistogramMetricFamily(self.name, self._documentation, labels=[self._label_name])
        for label_value, counts, total in snapshot:
            cumulative, buckets = 0, []
            for le, count in zip(self._le, counts):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric([label_value], buckets, total)
        yield family


class BatchCounter(Collector):
    """Counter ``name`` (exported as ``name_total``) with one series per key of ``series``,
    which maps each key (any hashable, e.g. an enum member) to its label values."""

    def __init__(self, name: str, documentation: str, label_names: Sequence[str],
                 series: Mapping[Hashable, Sequence[str]]) -> None:
        self.name = name
        self._documentation = documentation
        self._label_names = list(label_names)
        self._labels = {key: list(values) for key, values in series.items()}
        self._values = dict.fromkeys(series, 0.0)
        self._lock = threading.Lock()

    def inc(self, key: Hashable, amount: float = 1.0) -> None:
        """Add ``amount`` (``>= 0``, checked by the caller) to ``key``'s series. Non-blocking."""
        with self._lock:
            self._values[key] += amount

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self._documentation, labels=self._label_names)]

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snapshot = list(self._values.items())
        family = CounterMetricFamily(self.name, self._documentation, labels=self._label_names)
        for key, value in snapshot:
            family.add_metric(self._labels[key], value)
        yield family
