"""Plays conversations into the engine on the loop's clock: one task per live conversation.

A conversation arrives at its ``start_s``; beyond ``max_conversations`` live ones it is turned
away (counted), as a server sheds load. Each turn waits for its time (think time after the
previous turn, or the trace's arrival time), then for the engine. Stopping cancels arrivals and
every conversation task; turns already handed to the forward pass still complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from .conversations import Conversation
from .engine import ServingEngine

log = logging.getLogger(__name__)


class ArrivalDriver:
    def __init__(self, engine: ServingEngine, conversations: Iterable[Conversation], *,
                 max_conversations: int) -> None:
        self._engine = engine
        self._conversations = conversations
        self._max = max_conversations
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()

    async def run(self) -> None:
        """Start conversations on time; return once a finite source is played out."""
        self._t0 = self._loop.time()
        counters = self._engine.counters
        for conversation in self._conversations:
            await self._sleep_until(conversation.start_s)
            if self._engine.active_conversations >= self._max:
                counters.conversations_rejected += 1
                continue
            task = self._loop.create_task(self._play(conversation),
                                          name=f"dsa-async-{conversation.conversation_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def stop(self) -> None:
        """Cancel every conversation task and wait for them to end."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _sleep_until(self, offset_s: float) -> None:
        """Wait until ``offset_s`` after the start; one loop turn at least, even if that time
        has passed: at an arrival rate beyond what the loop keeps up with, the tasks already
        started, the stop timer and signals still run between arrivals."""
        await asyncio.sleep(max(0.0, self._t0 + offset_s - self._loop.time()))

    async def _play(self, conversation: Conversation) -> None:
        engine = self._engine
        state = engine.open_conversation(conversation)
        finished = False
        try:
            for turn in conversation.turns:
                if turn.arrival_s is not None:
                    await self._sleep_until(turn.arrival_s)
                elif turn.think_s > 0:
                    await asyncio.sleep(turn.think_s)
                await engine.run_turn(state, turn)
            finished = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed turn ends its conversation (counted)
            log.warning("%s ended early: %r", conversation.conversation_id, exc)
        finally:
            engine.close_conversation(state, finished=finished)
