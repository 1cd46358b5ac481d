"""A small request keeps the GIL on its way through the front door.

A thread that lets go of the GIL waits to get it back for as long as another thread runs
Python (up to ``sys.getswitchinterval()``), so each such call on the request path can cost a
server whose scheduler or forward-pass thread is busy a whole interval per request
(``scheduler.busy_thread_overhead_ratio`` in the bench). These calls were measured to let go of
it; the loop's and the submitting thread's share of every small-request form must call none.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import torch

from dsa_async.paging.tokens import Pages

from service_fixtures import make_service, on_plain_thread, tokens

#: numpy and torch calls that let go of the GIL (measured against a busy thread: 0.05-2.6 ms
#: per call on average, where the calls the path uses instead take 0.1-2 us).
_NUMPY_RELEASING = {"arange", "zeros", "sort", "argsort", "unique"}
_TORCH_RELEASING = {"from_numpy", "numpy", "is_neg", "resolve_neg", "tensor", "as_tensor"}


def _releasing(fn) -> str | None:
    """The name of ``fn`` when it is one of the calls above."""
    name = getattr(fn, "__name__", "")
    owner = getattr(fn, "__self__", None)
    module = getattr(fn, "__module__", None) or type(owner).__module__ or ""
    if isinstance(owner, torch.Tensor) or module.startswith("torch"):
        return f"torch {name}" if name in _TORCH_RELEASING else None
    if isinstance(owner, np.ndarray) or module.startswith("numpy"):
        return f"numpy {name}" if name in _NUMPY_RELEASING else None
    return None


class _Watch:
    """Records, on the threads it is installed on, every call of the list above and where."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, frame, event, arg):
        if event == "c_call":
            name = _releasing(arg)
            if name is not None:
                code = frame.f_code
                self.seen.append(f"{name} from {code.co_filename}:{frame.f_lineno}")


def _small_requests():
    """Every small form: aligned and partial token tensors, ranges, Pages, arrays."""
    return [tokens([3]), tokens([5, 6, 7]), torch.arange(70, 70 + 130), range(640, 700),
            Pages([9, 10]), Pages(torch.tensor([12])), np.arange(900, 1000),
            torch.arange(1100, 1350)]


async def test_small_requests_on_the_loop_keep_the_gil(tmp_path):
    service, _ = make_service(tmp_path, layers=2, host_pages=64, device_pages=24)
    async with service, asyncio.timeout(60):
        requests = _small_requests()
        for request in requests:  # warm up: first calls may import or build caches
            service.release((await service.evict(request)).host_pages)
        watch = _Watch()
        sys.setprofile(watch)
        try:
            backups = [await service.evict(request) for request in requests]
            loads = [service.prefetch(b.host_pages, request)
                     for b, request in zip(backups, requests)]
            for load in loads:
                await load
            for backup in backups:
                service.release(backup.host_pages)
        finally:
            sys.setprofile(None)
        assert watch.seen == []


async def test_small_requests_from_a_thread_keep_the_gil(tmp_path):
    """Watched on the submitting thread and on the loop, which takes what threads post."""
    service, _ = make_service(tmp_path, layers=2, host_pages=64, device_pages=24)
    async with service, asyncio.timeout(60):
        requests = _small_requests()
        watch, loop_watch = _Watch(), _Watch()

        def warm_up() -> None:
            for request in requests:
                service.release_threadsafe(service.evict_threadsafe(request).wait(30).host_pages)

        await asyncio.wrap_future(on_plain_thread(warm_up))

        def submit_all() -> None:
            sys.setprofile(watch)
            try:
                backups = [service.evict_threadsafe(request).wait(30) for request in requests]
                loads = [service.prefetch_threadsafe(b.host_pages, request)
                         for b, request in zip(backups, requests)]
                for load in loads:
                    load.wait_layer(0, 30)
                    load.wait(30)
                for backup in backups:
                    service.release_threadsafe(backup.host_pages)
            finally:
                sys.setprofile(None)

        assert threading.current_thread() is threading.main_thread()  # the loop's thread
        sys.setprofile(loop_watch)
        try:
            await asyncio.wrap_future(on_plain_thread(submit_all))
            await asyncio.wrap_future(service.call_threadsafe(service.statistics))
        finally:
            sys.setprofile(None)
        assert watch.seen == []
        assert loop_watch.seen == []
