"""Queue order (the cheap check at submit agrees with the full sort key) and results."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsa_async.completion.result import TransferResult
from dsa_async.kinds import Direction
from dsa_async.scheduling.request import Request

deadlines = st.one_of(st.just(math.inf), st.floats(0, 10, allow_nan=False))


def _request(direction, priority, deadline):
    return Request(direction, range(1), None, False, None, priority, deadline, 0, 0, None)


@given(st.sampled_from(list(Direction)), st.integers(-3, 3), deadlines, st.integers(-3, 3),
       deadlines)
def test_goes_before_agrees_with_the_sort_key(direction, p1, d1, p2, d2):
    if direction is Direction.D2H:
        d1 = d2 = math.inf  # backups have no deadline
    earlier = _request(direction, p1, d1)
    later = _request(direction, p2, d2)
    assert later.goes_before(earlier) == (later.sort_key() < earlier.sort_key())


def test_transfer_result_is_a_frozen_value():
    result = TransferResult(Direction.D2H, 2, 100, 5, 0.25, None)
    assert result == TransferResult(Direction.D2H, 2, 100, 5, 0.25, None)
    assert dataclasses.replace(result, pages=3).pages == 3 and result.pages == 2
    assert dataclasses.asdict(result)["padded_tokens"] == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.pages = 4
