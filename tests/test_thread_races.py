"""Thread hand-offs racing the loop: a loop request that names in ``after=`` a Transfer a
thread handed over and the loop has not taken yet, host pages the service took over given
again on the loop, and a forward-pass thread's waits on prefetches that ended without their
copy or after ``close()``. Every request ends, with its own error, whichever side went first."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading

import pytest
from service_fixtures import make_service, on_plain_thread, tokens

from dsa_async import Pages
from dsa_async.errors import TransferFailedError, UnknownHostPagesError

BOUND_S = 10
LAYERS = 3


def _fill(buffers, page: int, value: int) -> None:
    for layers in buffers.values():
        for layer in layers:
            layer[page] = value


def _holds(buffers, page: int, value: int) -> bool:
    return all(bool((layer[page] == value).all()) for layers in buffers.values()
               for layer in layers)


def _posted_then(fn) -> object:
    """Run ``fn()`` on another thread while the loop thread blocks (nothing it hands over is
    taken before this returns); returns its result."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=fn()))
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive() and "value" in box
    return box["value"]


async def _raised_in_thread(fn) -> type[BaseException] | None:
    """Run ``fn()`` on a plain thread (no event loop there); the type of what it raised."""
    try:
        await asyncio.wrap_future(on_plain_thread(fn))
    except BaseException as exc:  # noqa: BLE001 - its type is the result
        return type(exc)
    return None


@pytest.mark.parametrize("pages", ["same", "other"])
async def test_a_loop_request_after_a_transfer_not_yet_taken_follows_it(tmp_path, pages):
    """after= a thread's Transfer that is still in the hand-off: the loop request runs after
    it (it reads the backed-up bytes when it reads the same pages) and both end."""
    service, buffers = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(1)
        _fill(buffers, 5, 91)
        backup = _posted_then(lambda: service.evict_threadsafe(
            tokens([5]), host_tokens=host.token_indices()))
        if pages == "same":  # reads the host page the thread's backup writes
            then = service.prefetch(host, tokens([6]), after=backup)
        else:  # touches none of its pages: ordered after it by after= alone
            then = service.evict(tokens([7]), after=backup)
        await backup
        result = await then
        if pages == "same":
            assert _holds(buffers, 6, 91)
        else:
            service.release(result.host_pages)
        service.release(host)
        await asyncio.sleep(0)
        assert service.statistics() == start


async def test_host_tokens_of_pages_the_service_took_over_are_refused(tmp_path):
    """Pages of a handle released from a thread while a copy still uses them belong to the
    service until that copy ends: naming them in host_tokens= on the loop is refused, as the
    handle itself is."""
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(1)
        gate = threading.Event()
        backup = service.evict(tokens([1]), host_tokens=host.token_indices(), after=gate)
        await asyncio.sleep(0)
        await asyncio.to_thread(service.release_threadsafe, host)
        await asyncio.sleep(0)  # the loop took the release: the pages are the service's now
        before = service.statistics()
        for call in (lambda: service.evict(tokens([2]), host_tokens=host.token_indices()),
                     lambda: service.prefetch(None, tokens([2]),
                                              host_tokens=host.token_indices()),
                     lambda: service.prefetch(host, tokens([2]))):
            with pytest.raises(UnknownHostPagesError):
                call()
            assert service.statistics() == before
        gate.set()
        await backup
        await asyncio.sleep(0)
        assert service.statistics() == start


async def test_wait_layer_raises_the_prefetchs_own_error(tmp_path):
    """A forward-pass thread's wait_layer on a prefetch that failed or was cancelled raises
    that outcome, not a shutdown error, while the service runs and after close()."""
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with asyncio.timeout(BOUND_S):
        async with service:
            host = service.allocate_host_pages(1)
            producer = concurrent.futures.Future()
            failed = service.prefetch(host, tokens([3]), after=producer)  # in the engine
            queued = service.prefetch(host, tokens([5]), after=asyncio.Event())  # on the loop
            await asyncio.sleep(0)
            assert queued._request.state.value == "queued"
            queued.cancel()
            producer.set_exception(RuntimeError("the producer's kernel failed"))
            with pytest.raises(TransferFailedError):
                await failed
            for transfer, error in ((failed, TransferFailedError),
                                    (queued, asyncio.CancelledError)):
                assert await _raised_in_thread(lambda t=transfer: t.wait_layer(0, 5.0)) is error
            service.release(host)
        # after close() too
        assert await _raised_in_thread(lambda: failed.wait_layer(1, 5.0)) is TransferFailedError


async def test_an_infinite_timeout_is_no_bound(tmp_path):
    """timeout_s=math.inf (or one past what the platform's waits take) waits without a bound
    instead of failing inside the wait."""
    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(BOUND_S):
        host = service.allocate_host_pages(1)
        load = service.prefetch(host, tokens([2]))

        def wait() -> int:
            load.wait_layer(LAYERS - 1, timeout_s=math.inf)
            return load.wait(timeout_s=1e300).pages

        assert await asyncio.to_thread(wait) == 1
        service.release(host)


async def test_a_loop_request_whose_host_pages_a_taken_release_freed_is_refused(tmp_path):
    """Taking a thread's hand-offs first (after= a Transfer not yet taken) also takes its
    releases: a loop request naming those host pages is refused, changing nothing, and the
    pool's page states stay whole (the next backups run)."""
    service, buffers = make_service(tmp_path, layers=LAYERS, host_pages=4)
    async with service, asyncio.timeout(BOUND_S):
        start = service.statistics()
        host = service.allocate_host_pages(2)
        pages = Pages(host.pages)

        def thread_side():
            backup = service.evict_threadsafe(tokens([9]))
            service.release_threadsafe(host)
            return backup

        backup = _posted_then(thread_side)
        with pytest.raises(UnknownHostPagesError):
            service.prefetch(None, Pages([5, 6]), host_tokens=pages, after=backup)
        result = await backup
        more = [await service.evict(tokens([p])) for p in (1, 2)]
        for done in (result, *more):
            service.release(done.host_pages)
        await asyncio.sleep(0)
        assert service.statistics() == start


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_every_thread_submission_is_taken_when_the_loop_drains_at_once(tmp_path, loop_kind):
    """One request at a time from a worker thread, the loop idle in between: scheduling the
    loop's wake-up can let it drain at once, before the poster returns. No submission may be
    stranded by that: each is taken and ends (on asyncio's own loop too, where it showed)."""
    import uvloop

    async def main() -> None:
        service, _ = make_service(tmp_path, layers=LAYERS)
        async with service, asyncio.timeout(120):
            for _ in range(600):
                transfer = await asyncio.to_thread(service.evict_threadsafe, tokens([1]))
                async with asyncio.timeout(5):
                    result = await transfer
                service.release(result.host_pages)

    (asyncio.run if loop_kind == "asyncio" else uvloop.run)(main())


@pytest.mark.parametrize("second", ["thread", "loop"])
async def test_of_two_racing_releases_of_one_handle_exactly_one_wins(tmp_path, second):
    """release_threadsafe(h) on a thread against another release of h, from a second thread
    or on the loop (call_threadsafe(release, h)), started together many times with a tiny
    switch interval: each time exactly one returns and the other raises
    UnknownHostPagesError, and the pool ends as it began. (Before the loop's release took
    the posters' lock, both returned about once in 600 tries.)"""
    import sys

    service, _ = make_service(tmp_path, layers=LAYERS)
    async with service, asyncio.timeout(120):
        start = service.statistics()

        def race(handle) -> list[str]:
            barrier, outcome = threading.Barrier(2), ["", ""]

            def release(i: int, call) -> None:
                barrier.wait()
                try:
                    call()
                    outcome[i] = "released"
                except UnknownHostPagesError:
                    outcome[i] = "refused"

            other = ((lambda: service.release_threadsafe(handle)) if second == "thread" else
                     (lambda: service.call_threadsafe(service.release, handle).result(BOUND_S)))
            threads = [threading.Thread(target=release, args=(0, lambda: service.release_threadsafe(
                handle))), threading.Thread(target=release, args=(1, other))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(BOUND_S)
            return sorted(outcome)

        def many() -> None:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e-6)
            try:
                for _ in range(1500):
                    handle = service.call_threadsafe(
                        service.allocate_host_pages, 1).result(BOUND_S)
                    assert race(handle) == ["refused", "released"]
            finally:
                sys.setswitchinterval(interval)

        await asyncio.wrap_future(on_plain_thread(many))
        for _ in range(3):
            await asyncio.sleep(0)  # the loop takes the last posted release
        assert service.statistics() == start
