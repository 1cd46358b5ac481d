"""An event-loop thread that owns one ``OffloadService``, for hosts that have no asyncio loop.

The core service never creates a loop: it lives in the caller's. A server whose scheduler is
a plain thread (SGLang's) gets one here: ``ServiceThread.start(config, buffers)`` runs a uvloop
in a daemon thread, starts the service on it (budget check, ledger reservation, allocation) and
returns once it runs, or raises what ``start()`` raised. The host's threads then use the
service's ``*_threadsafe`` methods, ``Transfer.wait`` / ``wait_layer`` and ``call_threadsafe``.

``stop()`` drains the service on its loop (``close()``: started copies complete, the host pool
and the ledger reservation are returned), then ends the loop and joins the thread. It runs at
interpreter exit too, for a host that never calls it (early enough that ``close()`` can still
use its worker threads); a process killed outright returns nothing itself, and the next
start's ledger reclaims the dead process's reservation.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from ..config import ServiceConfig
from ..errors import ServiceClosedError, WrongThreadError, wait_bound_s
from ..front_door.service import OffloadService

log = logging.getLogger(__name__)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; a bare asyncio loop still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ServiceThread:
    """One service on an event loop of its own, in a daemon thread (see module docstring)."""

    def __init__(self, service: OffloadService, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, life: _Life) -> None:
        self.service = service
        self.loop = loop
        self._thread = thread
        self._life = life

    @classmethod
    def start(cls, config: ServiceConfig, buffers: Any, *, name: str = "dsa-async-loop",
              stop_at_exit: bool = True, **service_kwargs: Any) -> ServiceThread:
        """Start the loop thread and the service on it; return once the service runs.

        Blocks the calling thread until ``OffloadService.start()`` finished there (it checks
        the budget before allocating anything); re-raises its error, with the thread ended.
        Interrupted meanwhile (Ctrl-C), it closes what started, then re-raises, waiting at most
        twice ``drain_timeout_s`` plus 5 s for that. ``service_kwargs`` go to
        ``OffloadService`` (registry, fault_hook, ...)."""
        loop = _new_loop()
        life = _Life()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                _run_to_the_end(loop, _own_service(config, buffers, service_kwargs, life), life)
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()
                    life.loop_ended()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        try:
            service = life.ready.result()
        except BaseException:
            life.request_stop()  # a start that succeeds after all closes at once
            thread.join(_join_bound_s(config))
            raise
        owner = cls(service, loop, thread, life)
        try:
            if stop_at_exit:
                _stop_at_exit(owner)
        except BaseException:  # interrupted (Ctrl-C) before the hook was in: close it now
            life.request_stop()
            thread.join(_join_bound_s(config))
            raise
        return owner

    def run(self, make: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float | None = None
            ) -> Any:
        """Run ``make()`` (a coroutine) on the service's loop and block the calling thread for
        its result, at most ``timeout_s`` (``None``, or one too long for a wait: no bound).
        Never call it on the loop thread; after ``stop()`` it raises ``ServiceClosedError``."""
        if threading.current_thread() is self._thread:
            raise WrongThreadError("ServiceThread.run() blocks; it was called on the loop thread")
        bound_s = wait_bound_s(timeout_s)
        if self._life.stop_requested.done():
            raise ServiceClosedError("ServiceThread.run() after stop(): the loop is closing or "
                                     "closed; start a new ServiceThread")
        inner = make()
        coro = _guarded(inner)
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop closed meanwhile (a concurrent stop)
            _close(coro, inner)
            raise ServiceClosedError("ServiceThread.run() while it stopped: the loop is "
                                     "closed; start a new ServiceThread") from None
        # The loop may end without ever running it (a stop that came just after the check
        # above): waiting for the loop's end too, this never waits forever for that.
        concurrent.futures.wait((future, self._life.ended), bound_s,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        if not future.done():
            if not self._life.ended.done():
                raise TimeoutError(f"ServiceThread.run(): no result within {timeout_s} s; the "
                                   f"coroutine keeps running on the loop")
            future.cancel()
            _close(coro, inner)
            raise ServiceClosedError("ServiceThread.run(): the service stopped before the "
                                     "coroutine ran; it never ran")
        try:
            outcome = future.result()
        except concurrent.futures.CancelledError:
            _close(inner)  # cancelled before its first step, it was never awaited
            if self._life.stop_requested.done():  # the loop ended it: it outlived the service
                raise ServiceClosedError("ServiceThread.run(): the service stopped while the "
                                         "coroutine still ran; it was cancelled") from None
            raise
        if isinstance(outcome, _Escaped):  # SystemExit / KeyboardInterrupt: the caller's
            raise outcome.exc
        return outcome

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and close the service on its loop, then end the loop and join the thread.

        Blocks the calling thread at most ``timeout_s`` in all (``None``, or one too long for
        a wait: until closed); any thread but the loop's. The first call starts the close;
        every call, concurrent or later, waits for that same close. Past ``timeout_s`` it
        raises ``TimeoutError`` and the close goes on on the loop: call ``stop()`` again to
        wait for it. A close that failed is logged; the loop still ends."""
        if threading.current_thread() is self._thread:
            raise WrongThreadError("ServiceThread.stop() blocks; it was called on the loop thread")
        bound_s = wait_bound_s(timeout_s)
        deadline = None if bound_s is None else time.monotonic() + bound_s
        self._life.request_stop()
        try:
            self._life.closed.result(bound_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the offload service did not close within {timeout_s} s; it keeps closing on "
                f"its loop: call stop() again to wait for it") from None
        except Exception:  # noqa: BLE001 - the loop ends all the same
            log.exception("closing the offload service on its loop failed")
        left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the offload service closed but its loop thread did not end "
                               f"within {timeout_s} s: call stop() again to wait for it")
        _forget_at_exit(self)  # stopped: the exit hook lets go of it (and of its buffers)

    @property
    def running(self) -> bool:
        """Whether the service runs and no ``stop()`` was asked for."""
        return not self._life.stop_requested.done() and self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        """Whether the service closed and the loop thread ended (what ``stop()`` waits for)."""
        return self._life.closed.done() and not self._thread.is_alive()


class _Life:
    """What a ``ServiceThread``'s threads tell each other, thread-safe (plain futures):
    ``ready`` (the service, or start's error), ``stop_requested`` (set once, by any thread),
    ``closed`` (the close ended: ``None``, or its error)."""

    def __init__(self) -> None:
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self.stop_requested: concurrent.futures.Future = concurrent.futures.Future()
        self.closed: concurrent.futures.Future = concurrent.futures.Future()
        #: the loop is closed: nothing scheduled on it runs any more
        self.ended: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()

    def request_stop(self) -> None:
        with self._lock:
            if not self.stop_requested.done():
                self.stop_requested.set_result(None)

    def loop_ended(self) -> None:
        """The loop thread's last step: a close that never ran is reported, not waited for."""
        with self._lock:
            if not self.closed.done():
                self.closed.set_exception(RuntimeError(
                    "the loop thread ended before the offload service closed"))
            self.ended.set_result(None)


class _Escaped:
    """A ``SystemExit`` / ``KeyboardInterrupt`` that a ``run()`` coroutine raised, carried to
    the thread that called ``run()`` (raised on the loop it would end the loop thread and
    leave the service open)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _close(*coros: object) -> None:
    """Close coroutines that will never run (no "never awaited" warning); best effort."""
    for coro in coros:
        close = getattr(coro, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - one that is running: the loop is gone anyway
                pass


async def _guarded(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        return _Escaped(exc)


def _run_to_the_end(loop: asyncio.AbstractEventLoop, main: Coroutine[Any, Any, None],
                    life: _Life) -> None:
    """Run ``main`` (the service's life) on ``loop`` until it ended, whatever escapes the loop
    meanwhile (a ``SystemExit`` or ``KeyboardInterrupt`` from a callback: logged, and the
    service is closed as on ``stop()``); then cancel what still runs there (``run()``
    coroutines that outlived the service) and let it end. Blocks the loop thread."""
    task = loop.create_task(main)
    while not task.done():
        try:
            loop.run_until_complete(task)
        except BaseException:  # noqa: BLE001 - the service still closes before the loop ends
            if task.done():
                break
            log.exception("an exception escaped the offload service's loop; closing the "
                          "service")
            life.request_stop()
    while others := [t for t in asyncio.all_tasks(loop) if not t.done()]:  # new ones too
        for other in others:
            other.cancel()
        loop.run_until_complete(asyncio.gather(*others, return_exceptions=True))
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()


async def _own_service(config: ServiceConfig, buffers: Any, kwargs: Mapping[str, Any],
                       life: _Life) -> None:
    """The loop thread's whole life: start the service, hand it over, run until a stop is
    asked for, close it. A stop asked for before the start ended closes right after it."""
    try:
        service = OffloadService(config, buffers, **kwargs)
        await service.start()
    except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
        life.ready.set_exception(exc)
        life.closed.set_result(None)  # nothing runs: nothing to close
        return
    life.ready.set_result(service)
    try:
        await asyncio.wrap_future(life.stop_requested)
    finally:
        try:
            await service.close()
        except BaseException as exc:  # noqa: BLE001 - handed to every stop()
            life.closed.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            life.closed.set_result(None)


#: How long the exit hook waits for the close beyond twice the drain timeout (a copy that never
#: ends, a wedged device, must not keep the process from exiting).
EXIT_CLOSE_GRACE_S = 5.0


def _exit_bound_s(config: ServiceConfig) -> float:
    return 2 * config.drain_timeout_s + EXIT_CLOSE_GRACE_S


def _join_bound_s(config: object) -> float | None:
    """How long a failed or interrupted start waits for its loop thread: the exit bound of a
    valid ``config`` (``None`` when too long for a wait), the grace alone for anything else
    (such a start failed before anything ran). Never raises: the start's own error wins."""
    try:
        return wait_bound_s(_exit_bound_s(config))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - not a ServiceConfig: refused before anything started
        return EXIT_CLOSE_GRACE_S


#: The service threads still to stop at exit, in the process that registered the hook.
_AT_EXIT: dict[int, ServiceThread] = {}
_AT_EXIT_LOCK = threading.Lock()
_AT_EXIT_PID = 0  #: the process whose exit hook is registered (one per process)


def _stop_at_exit(owner: ServiceThread) -> None:
    """Stop ``owner`` when the interpreter exits, while the thread pools that ``close()`` hands
    its blocking steps to (``asyncio.to_thread``) still take work: those refuse new work once
    the interpreter's own exit handlers ran, so a plain ``atexit`` hook would be too late and
    leave the engine open and the ledger reservation held. That is when the main thread ends,
    before non-daemon threads are joined: a thread still using the service then finds it
    closed. The hook holds each owner until it stopped (a host may keep only its ``service``;
    one stopped is let go, buffers and all), runs only in the process that started it (not in
    a forked child, where the loop thread does not exist), and waits a bounded time: also for
    a close that an earlier ``stop()`` started and gave up waiting for."""
    global _AT_EXIT_PID
    with _AT_EXIT_LOCK:
        pid = os.getpid()
        if _AT_EXIT_PID != pid:  # first here, or a forked child: the parent's are not ours
            _AT_EXIT.clear()
            _AT_EXIT_PID = pid
            hook = functools.partial(_stop_all_at_exit, pid)  # a child inherits it: skipped
            register = getattr(threading, "_register_atexit", None)  # before those pools stop
            try:
                if register is None:
                    raise RuntimeError
                register(hook)
            except RuntimeError:  # no such hook, or the interpreter is already shutting down
                atexit.register(hook)
        _AT_EXIT[id(owner)] = owner


def _fresh_lock_in_child() -> None:
    """A forked child gets a new lock: another thread may have held the parent's at fork."""
    global _AT_EXIT_LOCK
    _AT_EXIT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _forget_at_exit(owner: ServiceThread) -> None:
    with _AT_EXIT_LOCK:
        if _AT_EXIT.get(id(owner)) is owner:
            del _AT_EXIT[id(owner)]


def _stop_all_at_exit(pid: int) -> None:
    if os.getpid() != pid:  # a forked child's copy of the parent's hook: never touch the lock
        return
    with _AT_EXIT_LOCK:
        owners = list(_AT_EXIT.values())
    for owner in owners:
        if owner.stopped:
            continue
        bound_s = _exit_bound_s(owner.service.config)
        try:
            owner.stop(bound_s)
        except TimeoutError:
            log.error("the offload service did not close within %.3g s at exit; exiting "
                      "without it", bound_s)
