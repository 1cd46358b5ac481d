"""Whole-page padding, pairing and runs: the properties nothing below pages.py may break."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_async.errors import IndexTypeError, IndexValueError, PageAlignmentError
from dsa_async.paging.runs import expand_runs, is_run, page_runs, run_array
from dsa_async.paging.tokens import as_index_array, pair_tokens_to_pages, tokens_to_pages

PS = 64


@given(st.lists(st.integers(0, 5000), max_size=300))
def test_padded_pages_cover_every_requested_token(tokens):
    paged = tokens_to_pages(np.asarray(tokens, dtype=np.int64), PS)
    covered = set(paged.pages.tolist())
    assert all(t // PS in covered for t in tokens)
    assert len(covered) == paged.num_pages  # each page once
    assert paged.padding_tokens == paged.num_pages * PS - len(set(tokens))
    first_seen = list(dict.fromkeys(t // PS for t in tokens))
    assert paged.pages.tolist() == first_seen  # request order


@given(st.integers(0, 10_000), st.integers(1, 2_000))
def test_padding_of_a_contiguous_request_is_under_one_page_at_each_end(start, length):
    tokens = np.arange(start, start + length, dtype=np.int64)
    paged = tokens_to_pages(tokens, PS)
    head = start % PS
    tail = paged.num_pages * PS - head - length
    assert 0 <= head < PS and 0 <= tail < PS
    assert paged.padding_tokens == head + tail


@st.composite
def page_pairs(draw):
    n = draw(st.integers(0, 60))
    host = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n, unique=True))
    dev = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n, unique=True))
    return np.asarray(host, dtype=np.int64), np.asarray(dev, dtype=np.int64)


@given(page_pairs())
def test_runs_reproduce_the_pairs_exactly(pairs):
    src, dst = pairs
    runs = page_runs(src, dst)
    back_src, back_dst = expand_runs(runs)
    assert back_src.tolist() == src.tolist() and back_dst.tolist() == dst.tolist()
    assert (runs[:, 2] >= 1).all()


def test_contiguous_pairs_become_one_run():
    runs = page_runs(np.arange(10, 26), np.arange(3, 19))
    assert runs.tolist() == [[10, 3, 16]]


@given(page_pairs(), st.data())
def test_pairs_with_shared_offsets_map_page_to_page(pairs, data):
    host_pages, dev_pages = pairs
    offsets = np.asarray(
        data.draw(st.lists(st.integers(0, PS - 1), min_size=host_pages.size,
                           max_size=host_pages.size)), dtype=np.int64)
    result = pair_tokens_to_pages(host_pages * PS + offsets, dev_pages * PS + offsets, PS)
    assert result.host_pages.tolist() == host_pages.tolist()
    assert result.device_pages.tolist() == dev_pages.tolist()


def test_mismatched_offset_names_the_first_offending_pair():
    host = np.array([64, 65, 131, 140])
    dev = np.array([0, 1, 2, 3])
    with pytest.raises(PageAlignmentError) as err:
        pair_tokens_to_pages(host, dev, PS)
    msg = str(err.value)
    assert "pair 2" in msg and "host token 131" in msg and "offset 3" in msg
    assert "device token 2" in msg and "offset 2" in msg and "page size 64" in msg
    assert "expects page-aligned indices" not in msg


def test_one_page_paired_with_two_pages_is_refused():
    with pytest.raises(PageAlignmentError, match="pair 1: host page 1"):
        pair_tokens_to_pages(np.array([64, 65]), np.array([0, 129]), PS)
    with pytest.raises(PageAlignmentError, match="device page 0"):
        pair_tokens_to_pages(np.array([64, 129]), np.array([0, 1]), PS)


def test_mismatched_pair_lengths_are_refused():
    with pytest.raises(IndexValueError, match="3 entries.*2"):
        pair_tokens_to_pages(np.arange(3), np.arange(2), PS)


def test_empty_request_is_a_no_op():
    paged = tokens_to_pages(as_index_array(torch.empty(0, dtype=torch.int64), name="t"), PS)
    assert paged.num_pages == 0 and paged.padding_tokens == 0
    pairs = pair_tokens_to_pages(np.zeros(0, np.int64), np.zeros(0, np.int64), PS)
    assert pairs.num_pages == 0
    assert page_runs(pairs.host_pages, pairs.device_pages).shape == (0, 3)


@pytest.mark.parametrize(
    "value,error,fragment",
    [
        (torch.tensor([1, -2]), IndexValueError, "negative"),
        (torch.tensor([1, 100]), IndexValueError, "out of range"),
        (torch.tensor([1.0, 2.0]), IndexTypeError, "float"),
        (torch.tensor([True]), IndexTypeError, "bool"),
        (torch.zeros(2, 2, dtype=torch.int64), IndexValueError, "1-D"),
        (np.array([0.5]), IndexTypeError, "integers"),
        ([1, "x"], IndexTypeError, "integers"),
        ("12", IndexTypeError, "str"),
        (torch.tensor([1, 2], device="meta"), IndexTypeError, "device"),
    ],
)
def test_bad_index_input_is_refused(value, error, fragment):
    with pytest.raises(error, match=fragment):
        as_index_array(value, name="device_tokens", upper_bound=100)


def test_index_input_accepts_tensors_arrays_and_lists():
    for value in (torch.tensor([3, 4], dtype=torch.int32), np.array([3, 4]), [3, 4], range(3, 5),
                  torch.tensor([3, 9, 4])[::2], np.array([3, 9, 4])[::2]):  # strided views too
        assert as_index_array(value, name="t", upper_bound=5).tolist() == [3, 4]


@settings(max_examples=50)
@given(st.lists(st.integers(0, 2000), max_size=100))
def test_validation_never_changes_values(tokens):
    assert as_index_array(torch.tensor(tokens, dtype=torch.int64), name="t").tolist() == tokens


@pytest.mark.parametrize("upper_bound, reason", [(100, "valid 0..99"), (None, "int64")])
def test_unsigned_indices_beyond_int64_are_named_as_given(upper_bound, reason):
    value = np.array([5, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(IndexValueError, match=rf"t\[1\] = {2**64 - 1} is out of range: .*{reason}"):
        as_index_array(value, name="t", upper_bound=upper_bound)
    assert as_index_array(np.array([5, 2**63 - 1], dtype=np.uint64), name="t").tolist() == [
        5, 2**63 - 1]


_EDGES = [0, 1, 2, 499, 500, 501, (1 << 17) - 600, (1 << 17) - 1, 1 << 17, (1 << 17) + 3,
          2**40]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_EDGES), st.integers(-3, 3), st.integers(0, 700), st.integers(-1, 699))
def test_runs_are_made_and_recognised_as_numpy_would(base, shift, length, bump):
    """``run_array`` equals ``np.arange`` and ``is_run`` the plain definition, for runs inside,
    across and past the constant the short ones come from, and for arrays one value off."""
    start = max(0, base + shift)
    made = run_array(start, start + length)
    np.testing.assert_array_equal(made, np.arange(start, start + length, dtype=np.int64))
    assert made.dtype == np.int64 and made.flags.writeable
    if length == 0:
        return
    values = made.copy()
    expected = True
    if 0 <= bump < length and length > 1:  # one value off: no longer a run
        values[bump] += 1 if bump < length - 1 else -(length + 1)
        expected = bool((np.diff(values) == 1).all())
    assert is_run(values) == expected
