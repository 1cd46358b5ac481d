"""The per-request page form must agree exactly with the full numpy validation it short-cuts."""

import copy
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from page_seq_checks import page_seq_values

from dsa_async.errors import IndexTypeError, IndexValueError, PageAlignmentError
from dsa_async.paging.runs import compact, concat_pages
from dsa_async.paging.tokens import (
    pair_tokens_to_pages,
    paired_page_seqs,
    tokens_to_page_seq,
    tokens_to_pages,
)

PS = 64
BOUND = 64 * 100


def _forms(tokens: list[int]):
    """The same tokens as every index form a caller may pass."""
    array = np.asarray(tokens, dtype=np.int64)
    yield torch.tensor(tokens, dtype=torch.int64)
    yield array
    yield tokens
    yield torch.tensor(tokens, dtype=torch.int32)  # not the fast path's dtype
    if tokens and tokens == list(range(tokens[0], tokens[0] + len(tokens))):
        yield range(tokens[0], tokens[0] + len(tokens))


token_lists = st.one_of(
    st.builds(lambda start, n: list(range(start, min(start + n, BOUND))),
              st.integers(0, BOUND - 1), st.integers(0, 300)),  # ranges, the common case
    st.lists(st.integers(0, BOUND - 1), max_size=200),  # anything
    st.builds(lambda start, n, k: list(range(start, min(start + n, BOUND))) + [k],
              st.integers(0, BOUND - 2), st.integers(1, 200), st.integers(0, BOUND - 1)),
)


@given(token_lists)
def test_fast_pages_equal_full_validation(tokens):
    expected = tokens_to_pages(np.asarray(tokens, dtype=np.int64), PS)
    for form in _forms(tokens):
        pages, padding = tokens_to_page_seq(form, name="t", upper_bound=BOUND, page_size_tokens=PS)
        assert page_seq_values(pages) == expected.pages.tolist()
        assert padding == expected.padding_tokens


@given(st.integers(0, BOUND - 200), st.integers(0, 150), st.integers(0, 30), st.integers(-1, 1))
def test_fast_pairs_equal_full_validation(host_start, n, device_page, shift):
    host = list(range(host_start, host_start + n))
    device_start = device_page * PS + host_start % PS + shift  # shift != 0 breaks the offsets
    device = list(range(device_start, device_start + n)) if device_start >= 0 else []
    if len(device) != len(host):
        return
    try:
        expected = pair_tokens_to_pages(np.asarray(host, dtype=np.int64),
                                        np.asarray(device, dtype=np.int64), PS)
    except PageAlignmentError as exc:
        with pytest.raises(PageAlignmentError, match=str(exc).split(":")[0]):
            paired_page_seqs(torch.tensor(host, dtype=torch.int64),
                             torch.tensor(device, dtype=torch.int64),
                             host_bound=BOUND, device_bound=BOUND, page_size_tokens=PS)
        return
    for h, d in zip(_forms(host), _forms(device)):
        host_pages, device_pages, padding = paired_page_seqs(
            h, d, host_bound=BOUND, device_bound=BOUND, page_size_tokens=PS)
        assert list(host_pages) == expected.host_pages.tolist()
        assert list(device_pages) == expected.device_pages.tolist()
        assert padding == expected.padding_tokens


@pytest.mark.parametrize("value, error, match", [
    (torch.tensor([BOUND]), IndexValueError, "out of range"),
    (torch.tensor([-1, 0]), IndexValueError, "negative"),
    (range(BOUND - 1, BOUND + 1), IndexValueError, "out of range"),
    (range(0, 10, 2), None, None),  # a stepped range is fine, just not the fast path
    (torch.arange(4.0), IndexTypeError, "dtype"),
    (torch.arange(8)[::2], None, None),  # a strided view: read as its values
    (torch.arange(4).reshape(2, 2), IndexValueError, "1-D"),
    ("0123", IndexTypeError, "1-D integer tensor"),
])
def test_fast_path_hands_bad_input_to_full_validation(value, error, match):
    if error is None:
        pages, _ = tokens_to_page_seq(value, name="t", upper_bound=BOUND, page_size_tokens=PS)
        assert list(pages) == [0]
        return
    with pytest.raises(error, match=match):
        tokens_to_page_seq(value, name="t", upper_bound=BOUND, page_size_tokens=PS)


def test_compact_and_concat():
    assert compact(np.array([4, 5, 6])) == range(4, 7)
    assert compact(np.array([4, 6])) == [4, 6]
    assert compact(np.zeros(0, dtype=np.int64)) == range(0)
    batch = concat_pages([range(3, 5), [9, 1], range(0)], 4)
    assert batch.dtype == np.int64 and batch.tolist() == [3, 4, 9, 1]


def test_long_page_lists_keep_a_private_array_that_batches_read():
    source = np.random.default_rng(0).permutation(4096)[:1024].astype(np.int64)
    pages = compact(source)
    assert page_seq_values(pages) == source.tolist()
    expected = source.tolist()
    source[:] = 0  # the caller's array changing later changes nothing the request holds
    assert page_seq_values(pages) == expected
    assert concat_pages([pages], len(pages)).tolist() == expected
    # Mixed with other forms: one array of every page, in order.
    batch = concat_pages([range(5000, 5002), pages, [7]], len(pages) + 3)
    assert batch.tolist() == [5000, 5001, *expected, 7]
    # A copy or a pickle (any protocol) is a plain list: no array that could disagree with it.
    for other in (copy.copy(pages), copy.deepcopy(pages),
                  *(pickle.loads(pickle.dumps(pages, protocol))
                    for protocol in range(pickle.HIGHEST_PROTOCOL + 1))):
        assert type(other) is list and other == expected


@pytest.mark.parametrize("n", [513, 5000])
def test_large_token_ranges_are_recognised_and_near_misses_are_not(n):
    tokens = torch.arange(100, 100 + n)
    pages, padding = tokens_to_page_seq(tokens, "t", 10 * n, PS)
    assert pages == range(100 // PS, (100 + n - 1) // PS + 1)
    swapped = tokens.clone()
    swapped[[7, 8]] = swapped[[8, 7]]  # same span, same values, not ascending
    expected = tokens_to_pages(swapped.numpy(), PS)
    pages, padding = tokens_to_page_seq(swapped, "t", 10 * n, PS)
    assert list(pages) == expected.pages.tolist() and padding == expected.padding_tokens
