"""BatchHistogram and BatchCounter expose exactly what prometheus_client's Histogram and Counter
do for the same values (apart from the ``_created`` series)."""

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from dsa_async.observability.batch_metrics import BatchCounter, BatchHistogram
from dsa_async.observability.metrics import DURATION_BUCKETS_S

values = st.lists(st.one_of(st.sampled_from(DURATION_BUCKETS_S),  # exactly on a bound: le
                            st.floats(0, 20, allow_nan=False)), max_size=60)


def _samples(registry):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


@given(values, values)
def test_same_exposition_as_a_prometheus_histogram(first, second):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("x_seconds", "help", "direction", ["d2h", "h2d"], DURATION_BUCKETS_S)
    ours.register(batch)
    reference = Histogram("x_seconds", "help", ["direction"], buckets=DURATION_BUCKETS_S,
                          registry=theirs)
    for label in ("d2h", "h2d"):
        reference.labels(direction=label)
    batch.observe_many("d2h", first)
    batch.observe_many("h2d", second)
    for v in first:
        reference.labels(direction="d2h").observe(v)
    for v in second:
        reference.labels(direction="h2d").observe(v)
    got, want = _samples(ours), _samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


def test_concurrent_observations_are_all_counted():
    registry = CollectorRegistry()
    batch = BatchHistogram("y_seconds", "help", "direction", ["d2h"], DURATION_BUCKETS_S)
    registry.register(batch)

    def observe() -> None:
        for _ in range(200):
            batch.observe_many("d2h", [1e-4, 2.0])
            list(registry.collect())  # scrapes interleave with observations

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.get_sample_value("y_seconds_count", {"direction": "d2h"}) == 1600
    assert registry.get_sample_value("y_seconds_bucket", {"direction": "d2h", "le": "0.0001"}) == 800


def test_unsorted_buckets_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        BatchHistogram("z", "help", "direction", ["d2h"], [1.0, 0.5])


@given(st.lists(st.tuples(st.sampled_from(["d2h", "h2d"]), st.integers(0, 10**9)), max_size=30))
def test_counter_has_the_same_exposition_as_a_prometheus_counter(increments):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchCounter("x_bytes", "help", ["direction"], {d: (d,) for d in ("d2h", "h2d")})
    ours.register(batch)
    reference = Counter("x_bytes", "help", ["direction"], registry=theirs)
    for label in ("d2h", "h2d"):
        reference.labels(direction=label)
    for label, amount in increments:
        batch.inc(label, amount)
        reference.labels(direction=label).inc(amount)
    assert _samples(ours) == _samples(theirs)
    text = [line for line in generate_latest(theirs).decode().splitlines()
            if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == text
