"""The vectorized request forms against the general path: whole pages given as tokens (pages
in any order) and page indices given as ``Pages``. Same pages, same padding, same errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from page_seq_checks import page_seq_values

from dsa_async import Pages
from dsa_async.errors import IndexTypeError, IndexValueError, PageAlignmentError
from dsa_async.paging.runs import page_tokens
from dsa_async.paging.tokens import (
    aligned_pages,
    checked_index_array,
    pair_tokens_to_pages,
    paired_page_seqs,
    tokens_to_page_seq,
    tokens_to_pages,
)

PS = 8
BOUND_PAGES = 40
BOUND = BOUND_PAGES * PS
REFUSALS = (IndexTypeError, IndexValueError, PageAlignmentError)


def _outcome(call):
    """``("ok", result)`` or ``(error class, message)``: what a caller sees."""
    try:
        return "ok", call()
    except REFUSALS as exc:
        return type(exc), str(exc)


def _general_pages(value, bound=BOUND):
    """The general path alone: full validation, then a sort of every token."""
    array, is_range = checked_index_array(value, name="t", upper_bound=bound)
    paged = tokens_to_pages(array, PS, is_range=is_range)
    return paged.pages.tolist(), paged.padding_tokens


def _fast_pages(value, bound=BOUND):
    pages, padding = tokens_to_page_seq(value, "t", bound, PS)
    return page_seq_values(pages), padding


def _general_pairs(host, device):
    host_array, _ = checked_index_array(host, name="host_tokens", upper_bound=BOUND)
    device_array, _ = checked_index_array(device, name="device_tokens", upper_bound=BOUND)
    pairs = pair_tokens_to_pages(host_array, device_array, PS)
    return pairs.host_pages.tolist(), pairs.device_pages.tolist(), pairs.padding_tokens


def _fast_pairs(host, device):
    host_pages, device_pages, padding = paired_page_seqs(
        host, device, host_bound=BOUND, device_bound=BOUND, page_size_tokens=PS)
    return list(host_pages), list(device_pages), padding


# --- page-aligned tokens: every token of each page, pages in any order ----------------------

PERTURBATIONS = ["none", "nudge", "drop-last", "swap-in-row", "repeat-page", "shift",
                 "first-of-next-page"]


@st.composite
def aligned_like(draw):
    """Whole pages as tokens, in random order, usually valid, sometimes broken in one way."""
    pages = draw(st.lists(st.integers(-2, BOUND_PAGES + 1), min_size=1, max_size=24,
                          unique=draw(st.booleans())))
    tokens = page_tokens(np.asarray(pages, dtype=np.int64), PS)
    kind = draw(st.sampled_from(PERTURBATIONS))
    at = draw(st.integers(0, tokens.size - 1))
    if kind == "nudge":
        tokens[at] += draw(st.sampled_from([-PS, -1, 1, PS, 2**40]))
    elif kind == "drop-last":
        tokens = tokens[:-1]
    elif kind == "swap-in-row" and PS > 1:
        row = at // PS * PS
        tokens[[row, row + 1]] = tokens[[row + 1, row]]
    elif kind == "repeat-page":
        tokens = np.concatenate([tokens, tokens[at // PS * PS:at // PS * PS + PS]])
    elif kind == "shift":
        tokens = tokens + draw(st.integers(1, PS - 1))
    elif kind == "first-of-next-page":
        tokens = np.concatenate([tokens, tokens[-1:] + 1])
    return tokens


@settings(max_examples=400, deadline=None)
@given(aligned_like(), st.sampled_from(["tensor", "array"]))
def test_whole_pages_as_tokens_match_the_general_path(tokens, form):
    value = torch.from_numpy(tokens.copy()) if form == "tensor" else tokens.copy()
    assert _outcome(lambda: _fast_pages(value)) == _outcome(lambda: _general_pages(tokens))


@settings(max_examples=300, deadline=None)
@given(aligned_like(), aligned_like(), st.booleans())
def test_whole_page_pairs_match_the_general_path(host, device, as_tensors):
    n = min(host.size, device.size)
    if as_tensors:
        pair = torch.from_numpy(host[:n].copy()), torch.from_numpy(device[:n].copy())
    else:
        pair = host[:n].copy(), device[:n].copy()
    assert _outcome(lambda: _fast_pairs(*pair)) == _outcome(
        lambda: _general_pairs(host[:n], device[:n]))


def test_whole_page_pairs_of_a_host_range_and_scattered_device_pages():
    rng = np.random.default_rng(1)
    device_pages = rng.permutation(BOUND_PAGES)[:10]
    host = torch.arange(3 * PS, 13 * PS)  # a handle's pages 3..12, as tokens
    device = torch.from_numpy(page_tokens(device_pages, PS))
    assert _fast_pairs(host, device) == _general_pairs(host, device)
    assert _fast_pairs(host, device) == (list(range(3, 13)), device_pages.tolist(), 0)


@pytest.mark.parametrize("bound_pages", [4096, 2**40])  # a map of the pages, or a sort
def test_a_long_scattered_request_is_recognised_without_the_general_path(bound_pages):
    ps = 64
    pages = np.random.default_rng(0).permutation(4096)[:1024]
    tokens = page_tokens(pages, ps)
    bound = bound_pages * ps
    assert aligned_pages(tokens, ps, bound).tolist() == pages.tolist()
    assert tokens_to_page_seq(torch.from_numpy(tokens), "t", bound, ps) == (pages.tolist(), 0)
    for broken in (tokens[:-1], np.concatenate([tokens, tokens[:ps]]), tokens + 1):
        assert aligned_pages(broken, ps, bound) is None
    beyond = tokens.copy()
    beyond[-ps:] = page_tokens(np.array([bound_pages]), ps)
    assert aligned_pages(beyond, ps, bound) is None


# --- Pages: page indices given directly -------------------------------------------------------

page_lists = st.lists(st.integers(-2, BOUND_PAGES + 1), max_size=24)


def _page_forms(pages: list[int]):
    yield torch.tensor(pages, dtype=torch.int64)
    yield np.asarray(pages, dtype=np.int64)
    yield list(pages)
    yield torch.tensor(pages, dtype=torch.int32)
    if pages and pages == list(range(pages[0], pages[0] + len(pages))):
        yield range(pages[0], pages[0] + len(pages))


def _as_tokens(pages: list[int]) -> np.ndarray:
    return page_tokens(np.asarray(pages, dtype=np.int64), PS)


@settings(max_examples=300, deadline=None)
@given(page_lists)
def test_pages_given_directly_match_their_tokens(pages):
    expected = _outcome(lambda: _general_pages(_as_tokens(pages)))
    for form in _page_forms(pages):
        got = _outcome(lambda: _fast_pages(Pages(form)))
        if expected[0] == "ok":
            assert got == expected
        else:  # the same refusal, naming the page as given
            assert got[0] is expected[0], (got, expected)
            assert got[1].startswith("t.pages["), got


@settings(max_examples=300, deadline=None)
@given(page_lists, st.data())
def test_page_pairs_given_directly_match_their_tokens(host, data):
    device = data.draw(st.lists(st.integers(-1, BOUND_PAGES), min_size=len(host),
                                max_size=len(host)))
    if data.draw(st.booleans()) and host:  # pair a page twice: the same pair, or another one
        host, device = host + [host[0]], device + [data.draw(st.sampled_from(
            [device[0], device[-1], 0]))]
    expected = _outcome(lambda: _general_pairs(_as_tokens(host), _as_tokens(device)))
    got = _outcome(lambda: _fast_pairs(Pages(torch.tensor(host, dtype=torch.int64)),
                                       Pages(np.asarray(device, dtype=np.int64))))
    if expected[0] == "ok":
        assert got == expected
    else:
        assert got[0] is expected[0], (got, expected)


def test_pages_refusals_name_the_pages_as_given():
    cases = [
        (Pages(torch.tensor([3, -1])), IndexValueError, "t.pages[1] = -1 is negative"),
        (Pages([BOUND_PAGES]), IndexValueError,
         f"t.pages[0] = {BOUND_PAGES} is out of range: this side holds {BOUND_PAGES} pages"),
        (Pages(torch.tensor([1.0])), IndexTypeError, "t.pages has dtype torch.float32"),
        (Pages(torch.zeros(2, 2, dtype=torch.int64)), IndexValueError, "shape (2, 2)"),
        (Pages(np.array([2**63 + 1], dtype=np.uint64)), IndexValueError,
         f"t.pages[0] = {2**63 + 1} is out of range"),
        (Pages("12"), IndexTypeError, "got str"),
    ]
    for value, error, fragment in cases:
        with pytest.raises(error) as refused:
            tokens_to_page_seq(value, "t", BOUND, PS)
        assert fragment in str(refused.value)


def test_page_pairs_refuse_mixed_forms_unequal_lengths_and_one_page_paired_twice():
    host, device = Pages([1, 2]), torch.arange(0, 2 * PS)
    with pytest.raises(IndexTypeError, match="host_tokens is given as Pages but device_tokens"):
        _fast_pairs(host, device)
    with pytest.raises(IndexTypeError, match="device_tokens is given as Pages but host_tokens"):
        _fast_pairs(device, host)
    with pytest.raises(IndexValueError, match="host_tokens has 2 pages but device_tokens has 3"):
        _fast_pairs(host, Pages([4, 5, 6]))
    with pytest.raises(PageAlignmentError, match=r"pair 2: host page 1 is paired with two "
                                                 r"different pages \(4 and 6\)"):
        _fast_pairs(Pages([1, 2, 1]), Pages([4, 5, 6]))
    assert _fast_pairs(Pages([1, 2, 1]), Pages([4, 5, 4])) == ([1, 2], [4, 5], 0)
    assert _fast_pairs(Pages(range(2, 5)), Pages(range(7, 10))) == ([2, 3, 4], [7, 8, 9], 0)


def test_pages_is_frozen_and_holds_the_indices_as_given():
    indices = torch.tensor([5, 1])
    given_pages = Pages(indices)
    assert given_pages.pages is indices
    with pytest.raises(AttributeError):
        given_pages.pages = torch.tensor([0])
    assert "Tensor" in repr(given_pages) and "(2,)" in repr(given_pages)


# --- through the service -----------------------------------------------------------------------


async def test_pages_and_scattered_whole_page_tokens_move_the_same_bytes_as_token_lists(tmp_path):
    import asyncio

    from service_fixtures import make_service, page_bytes, tokens

    service, buffers = make_service(tmp_path, with_kv=True, host_pages=32, device_pages=24)
    async with service, asyncio.timeout(10):
        start = service.statistics()
        pages = [17, 3, 9, 4]
        expected = page_bytes(buffers, pages)
        by_pages = await service.evict(Pages(torch.tensor(pages)))
        by_tokens = await service.evict(tokens(pages))  # whole pages, scattered, as tokens
        assert by_pages.pages == by_tokens.pages == 4
        assert by_pages.padded_tokens == by_tokens.padded_tokens == 0
        for layers in buffers.values():
            for layer in layers:
                layer[pages] = 0
        # Back from each backup into other device pages, both sides given as Pages.
        targets = [[20, 1, 11, 6], [2, 21, 12, 7]]
        for backup, target in zip((by_pages, by_tokens), targets):
            host = Pages(backup.host_pages.pages)
            await service.prefetch(None, Pages(np.asarray(target)), host_tokens=host)
            got = page_bytes(buffers, target)
            for name in expected:
                for a, b in zip(expected[name], got[name]):
                    assert torch.equal(a, b)
            service.release(backup.host_pages)
        with pytest.raises(IndexValueError, match=r"device_tokens\.pages\[1\] = 24 is out of "
                                                  r"range: this side holds 24 pages"):
            service.evict(Pages([0, 24]))
        assert service.statistics() == start


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("values", [[3, 9, 10, 11, 70], list(range(16, 32)), [40 * PS + 1]])
def test_a_tensor_with_a_lazy_negation_bit_is_read_as_its_values(values, dtype):
    """A negated view (its values are only marked as negated until read) is the index it
    reads as: the same pages, padding or error as the same values held plainly, as tokens,
    as ``Pages`` and paired with host tokens; never torch's own error about the bit."""
    plain = torch.tensor(values, dtype=dtype)
    lazy = torch._neg_view(-plain)
    assert lazy.is_neg() and lazy.tolist() == values

    def both(call):
        return _outcome(lambda: call(plain)), _outcome(lambda: call(lazy))

    for call in (lambda t: tokens_to_page_seq(t, "x", BOUND, PS),
                 lambda t: tokens_to_page_seq(Pages(t), "x", BOUND, PS),
                 lambda t: paired_page_seqs(t, t, host_bound=BOUND, device_bound=BOUND,
                                            page_size_tokens=PS)):
        a, b = both(call)
        assert _comparable(a) == _comparable(b)


@pytest.mark.parametrize("values", [[3, 9, 10, 11, 70], list(range(16, 32)), [40 * PS + 1]])
def test_a_negated_view_of_valid_indices_is_refused_as_its_negative_values(values):
    """The other way round: memory holding valid indices, viewed as their negatives. What is
    read is negative, so it is refused exactly as those values held plainly are (a reader of
    the raw memory would take valid pages that the caller never named)."""
    plain = torch.tensor(values, dtype=torch.int64)
    lazy = torch._neg_view(plain)
    negative = torch.tensor([-v for v in values], dtype=torch.int64)
    for call in (lambda t: tokens_to_page_seq(t, "x", BOUND, PS),
                 lambda t: tokens_to_page_seq(Pages(t), "x", BOUND, PS),
                 lambda t: paired_page_seqs(t, t, host_bound=BOUND, device_bound=BOUND,
                                            page_size_tokens=PS)):
        outcome = _outcome(lambda: call(lazy))
        assert outcome[0] is IndexValueError, outcome
        assert _comparable(outcome) == _comparable(_outcome(lambda: call(negative)))


def _comparable(outcome):
    """An outcome of :func:`_outcome` with every page sequence as a list of ints."""
    kind, value = outcome
    if kind != "ok":
        return outcome
    return kind, tuple(v if isinstance(v, int) else page_seq_values(v) for v in value)


# --- one rule for every form: same values, same outcome ---------------------------------------


def _first_conflict_reference(host_pages, device_pages):
    """The first pair whose host page or device page was paired with another page before."""
    partner_of_host, partner_of_device = {}, {}
    for j, (h, d) in enumerate(zip(host_pages, device_pages)):
        if partner_of_host.setdefault(h, d) != d or partner_of_device.setdefault(d, h) != h:
            return j
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12))
def test_a_page_paired_twice_is_named_at_the_first_pair_that_shows_it_in_every_form(pairs):
    host = [h for h, _ in pairs]
    device = [d for _, d in pairs]
    j = _first_conflict_reference(host, device)
    as_pages = _outcome(lambda: _fast_pairs(Pages(host), Pages(device)))
    host_tokens = page_tokens(np.asarray(host, dtype=np.int64), PS)
    device_tokens = page_tokens(np.asarray(device, dtype=np.int64), PS)
    as_tokens = _outcome(lambda: _general_pairs(host_tokens, device_tokens))
    as_fast_tokens = _outcome(lambda: _fast_pairs(torch.from_numpy(host_tokens),
                                                  torch.from_numpy(device_tokens)))
    if j is None:
        assert as_pages[0] == as_tokens[0] == as_fast_tokens[0] == "ok"
        return
    assert as_pages[0] is as_tokens[0] is as_fast_tokens[0] is PageAlignmentError
    assert as_pages[1].startswith(f"pair {j}: ")
    assert as_tokens[1].startswith(f"pair {j * PS}: ")  # the first token of that page
    assert as_fast_tokens == as_tokens


def _forms_of(values: list) -> dict:
    """The same values as every accepted container (1-D and, nested once, 2-D)."""
    array = np.asarray(values)
    forms = {"list": list(values), "tuple": tuple(values), "array": array,
             "array-strided": np.repeat(array, 2)[::2], "nested-list": [list(values)],
             "nested-array": array[None, :]}
    if array.dtype.kind in "iufb":
        tensor = torch.from_numpy(array.copy())
        forms.update({"tensor": tensor, "tensor-strided": tensor.repeat_interleave(2)[::2],
                      "nested-tensor": tensor[None, :]})
    return forms


@pytest.mark.parametrize("values", [[3, 9, 17], [0.5, 8.0], [True, False], [2, -1], [BOUND]])
def test_the_same_values_in_any_container_get_the_same_outcome(values):
    """Element type first, then shape, then values: a container never changes which."""
    flat, nested = {}, {}
    for form, value in _forms_of(values).items():
        outcome = _outcome(lambda value=value: _general_pages(value))
        (nested if form.startswith("nested") else flat)[form] = (
            outcome if outcome[0] == "ok" else outcome[0])
    assert len(set(map(str, flat.values()))) == 1, flat
    assert len(set(nested.values())) == 1, nested
    kind = np.asarray(values).dtype.kind
    expected_nested = IndexTypeError if kind in "fb" else IndexValueError
    assert set(nested.values()) == {expected_nested}


def test_a_list_holding_a_tensor_torch_cannot_convert_is_a_type_error():
    grad = torch.tensor(0.0, requires_grad=True)
    for value in ([grad], [1, grad], [[grad]]):
        with pytest.raises(IndexTypeError, match="integers only"):
            _general_pages(value)
    with pytest.raises(IndexTypeError, match="integers only"):
        _fast_pages(Pages([grad]))
