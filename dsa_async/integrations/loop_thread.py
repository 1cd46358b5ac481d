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
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from ..config import ServiceConfig
from ..errors import WrongThreadError
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
                 thread: threading.Thread) -> None:
        self.service = service
        self.loop = loop
        self._thread = thread
        self._stop_lock = threading.Lock()
        self._stopped = False
        #: the close() that the first stop() started on the loop (later stops wait for it)
        self._closing: concurrent.futures.Future | None = None

    @classmethod
    def start(cls, config: ServiceConfig, buffers: Any, *, name: str = "dsa-async-loop",
              stop_at_exit: bool = True, **service_kwargs: Any) -> ServiceThread:
        """Start the loop thread and the service on it; return once the service runs.

        Blocks the calling thread until ``OffloadService.start()`` finished there (it checks
        the budget before allocating anything); re-raises its error, with the thread ended.
        ``service_kwargs`` go to ``OffloadService`` (registry, fault_hook, ...)."""
        loop = _new_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(_start_service(config, buffers, service_kwargs, ready))
                if ready.exception() is None:
                    loop.run_forever()
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        try:
            service = ready.result()
        except BaseException:
            thread.join()
            raise
        owner = cls(service, loop, thread)
        if stop_at_exit:
            _stop_at_exit(owner)
        return owner

    def run(self, make: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float | None = None
            ) -> Any:
        """Run ``make()`` (a coroutine) on the service's loop and block the calling thread for
        its result, at most ``timeout_s``. Never call it on the loop thread."""
        if threading.current_thread() is self._thread:
            raise WrongThreadError("ServiceThread.run() blocks; it was called on the loop thread")
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout_s)

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and close the service on its loop, then end the loop and join the thread.

        Blocks the calling thread at most ``timeout_s`` (``None``: until closed); any thread
        but the loop's. The first call starts the close; every call, concurrent or later,
        waits for that same close. Past ``timeout_s`` it raises ``TimeoutError`` and the
        close goes on on the loop: call ``stop()`` again to wait for it."""
        if threading.current_thread() is self._thread:
            raise WrongThreadError("ServiceThread.stop() blocks; it was called on the loop thread")
        with self._stop_lock:
            if self._closing is None:
                self._stopped = True
                if self.loop.is_running():
                    self._closing = asyncio.run_coroutine_threadsafe(self.service.close(),
                                                                     self.loop)
                else:
                    self._closing = concurrent.futures.Future()
                    self._closing.set_result(None)
            closing = self._closing
        try:
            closing.result(timeout_s)
        except TimeoutError:
            if not closing.done():
                raise TimeoutError(
                    f"the offload service did not close within {timeout_s} s; it keeps "
                    f"closing on its loop: call stop() again to wait for it") from None
        except Exception:  # noqa: BLE001 - the loop must still end
            log.exception("closing the offload service on its loop failed")
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return not self._stopped and self._thread.is_alive()


#: How long the exit hook waits for the close beyond twice the drain timeout (a copy that never
#: ends, a wedged device, must not keep the process from exiting).
EXIT_CLOSE_GRACE_S = 5.0


def _stop_at_exit(owner: ServiceThread) -> None:
    """Stop ``owner`` when the interpreter exits, while the thread pools that ``close()`` hands
    its blocking steps to (``asyncio.to_thread``) still take work: those refuse new work once
    the interpreter's own exit handlers ran, so a plain ``atexit`` hook would be too late and
    leave the engine open and the ledger reservation held. The hook holds the owner (a host
    may keep only its ``service``), runs only in the process that started it (not in a forked
    child, where the loop thread does not exist), and waits a bounded time."""
    pid = os.getpid()
    bound_s = 2 * owner.service.config.drain_timeout_s + EXIT_CLOSE_GRACE_S

    def stop() -> None:
        if os.getpid() != pid or owner._stopped:
            return
        try:
            owner.stop(bound_s)
        except TimeoutError:
            log.error("the offload service did not close within %.3g s at exit; exiting "
                      "without it", bound_s)

    register = getattr(threading, "_register_atexit", None)  # runs before those pools stop
    if register is None:
        atexit.register(stop)
        return
    try:
        register(stop)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(stop)


async def _start_service(config: ServiceConfig, buffers: Any, kwargs: Mapping[str, Any],
                         ready: concurrent.futures.Future) -> None:
    try:
        service = OffloadService(config, buffers, **kwargs)
        await service.start()
    except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
        ready.set_exception(exc)
        return
    ready.set_result(service)
