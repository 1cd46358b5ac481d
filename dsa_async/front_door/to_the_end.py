"""Awaiting work that must run to its end even if the awaiting task is cancelled.

Start-up and close make and return resources (a ledger reservation, an arena, an engine); a
timeout around ``start()`` or ``close()`` cancels the task that awaits them, and a step cut short
there would leave what it made or held with nobody to return it. These helpers let the caller
finish its steps and raise the ``CancelledError`` afterwards. All run on the loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable


async def _until_done(work: asyncio.Future) -> bool:
    """Wait until ``work`` ended (done, failed or cancelled) through any cancellation of the
    awaiting task; whether one came."""
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: BLE001 - the work's error: the caller reads it from work
            break
    return cancelled


async def awaited_to_the_end(awaitable: Awaitable[object]) -> bool:
    """``await`` ``awaitable`` until it ends even if the awaiting task is cancelled (once or
    more) meanwhile; its error, if any, is raised. Returns whether a cancellation came: the
    caller finishes its other steps, then raises ``CancelledError``."""
    work = asyncio.ensure_future(awaitable)
    cancelled = await _until_done(work)
    work.result()  # its error (CancelledError if the work itself was cancelled)
    return cancelled


async def to_thread_to_the_end(fn: Callable[[], object],
                               keep: Callable[[object], None] | None = None, *,
                               keep_item: int | None = None) -> object:
    """``await`` ``fn()`` on a worker thread; if the awaiting task is cancelled (once or more)
    meanwhile, still wait for ``fn`` to return, hand what it made to ``keep`` (its element
    ``keep_item`` if given) so the caller can undo it, then raise ``CancelledError``. Without
    a cancellation ``fn``'s result or error is returned or raised as by ``asyncio.to_thread``."""
    work = asyncio.ensure_future(asyncio.to_thread(fn))
    if await _until_done(work):  # fn's error is dropped then: the cancellation is raised
        if work.exception() is None and keep is not None:
            result = work.result()
            keep(result if keep_item is None else result[keep_item])
        raise asyncio.CancelledError
    return work.result()


async def on_daemon_thread(fn: Callable[[], object], name: str) -> object:
    """``await`` ``fn()`` run on a daemon thread of its own: unlike ``asyncio.to_thread`` (whose
    workers the interpreter joins at exit), a call that never returns (an engine whose device
    is wedged) cannot keep the process from exiting."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(outcome: tuple[bool, object]) -> None:
        if done.done():
            return
        ok, value = outcome
        (done.set_result if ok else done.set_exception)(value)

    def run() -> None:
        try:
            outcome = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    result = await done  # a cancelled wait does not wait for the thread (it may never end)
    while thread.is_alive():  # it ends right after handing over: gone when this returns
        await asyncio.sleep(0.001)
    return result
