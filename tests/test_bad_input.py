"""Every kind of bad input is refused at the door with its own error class and a message that
names the offending value and says what to change, and a refusal changes nothing: the service's
statistics are the same before and after."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fake_roots import GIB, make_root
from service_fixtures import PAGE, make_service, tokens

from dsa_async import HostPages, PageGeometry, Pages, Transfer
from dsa_async.cli import main as cli_main
from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    ConfigError,
    DsaAsyncError,
    HostBudgetExceeded,
    HostPoolExhausted,
    IndexTypeError,
    IndexValueError,
    PageAlignmentError,
    PagesInFlightError,
    UnknownHostPagesError,
)
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer, mla_kv, model_pools
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.transfer.buffers import bind_pool, check_disjoint

BOUND_S = 10
DEVICE_PAGES = 24
HOST_PAGES = 32


class CliRefused(Exception):
    """The command line returned a non-zero exit code; the message is its stderr."""


@dataclass
class Ctx:
    tmp_path: object
    capsys: object
    cleanups: list[Callable[[], object]] = field(default_factory=list)
    others: list[OffloadService] = field(default_factory=list)

    async def other_service(self) -> OffloadService:
        other, _ = make_service(self.tmp_path / "other")
        await other.start()
        self.others.append(other)
        return other


def cli(ctx: Ctx, *argv: str) -> None:
    ctx.capsys.readouterr()
    try:
        code = cli_main(list(argv))
    except SystemExit as exc:  # argparse may exit instead of returning
        code = exc.code
    err = ctx.capsys.readouterr().err
    if code != 0:
        raise CliRefused(f"exit {code}: {err}")


@dataclass(frozen=True)
class Case:
    id: str
    act: Callable  # act(service, prepared) or, without a service, act(ctx)
    error: type[BaseException]
    fragments: tuple[str, ...]
    setup: Callable | None = None  # async setup(service, ctx) -> prepared
    service: bool = True


# --- setups (state the refused call runs against; taken before the statistics snapshot) ------


async def allocated(service, ctx):
    return service.allocate_host_pages(2)


async def released(service, ctx):
    host = service.allocate_host_pages(1)
    service.release(host)
    return host


async def foreign(service, ctx):
    other = await ctx.other_service()
    return other.allocate_host_pages(1)


def _gated(service, ctx, host, submit):
    """``submit(gate)``'s transfer, held by ``gate`` until the test's clean-up opens it, awaits
    the transfer and releases ``host``."""
    gate = threading.Event()
    transfer = submit(gate)

    async def finish():
        gate.set()
        await transfer
        service.release(host)

    ctx.cleanups.append(finish)
    return transfer


async def held_by_a_copy(service, ctx):
    host = service.allocate_host_pages(1)
    _gated(service, ctx, host, lambda gate: service.evict(
        tokens([0]), host_tokens=host.token_indices(), after=gate))
    return host


async def service_owned(service, ctx):
    """A handle the service took over: a backup into pages it placed, cancelled once in the
    engine, whose pages a later copy still uses (the service frees them when that copy ends)."""
    gate, later_gate = threading.Event(), threading.Event()
    backup = service.evict(tokens([0]), after=gate)
    while backup.host_pages is None:  # placed once its copy is submitted
        await asyncio.sleep(0.001)
    handle = backup.host_pages
    later = service.evict(tokens([1]), host_tokens=handle.token_indices(), after=later_gate)
    backup.cancel()  # in the engine: it ends cancelled, its pages the service's
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await backup

    async def finish():
        later_gate.set()
        await later

    ctx.cleanups.append(finish)
    return handle


async def eviction(service, ctx):
    backup = service.evict(tokens([0]))
    result = await backup
    ctx.cleanups.append(_released(service, result.host_pages))
    return backup


async def prefetch(service, ctx):
    host = service.allocate_host_pages(1)
    return _gated(service, ctx, host,
                  lambda gate: service.prefetch(host, tokens([0]), after=gate))


def _released(service, host):
    async def release():
        service.release(host)
    return release


class _NoByteView(torch.Tensor):
    """A tensor type whose rules forbid a byte view (as some wrapper subclasses do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.view and any(a is torch.uint8 for a in args[1:]):
            raise RuntimeError("this tensor type has no byte view")
        return super().__torch_function__(func, types, args, kwargs or {})


#: Tensors of the right size whose memory torch cannot see as raw bytes (a quantized one
#: could crash the process when viewed so); each must be a ConfigError at start.
_OPAQUE_BUFFERS = {
    "quantized": lambda pages, row: torch.quantize_per_tensor(
        torch.zeros(pages, row), 1.0, 0, torch.quint8),
    "conjugated": lambda pages, row: torch.zeros(pages, row // 8, dtype=torch.complex64).conj(),
    "negated": lambda pages, row: torch.zeros(pages, row // 8, dtype=torch.int64)._neg_view(),
    "nested": lambda pages, row: torch.nested.nested_tensor(
        [torch.zeros(row, dtype=torch.uint8)] * pages),
    "sparse": lambda pages, row: torch.zeros(pages, row, dtype=torch.uint8).to_sparse(),
    "no-byte-view": lambda pages, row: torch.zeros(pages, row, dtype=torch.uint8).as_subclass(
        _NoByteView),
}


async def _start_with(ctx, *, device: str = "cpu", pages: int = 2, shared: str = ""):
    geometry = dsa_indexer(num_layers=2)
    buffers = [torch.zeros(pages, geometry.bytes_per_page_per_layer, dtype=torch.uint8,
                           device=device) for _ in range(2)]
    if shared == "same-tensor":  # one tensor passed for every layer
        buffers = [buffers[0]] * 2
    elif shared in _OPAQUE_BUFFERS:  # memory that is not the elements, densely
        with warnings.catch_warnings():  # quantized and nested tensors warn when made
            warnings.simplefilter("ignore")
            buffers = [_OPAQUE_BUFFERS[shared](pages, geometry.bytes_per_page_per_layer)
                       for _ in range(2)]
    elif shared == "quantized-3d":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buffers = _OPAQUE_BUFFERS["quantized"](2 * pages, geometry.bytes_per_page_per_layer
                                                   ).view(2, pages, -1)
    elif shared == "overlapping-views":  # views of one allocation one page apart, 2 pages long
        whole = torch.zeros(pages + 1, geometry.bytes_per_page_per_layer, dtype=torch.uint8)
        buffers = [whole[:pages], whole[1:]]
    config = ServiceConfig(geometries=(geometry,), host_pool=PoolSize(pages=4), backend="cpu",
                           ledger_directory=str(ctx.tmp_path / "start-ledger"))
    service = OffloadService(config, buffers)
    try:
        await service.start()
    finally:
        await service.close()
        assert HostLedger(ctx.tmp_path / "start-ledger").entries() == ()


class _HasWait:
    """Has a wait() but is not a producer of any backend (an asyncio-style coroutine wait)."""

    async def wait(self) -> None:
        return None


def _config(**kwargs):
    kwargs.setdefault("backend", "cpu")
    return ServiceConfig(geometries=(dsa_indexer(num_layers=3),), **kwargs)


async def _over_budget(ctx):
    root = make_root(ctx.tmp_path, mem_total_bytes=64 * GIB, mem_available_bytes=48 * GIB)
    ledger = ctx.tmp_path / "budget-ledger"
    config = _config(host_pool=PoolSize(bytes=10**15), budget_root=str(root),
                     ledger_directory=str(ledger), reserve_bytes=0)
    service = OffloadService(config, make_service(ctx.tmp_path)[1]["indexer"])
    try:
        await service.start()
    finally:
        assert HostLedger(ledger).entries() == ()  # refused before anything was reserved
        assert service.state.value == "closed"


CASES = [
    # index tensors
    Case("negative", lambda s, _: s.evict(torch.tensor([3, -3])), IndexValueError,
         ("device_tokens[1] = -3", "start at 0")),
    Case("out-of-range", lambda s, _: s.evict(torch.tensor([DEVICE_PAGES * PAGE])),
         IndexValueError, (f"= {DEVICE_PAGES * PAGE}", f"valid 0..{DEVICE_PAGES * PAGE - 1}")),
    Case("float", lambda s, _: s.evict(torch.tensor([1.0, 2.0])), IndexTypeError,
         ("torch.float32", ".long()")),
    Case("2-D", lambda s, _: s.evict(torch.zeros((2, 3), dtype=torch.int64)), IndexValueError,
         ("shape (2, 3)", ".reshape(-1)")),
    Case("wrong-device", lambda s, _: s.evict(torch.arange(4, device="meta")), IndexTypeError,
         ("device meta", ".cpu()")),
    Case("none-in-a-list", lambda s, _: s.evict([1, None]), IndexTypeError,
         ("device_tokens[1] = None", "integers only")),
    Case("ragged-list", lambda s, _: s.evict([[1], [2, 3]]), IndexTypeError,
         ("device_tokens[0] = [1] is a list", "flatten")),
    Case("pages-as-host", lambda s, _: s.prefetch(Pages([0]), Pages([1])), IndexTypeError,
         ("got Pages", "host_tokens=Pages(")),
    Case("host-out-of-range", lambda s, h: s.evict(
        torch.tensor([0]), host_tokens=torch.tensor([HOST_PAGES * PAGE])), IndexValueError,
        (f"host_tokens[0] = {HOST_PAGES * PAGE}", f"valid 0..{HOST_PAGES * PAGE - 1}")),
    Case("out-of-range-names-the-pair", lambda s, h: s.evict(
        tokens([0]), host_tokens=tokens([HOST_PAGES])), IndexValueError,
        (f"host_tokens[0] = {HOST_PAGES * PAGE}", f"valid 0..{HOST_PAGES * PAGE - 1}")),
    Case("negative-names-the-pair", lambda s, _: s.evict(torch.tensor([3, -1, -5])),
         IndexValueError, ("device_tokens[1] = -1", "start at 0")),
    Case("prefetch-negative", lambda s, h: s.prefetch(h, torch.tensor([-1])), IndexValueError,
         ("device_tokens[0] = -1", "start at 0"), setup=allocated),
    # index containers whose values are not what they look like
    Case("masked-array", lambda s, _: s.evict(np.ma.array([1, 10**12], mask=[False, True])),
         IndexTypeError, ("masked array", ".compressed()")),
    Case("masked-pages", lambda s, _: s.evict(Pages(np.ma.array([1, 2], mask=[False, True]))),
         IndexTypeError, ("device_tokens.pages is a masked array",)),
    Case("bit-dtype", lambda s, _: s.evict(torch.empty(2, dtype=torch.bits8)), IndexTypeError,
         ("torch.bits8", ".long()")),
    Case("sparse-tensor", lambda s, _: s.evict(torch.tensor([1, 2]).to_sparse()),
         IndexTypeError, ("sparse", ".to_dense()")),
    Case("huge-range", lambda s, _: s.evict(range(0, 2**62)), IndexValueError,
         (f"device_tokens[{DEVICE_PAGES * PAGE}] = {DEVICE_PAGES * PAGE}",
          f"valid 0..{DEVICE_PAGES * PAGE - 1}")),
    Case("huge-pages-range", lambda s, _: s.evict(Pages(range(5, 2**62, 3))), IndexValueError,
         ("device_tokens.pages[7] = 26", f"valid 0..{DEVICE_PAGES - 1}")),
    Case("descending-range-below-zero", lambda s, _: s.evict(range(3, -9, -2)), IndexValueError,
         ("device_tokens[2] = -1", "start at 0")),
    Case("int-past-int64", lambda s, _: s.evict([0, 2**64]), IndexValueError,
         (f"device_tokens[1] = {2**64}", "out of range")),
    Case("bool-in-a-list", lambda s, _: s.evict([0, True]), IndexTypeError,
         ("device_tokens[1] = True", "bool")),
    # pairs
    Case("pair-lengths", lambda s, h: s.evict(tokens([0, 1]), host_tokens=h.token_indices()[:100]),
         IndexValueError, ("host_tokens has 100 entries", "device_tokens has 128", "same length"),
         setup=allocated),
    Case("pair-offsets", lambda s, h: s.evict(torch.tensor([65, 66]),
                                              host_tokens=h.token_indices()[:2]),
         PageAlignmentError, ("pair 0", "host token", "offset 1", "share their in-page offset"),
         setup=allocated),
    Case("prefetch-pages-mismatch", lambda s, h: s.prefetch(h, tokens([0, 1, 2])), IndexValueError,
         ("cover 3 pages", "holds 2"), setup=allocated),
    Case("bare-tensor-host", lambda s, h: s.prefetch(h.token_indices(), tokens([0, 1])),
         IndexTypeError, ("got Tensor", "host_tokens=tensor"), setup=allocated),
    Case("no-host-side", lambda s, _: s.prefetch(None, tokens([0])), IndexValueError,
         ("needs the host side", "host_tokens=")),
    Case("unallocated-host-tokens", lambda s, _: s.evict(tokens([0]), host_tokens=tokens([5])),
         UnknownHostPagesError, ("host page 5", "allocate_host_pages()")),
    # host page handles
    Case("foreign-handle", lambda s, h: s.prefetch(h, tokens([0])), UnknownHostPagesError,
         ("another service", "use a handle returned by this service"), setup=foreign),
    Case("foreign-release", lambda s, h: s.release(h), UnknownHostPagesError,
         ("another service", "release it once"), setup=foreign),
    Case("released-handle", lambda s, h: s.prefetch(h, tokens([0])), UnknownHostPagesError,
         ("HostPages(allocation=", "already released"), setup=released),
    Case("double-release", lambda s, h: s.release(h), UnknownHostPagesError,
         ("already released", "release it once"), setup=released),
    Case("release-in-flight", lambda s, h: s.release(h), PagesInFlightError,
         ("1 of its 1 pages are in flight", "await the transfer"), setup=held_by_a_copy),
    Case("release-not-a-handle", lambda s, h: s.release(h.token_indices()), ArgumentTypeError,
         ("HostPages handle", "got Tensor"), setup=allocated),
    Case("release-none", lambda s, _: s.release(None), ArgumentTypeError,
         ("HostPages handle", "got NoneType")),
    Case("release-threadsafe-not-a-handle", lambda s, h: s.release_threadsafe([h]),
         ArgumentTypeError, ("HostPages handle", "got list"), setup=allocated),
    Case("prefetch-service-owned-handle", lambda s, h: s.prefetch(h, tokens([0])),
         UnknownHostPagesError, ("frees itself",), setup=service_owned),
    Case("host-tokens-service-owned", lambda s, h: s.evict(
        tokens([2]), host_tokens=h.token_indices()), UnknownHostPagesError,
        ("host page", "allocation was released", "live allocation"), setup=service_owned),
    # waits
    Case("wait-layer-of-an-eviction", lambda s, t: t.wait_layer(0), ArgumentTypeError,
         ("belongs to prefetches",), setup=eviction),
    Case("wait-layer-float", lambda s, t: t.wait_layer(1.0), ArgumentTypeError,
         ("layer must be an int", "float"), setup=prefetch),
    Case("wait-layer-out-of-range", lambda s, t: t.wait_layer(3), ArgumentValueError,
         ("layer 3 is out of range", "(0..2)"), setup=prefetch),
    Case("wait-timeout-type", lambda s, t: t.wait(timeout_s="1"), ArgumentTypeError,
         ("timeout_s", "'1'"), setup=prefetch),
    Case("wait-timeout-negative", lambda s, t: t.wait_layer(0, timeout_s=-1), ArgumentValueError,
         ("timeout_s", ">= 0", "-1"), setup=prefetch),
    Case("wait-timeout-nan", lambda s, t: t.wait_layer(0, timeout_s=float("nan")),
         ArgumentValueError, ("timeout_s", "nan"), setup=prefetch),
    # sizes and scalars
    Case("allocate-zero", lambda s, _: s.allocate_host_pages(0), ArgumentValueError,
         ("got 0", "at least 1")),
    Case("allocate-negative", lambda s, _: s.allocate_host_pages(-1), ArgumentValueError,
         ("got -1", "at least 1")),
    Case("allocate-not-an-int", lambda s, _: s.allocate_host_pages(2.0), ArgumentTypeError,
         ("got 2.0", "must be an int")),
    Case("allocate-too-many", lambda s, _: s.allocate_host_pages(HOST_PAGES + 1),
         HostPoolExhausted, (f"needed {HOST_PAGES + 1}", f"capacity {HOST_PAGES}",
                             "raise ServiceConfig.host_pool")),
    Case("priority-type", lambda s, _: s.evict(tokens([0]), priority="high"), ArgumentTypeError,
         ("'high'", "must be an int")),
    Case("deadline-inf", lambda s, h: s.prefetch(h, tokens([0, 1]), deadline_s=float("inf")),
         ArgumentValueError, ("inf", "finite number of seconds"), setup=allocated),
    Case("deadline-int-beyond-a-float", lambda s, h: s.prefetch(h, tokens([0, 1]),
                                                                deadline_s=10**400),
         ArgumentValueError, ("finite number of seconds", "401 digits", "None for no deadline"),
         setup=allocated),
    Case("deadline-negative-int-beyond-a-float", lambda s, h: s.prefetch(
        h, tokens([0, 1]), deadline_s=-10**400), ArgumentValueError, ("401 digits",),
        setup=allocated),
    Case("deadline-type", lambda s, h: s.prefetch(h, tokens([0, 1]), deadline_s="soon"),
         ArgumentTypeError, ("'soon'", "finite number of seconds"), setup=allocated),
    Case("after-not-a-producer", lambda s, _: s.evict(tokens([0]), after="kernel"), ArgumentTypeError,
         ("after='kernel'", "threading.Event", "concurrent.futures.Future", "Transfer",
          "asyncio.Event", "list/tuple")),
    Case("after-an-object-with-wait", lambda s, _: s.evict(tokens([0]), after=_HasWait()),
         ArgumentTypeError, ("_HasWait", "threading.Event")),
    Case("after-in-a-list", lambda s, _: s.evict(tokens([0]), after=[threading.Event(), 3]),
         ArgumentTypeError, ("after=3", "list/tuple")),
    Case("after-nested", lambda s, _: s.evict(tokens([0]), after=[[threading.Event()]]),
         ArgumentTypeError, ("flat list/tuple", "flatten")),
    # configuration
    Case("config-backend", lambda ctx: _config(backend="tpu"), ConfigError,
         ("backend='tpu'", "use one of", "'cpu'"), service=False),
    Case("config-pool-pages", lambda ctx: PoolSize(pages=0), ConfigError,
         ("PoolSize.pages", "got 0", "use auto"), service=False),
    Case("config-pool-below-one-page",  # one page of 3 layers: 3 * 64 * 132 = 25,344 B
         lambda ctx: _config(host_pool=PoolSize(bytes=25_343)), ConfigError,
         ("PoolSize(bytes=25,343)", "holds no whole page", "25,344 B", "PoolSize.auto()"),
         service=False),
    Case("config-pool-type", lambda ctx: _config(host_pool=5), ConfigError,
         ("got 5", "PoolSize(pages=...)"), service=False),
    Case("config-timeout", lambda ctx: _config(host_wait_timeout_s=-1), ConfigError,
         ("host_wait_timeout_s", "got -1", "positive finite"), service=False),
    Case("config-timeout-int-beyond-a-float",
         lambda ctx: _config(drain_timeout_s=10**400), ConfigError,
         ("drain_timeout_s", "401 digits", "positive finite"), service=False),
    Case("config-ledger-path", lambda ctx: _config(ledger_directory=5), ConfigError,
         ("ledger_directory", "directory path", "got 5"), service=False),
    Case("config-budget-root", lambda ctx: _config(budget_root=b"/proc"), ConfigError,
         ("budget_root", "directory path", "bytes"), service=False),
    Case("config-device-elsewhere", lambda ctx: _start_with(ctx, device="meta"), ConfigError,
         ("device buffers are on meta", "backend 'cuda'"), service=False),
    Case("config-no-device-pages", lambda ctx: _start_with(ctx, pages=0), ConfigError,
         ("hold no pages", "at least one page"), service=False),
    Case("config-one-tensor-for-every-layer",
         lambda ctx: _start_with(ctx, shared="same-tensor"), ConfigError,
         ("layer 0", "layer 1", "share 16,896 B", "pages of its own"), service=False),
    Case("config-overlapping-layer-views",
         lambda ctx: _start_with(ctx, shared="overlapping-views"), ConfigError,
         ("layer 0", "layer 1", "share 8,448 B", "not the same tensor twice"), service=False),
    *(Case(f"config-{kind}-device-buffers",
           functools.partial(lambda ctx, kind: _start_with(ctx, shared=kind), kind=kind),
           ConfigError, ("layer 0" if kind != "quantized-3d" else "the device tensor", fragment),
           service=False)
      for kind, fragment in (("quantized", "quantized tensor"), ("quantized-3d", "quantized"),
                             ("conjugated", "lazily conjugated"), ("negated", "lazily negated"),
                             ("nested", "nested tensor"), ("sparse", "sparse_coo tensor"),
                             ("no-byte-view", "cannot be viewed as raw bytes"))),
    Case("config-model", lambda ctx: model_pools("llama"), ConfigError,
         ("'llama'", "deepseek-v3.2"), service=False),
    Case("config-kv-dtype", lambda ctx: mla_kv("fp4"), ConfigError,
         ("'fp4'", "'fp8'", "'bf16'"), service=False),
    # command line (exit 2, stderr names the value and the accepted ones)
    Case("cli-model", lambda ctx: cli(ctx, "plan", "--model", "llama", "--host-pool-gb", "1"),
         CliRefused, ("exit 2", "'llama'", "choose from", "deepseek-v3.2"), service=False),
    Case("cli-kv-dtype", lambda ctx: cli(ctx, "plan", "--kv-dtype", "fp4", "--host-pool-gb", "1"),
         CliRefused, ("exit 2", "'fp4'", "choose from", "'fp8'"), service=False),
    Case("cli-host-pool-gb", lambda ctx: cli(ctx, "plan", "--host-pool-gb", "abc"), CliRefused,
         ("exit 2", "--host-pool-gb", "'abc'", "not a number of GB"), service=False),
    # budget
    Case("over-budget", _over_budget, HostBudgetExceeded,
         ("requested:", "available:", "--host-pool-gb / ServiceConfig.host_pool", "to fix:"),
         service=False),
]


PARAMS = [pytest.param(c, id=c.id) for c in CASES]


@pytest.mark.parametrize("case", PARAMS)
async def test_bad_input_is_refused(case: Case, tmp_path, capsys):
    ctx = Ctx(tmp_path, capsys)
    if not case.service:
        with pytest.raises(case.error) as refused:
            outcome = case.act(ctx)
            if inspect.isawaitable(outcome):
                await outcome
        _check_message(case, refused.value)
        return
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        prepared = await case.setup(service, ctx) if case.setup else None
        before = service.statistics()
        with pytest.raises(case.error) as refused:
            case.act(service, prepared)
        _check_message(case, refused.value)
        assert service.statistics() == before, "a refused call changed the service's state"
        for cleanup in ctx.cleanups:
            await cleanup()
        if case.setup is allocated:
            service.release(prepared)
        assert service.statistics() == start
        for other in ctx.others:
            await other.close()
    assert HostLedger(tmp_path / "ledger").entries() == ()


def _check_message(case: Case, error: BaseException) -> None:
    assert type(error) is case.error or (case.error is TypeError and isinstance(error, TypeError))
    message = str(error)
    for fragment in case.fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"



@pytest.mark.parametrize("form", ["tensor", "array"])
async def test_uint64_tokens_above_int64_are_reported_as_given(form, tmp_path):
    """A uint64 index of 2**63 or more does not fit the int64 page table. The refusal names the
    value as given and says it is out of range, not a wrapped negative the caller never passed."""
    given = [3, 2**63 + 5]
    value = (torch.tensor(given, dtype=torch.uint64) if form == "tensor"
             else np.array(given, dtype=np.uint64))
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        before = service.statistics()
        for side, call in (("device_tokens", lambda: service.evict(value)),
                           ("host_tokens", lambda: service.evict(torch.tensor([0, 1]),
                                                                 host_tokens=value))):
            with pytest.raises(IndexValueError) as refused:
                call()
            message = str(refused.value)
            assert f"{side}[1] = {2**63 + 5} is out of range" in message, message
            assert "negative" not in message
        assert service.statistics() == before


#: Ints no float or int64 holds; the second is also beyond what ``str()`` converts (4,300
#: digits), so even building a message that shows it as digits fails.
HUGE_INTS = [pytest.param(sign * value, id=f"{'-' if sign < 0 else ''}{name}")
             for name, value in (("1e400", 10**400), ("1e5000", 10**5000)) for sign in (1, -1)]


@pytest.mark.parametrize("huge", HUGE_INTS)
async def test_every_numeric_argument_takes_an_int_of_any_size_or_refuses_it_clearly(
        tmp_path, huge):
    """Python ints have no bound: each numeric argument either accepts one far beyond a float
    or an int64 (a priority, a timeout that means no bound) or refuses it with the service's
    own error, never a builtin ``OverflowError`` or ``ValueError`` from deep inside or from
    the refusal's own message, and a refusal changes nothing."""
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        load = service.prefetch(held, tokens([0, 1]))
        await load
        calls = {
            "deadline_s": lambda: service.prefetch(held, tokens([0, 1]), deadline_s=huge),
            "priority": lambda: service.evict(tokens([2]), priority=huge),
            "num_pages": lambda: service.allocate_host_pages(huge),
            "layer": lambda: load.wait_layer(huge),
            "timeout_s": lambda: load.wait_layer(0, timeout_s=huge),
            "wait timeout_s": lambda: load.wait(timeout_s=huge),
            "token in a list": lambda: service.evict([huge]),
            "token range": lambda: service.evict(range(huge, huge + 1)),
            "page": lambda: service.evict(Pages([huge])),
            "host token": lambda: service.evict(tokens([3]), host_tokens=range(huge, huge + PAGE)),
            "forged handle": lambda: service.release(HostPages(((huge, 1),), huge, PAGE)),
        }
        for name, call in calls.items():
            before = service.statistics()
            try:
                outcome = call()
            except DsaAsyncError:
                assert service.statistics() == before, f"a refused {name} changed the state"
                continue
            if isinstance(outcome, Transfer):
                result = await outcome
                if result.host_pages is not None:
                    service.release(result.host_pages)
        thread_calls = (lambda: service.prefetch_threadsafe(held, tokens([0, 1]), deadline_s=huge),
                        lambda: service.evict_threadsafe([huge]))

        def from_a_thread() -> None:
            for call in thread_calls:
                with pytest.raises(DsaAsyncError):
                    call()

        await asyncio.to_thread(from_a_thread)
        service.release(held)


_SIZE_SETTINGS = {
    "PoolSize.pages": lambda v: PoolSize(pages=v),
    "PoolSize.bytes": lambda v: PoolSize(bytes=v),
    "PoolSize.max_pages": lambda v: PoolSize(max_pages=v),
    "ServiceConfig.max_inflight_bytes_d2h": lambda v: _config(max_inflight_bytes_d2h=v),
    "ServiceConfig.max_inflight_bytes_h2d": lambda v: _config(max_inflight_bytes_h2d=v),
    "ServiceConfig.max_queued_requests": lambda v: _config(max_queued_requests=v),
    "ServiceConfig.reserve_bytes": lambda v: _config(reserve_bytes=v),
    "ServiceConfig.device_staging_bytes": lambda v: _config(device_staging_bytes=v),
    "num_layers": lambda v: dsa_indexer(num_layers=v),
    "bytes_per_token_per_layer": lambda v: PageGeometry("g", v, 2),
    "page_size_tokens": lambda v: PageGeometry("g", 132, 2, page_size_tokens=v),
}


@pytest.mark.parametrize("value", [2**63, *HUGE_INTS])
@pytest.mark.parametrize("setting", list(_SIZE_SETTINGS))
def test_size_settings_beyond_int64_are_refused_at_construction(setting, value):
    """Sizes and counts are int64 in every tensor and page table: one beyond it (or below the
    setting's minimum by any amount) is a ``ConfigError`` naming the setting, raised where the
    configuration is built, never an error from a budget message or a tensor much later."""
    with pytest.raises(ConfigError) as refused:
        _SIZE_SETTINGS[setting](value)
    message = str(refused.value)
    assert setting in message, message
    if value > 0:
        assert "at most 9,223,372,036,854,775,807" in message, message
    if abs(value) > 10**300:
        assert "digits" in message and len(message) < 300, message


def test_largest_int64_size_is_accepted():
    """The bound is int64 itself, not below it: construction accepts 2**63 - 1 (the budget,
    not the type, refuses a pool that large when the service starts)."""
    assert PoolSize(pages=2**63 - 1).pages == 2**63 - 1
    assert _config(max_queued_requests=2**63 - 1).max_queued_requests == 2**63 - 1


def test_a_pool_of_exactly_one_page_in_bytes_is_accepted():
    assert _config(host_pool=PoolSize(bytes=25_344)).host_pool.bytes == 25_344


_INT_KINDS = [pytest.param(lambda v: v, id="int"), pytest.param(np.int64, id="np.int64"),
              pytest.param(np.int32, id="np.int32"), pytest.param(np.uint8, id="np.uint8")]
_NOT_INTS = [pytest.param(True, id="bool"), pytest.param(np.True_, id="np.bool_"),
             pytest.param(2.0, id="float"), pytest.param(np.float32(2), id="np.float32"),
             pytest.param("2", id="str")]


@pytest.mark.parametrize("kind", _INT_KINDS)
async def test_int_and_seconds_arguments_take_every_integer_and_real_type_alike(tmp_path, kind):
    """Every int argument (priority, num_pages, layer) takes any integer type as the same
    int, and every seconds argument (deadline_s, timeout_s) any real number type, numpy's
    included: a caller's numpy scalar is never refused in one place and taken in another."""
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(kind(2))
        assert held.num_pages == 2
        load = service.prefetch(held, tokens([0, 1]), priority=kind(3), deadline_s=kind(5))
        await load
        load.wait_layer(kind(1), timeout_s=kind(1))
        assert (await asyncio.to_thread(load.wait, kind(1))).pages == 2
        assert (await asyncio.to_thread(load.wait, np.float32(0.5))).pages == 2
        service.release(held)


@pytest.mark.parametrize("value", _NOT_INTS)
async def test_int_arguments_refuse_every_non_integer_alike(tmp_path, value):
    """A bool (Python's or numpy's), a float or a string is refused by every int argument with
    ArgumentTypeError naming the argument, and changes nothing."""
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        load = service.prefetch(held, tokens([0, 1]))
        await load
        before = service.statistics()
        for name, call in {"num_pages": lambda: service.allocate_host_pages(value),
                           "priority": lambda: service.evict(tokens([2]), priority=value),
                           "layer": lambda: load.wait_layer(value)}.items():
            with pytest.raises(ArgumentTypeError, match=f"{name} must be an int"):
                call()
        assert service.statistics() == before
        service.release(held)


@pytest.mark.parametrize("seconds", [np.int64(3), np.float32(0.5), 2, 1.5])
def test_config_seconds_take_every_real_type_as_a_float(seconds):
    config = _config(drain_timeout_s=seconds, host_wait_timeout_s=seconds)
    for value in (config.drain_timeout_s, config.host_wait_timeout_s):
        assert type(value) is float and value == float(seconds)


async def test_result_before_the_end_is_the_services_error(tmp_path):
    """``result()`` / ``exception()`` of a request still queued raise TransferNotDoneError (an
    asyncio.InvalidStateError too), on the loop and on a thread, naming what to do instead."""
    from dsa_async import TransferNotDoneError

    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        gate = asyncio.Event()
        pending = service.evict(tokens([0]), after=gate)

        def read_both() -> list[BaseException]:
            refusals = []
            for call in (pending.result, pending.exception):
                with pytest.raises(TransferNotDoneError) as refused:
                    call()
                assert isinstance(refused.value, asyncio.InvalidStateError)
                assert "not ended yet" in str(refused.value)
                refusals.append(refused.value)
            return refusals

        assert len(read_both()) == 2
        assert len(await asyncio.to_thread(read_both)) == 2
        gate.set()
        result = await pending
        assert pending.result() is result and pending.exception() is None
        service.release(result.host_pages)


_UNSHOWABLE = [10**5000]  # a wrong type whose repr() itself fails (an int beyond str())


@pytest.mark.parametrize("build", [
    pytest.param(lambda v: PoolSize(pages=v), id="PoolSize.pages"),
    pytest.param(lambda v: _config(max_queued_requests=v), id="max_queued_requests"),
    pytest.param(lambda v: _config(drain_timeout_s=v), id="drain_timeout_s"),
    pytest.param(lambda v: _config(ledger_directory=v), id="ledger_directory"),
    pytest.param(lambda v: dsa_indexer(num_layers=v), id="num_layers"),
    pytest.param(lambda v: dsa_indexer(with_draft=v), id="with_draft"),
])
def test_config_refusals_show_a_value_whose_repr_fails(build):
    """A wrong type is refused with ConfigError even when showing it fails (a list holding an
    int of 5,000 digits): the message names its type, never a ValueError from repr()."""
    with pytest.raises(ConfigError, match="list"):
        build(_UNSHOWABLE)


async def test_argument_refusals_show_a_value_whose_repr_fails(tmp_path):
    service, _ = make_service(tmp_path, host_pages=HOST_PAGES, device_pages=DEVICE_PAGES)
    async with service, asyncio.timeout(BOUND_S):
        held = service.allocate_host_pages(2)
        load = service.prefetch(held, tokens([0, 1]))
        await load
        calls = {"deadline_s": lambda: service.prefetch(held, tokens([0, 1]),
                                                        deadline_s=_UNSHOWABLE),
                 "priority": lambda: service.evict(tokens([2]), priority=_UNSHOWABLE),
                 "num_pages": lambda: service.allocate_host_pages(_UNSHOWABLE),
                 "layer": lambda: load.wait_layer(_UNSHOWABLE),
                 "timeout_s": lambda: load.wait_layer(0, timeout_s=_UNSHOWABLE)}
        for name, call in calls.items():
            with pytest.raises(ArgumentTypeError, match=name):
                call()
        service.release(held)



def test_device_buffers_that_share_memory_are_refused_wherever_they_meet():
    """Overlapping layers of one pool, or a layer of one pool on another pool's bytes: refused,
    naming both and the bytes shared; views of one allocation side by side (a 3-D buffer,
    adjacent slices) are fine."""
    indexer, kv = dsa_indexer(num_layers=2), mla_kv(num_layers=2)
    row, kv_row = indexer.bytes_per_page_per_layer, kv.bytes_per_page_per_layer

    def bound(geometry, layers):
        host = torch.zeros(geometry.num_layers, 4, geometry.bytes_per_page_per_layer,
                           dtype=torch.uint8)
        return bind_pool(geometry, host, layers)

    whole = torch.zeros(8 * row + 8 * kv_row, dtype=torch.uint8)
    rows = whole[:8 * row].view(8, row)
    check_disjoint([bound(indexer, torch.zeros(2, 4, row, dtype=torch.uint8))])
    check_disjoint([bound(indexer, [rows[0:4], rows[4:8]])])
    with pytest.raises(ConfigError, match="layer 0 and pool 'indexer' layer 1 share 25,344 B"):
        check_disjoint([bound(indexer, [rows[0:4], rows[1:5]])])
    start = 8 * row - 100  # the kv pool's first bytes on the indexer's last 100
    kv_layers = [whole[start + i * 4 * kv_row:start + (i + 1) * 4 * kv_row].view(4, kv_row)
                 for i in range(2)]
    with pytest.raises(ConfigError, match=f"layer 1 and pool '{kv.name}' layer 0 share 100 B"):
        check_disjoint([bound(indexer, [rows[0:4], rows[4:8]]), bound(kv, kv_layers)])
