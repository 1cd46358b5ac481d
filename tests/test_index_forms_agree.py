"""A range and the same values as a list (or an int64 array) are the same index argument: the
same pages, or the same error class and message, whatever the step, sign or size. A range is
bounds-checked from its ends, so a huge one is refused without being materialised."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dsa_async.paging.tokens import checked_index_array

INT64_MAX = 2**63 - 1
EDGES = [0, 1, 5, 63, 64, INT64_MAX - 1, INT64_MAX, INT64_MAX + 1, 2**64, -1, -(2**63),
         -(2**63) - 1]


def _outcome(value, bound):
    try:
        array, is_range = checked_index_array(value, name="x", upper_bound=bound)
    except Exception as exc:  # noqa: BLE001 - the class and message are compared
        return type(exc), str(exc)
    return array.tolist(), is_range


@pytest.mark.parametrize("seed", range(4))
def test_a_range_and_its_values_give_the_same_outcome(seed):
    rng = random.Random(seed)
    for _ in range(2000):
        start = rng.choice(EDGES) + rng.randrange(-3, 4)
        step = rng.choice([1, 2, 3, -1, -2, 2**62, -(2**62), 2**63])
        stop = start + step * rng.randrange(0, 12) + rng.randrange(-1, 2)
        bound = rng.choice([None, 1, 7, 64, 2**40])
        r = range(start, stop, step)
        listed = [start + i * step for i in range(max(0, -(-(stop - start) // step)))]
        assert listed == list(r)
        assert _outcome(r, bound) == _outcome(listed, bound), (r, bound)
        if all(-(2**63) <= v <= INT64_MAX for v in listed):
            assert _outcome(r, bound) == _outcome(np.array(listed, dtype=np.int64), bound)


def test_a_huge_range_is_refused_at_once():
    kind, message = _outcome(range(3, 2**62), 64)
    assert kind.__name__ == "IndexValueError"
    assert message.startswith("x[61] = 64 is out of range")
