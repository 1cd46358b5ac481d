"""The producer grammar: what ``after=`` accepts, and where each kind of producer is waited for.

A copy starts only after the work that its pages depend on. ``after=`` names that work as one
producer or a list/tuple of them (one level, no nesting); every one must finish first:

========================  =====================================================================
producer                  waited for
========================  =====================================================================
``Transfer`` (this        as a dependency: the copy is ordered after that request's copy, and
service)                  fails if that request fails or is cancelled
``Transfer`` (another     on the event loop (both services on the same loop): the request
service), ``asyncio.``    stays queued until it ends; a failed or cancelled one fails the
``Future`` / ``Task``,    request. These never reach the engine, so they hold no copy slot.
``asyncio.Event``
engine producers          by the backend, before the batch's copies (see ``normalize_after`` of
                          each engine): CPU — ``threading.Event``, ``concurrent.futures.Future``
                          (a failed or cancelled future fails the request; the copy thread
                          waits in its direction's order, so later copies of that direction
                          wait too, as on a stream); CUDA — ``torch.cuda.Event``,
                          ``torch.cuda.Stream`` (a GPU-side wait)
========================  =====================================================================

Anything else is a ``TypeError`` at submit that names what is accepted. Parsing runs on the
submitting thread and never blocks; engine producers are normalized there too (a CUDA stream
becomes an event recorded on it at submit, on that thread).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..completion.transfer import Transfer
from ..errors import ArgumentTypeError

if TYPE_CHECKING:
    from ..scheduling.request import Request
    from ..transfer.base import TransferEngine

LOOP_PRODUCER_KINDS = "a Transfer (of any service on this loop), asyncio.Future, asyncio.Event"


@dataclass(frozen=True)
class Producers:
    """``after=`` sorted by who waits for it (all tuples; empty when nothing was named)."""

    engine: tuple[object, ...] = ()  #: normalized by the engine; waited for by the engine
    deps: tuple[Request, ...] = ()  #: requests of this service to follow (and need)
    loop: tuple[object, ...] = ()  #: asyncio futures / events, resolved on the loop


NO_PRODUCERS = Producers()


def parse_after(after: object, *, engine: TransferEngine, scheduler: object,
                loop: asyncio.AbstractEventLoop) -> Producers:
    """Sort ``after`` (``None``, one producer, or a list/tuple of them) by who waits for it.

    Raises ``ArgumentTypeError`` (a ``TypeError``; changing nothing) for anything outside the grammar, naming what is
    accepted. ``scheduler`` tells this service's transfers from another service's. Does not
    block; call it on the submitting thread.
    """
    if after is None:
        return NO_PRODUCERS
    items = tuple(after) if isinstance(after, (list, tuple)) else (after,)
    engine_items: list[object] = []
    deps: list[Request] = []
    loop_items: list[object] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            raise ArgumentTypeError(
                f"after= takes one producer or a flat list/tuple of producers; item {item!r} "
                f"is itself a sequence: flatten it")
        if isinstance(item, Transfer):
            if item._scheduler is scheduler:
                deps.append(item._request)
                continue
            future = item._request.future
            if future.get_loop() is not loop:
                raise ArgumentTypeError(
                    f"after={item!r} is a Transfer of a service on another event loop; a "
                    f"Transfer of another service works only when both run on the same loop "
                    f"(wait for it yourself, then submit)")
            loop_items.append(future)
        elif isinstance(item, asyncio.Future):
            if item.get_loop() is not loop:
                raise ArgumentTypeError(f"after={item!r} belongs to another event loop than the service's")
            loop_items.append(item)
        elif isinstance(item, asyncio.Event):
            loop_items.append(item)
        else:
            try:
                engine_items.append(engine.normalize_after(item))
            except TypeError:
                raise ArgumentTypeError(
                    f"after={item!r} is not a producer this service can wait for; the "
                    f"{engine.backend.value} backend accepts {engine.producer_kinds}; every "
                    f"backend accepts {LOOP_PRODUCER_KINDS}; and a list/tuple of these") from None
    if not (engine_items or deps or loop_items):
        return NO_PRODUCERS
    return Producers(tuple(engine_items), tuple(deps), tuple(loop_items))


def parse_indices_after(indices_after: object, *, engine: TransferEngine
                        ) -> tuple[object, ...] | None:
    """What device index values the engine reads later wait for besides the submitting
    thread's work so far (``indices_after=``): ``None`` (not given) means every producer the
    copy waits for. Only engine producers (a CUDA event or stream: the work that computes index
    values runs on the device) are accepted; raises ``ArgumentTypeError`` (changing nothing)
    for anything else. Does not block; call it on the submitting thread."""
    if indices_after is None:
        return None
    items = tuple(indices_after) if isinstance(indices_after, (list, tuple)) else (indices_after,)
    normalized = []
    for item in items:
        try:
            if isinstance(item, (list, tuple, Transfer, asyncio.Future, asyncio.Event)):
                raise TypeError
            normalized.append(engine.normalize_after(item))
        except TypeError:
            raise ArgumentTypeError(
                f"indices_after={item!r}: the values of device indices are computed by device "
                f"work, so only its producers can be named here; the {engine.backend.value} "
                f"backend accepts {engine.producer_kinds}, or a flat list/tuple of them "
                f"(an empty one: only the submitting thread's work so far)") from None
    return tuple(normalized)
