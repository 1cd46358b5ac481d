"""The two thread-to-loop hand-offs (requests and releases from threads, completions from the
engine): a drain takes what was posted before it began, so a poster that keeps posting while
the loop drains cannot hold the loop in one callback; what it posts meanwhile is taken by the
next drain, after the callbacks already waiting (timers, close())."""

from __future__ import annotations

import asyncio
import types

from dsa_async.front_door.thread_submit import PostedRequest, ThreadInbox
from dsa_async.transfer.handoff import LoopHandoff

BOUND_S = 10
POSTS = 5
#: what the inbox reads of a posted request here: it has pages, so it counts as queued
_STAND_IN = types.SimpleNamespace(num_pages=1)


async def _until(condition) -> None:
    async with asyncio.timeout(BOUND_S):
        while not condition():
            await asyncio.sleep(0)


async def test_the_inbox_takes_what_is_posted_during_a_drain_at_the_next_one():
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    def accept(_posted: PostedRequest) -> None:
        seen.append("posted")
        if seen.count("posted") < POSTS:  # as a thread posting while the loop drains
            inbox.post(PostedRequest(_STAND_IN, (), None))

    inbox = ThreadInbox(loop, accept, lambda _handle: None)
    inbox.post(PostedRequest(_STAND_IN, (), None))
    loop.call_soon(seen.append, "other callback")
    await _until(lambda: seen.count("posted") == POSTS)
    assert seen == ["posted", "other callback"] + ["posted"] * (POSTS - 1)
    assert len(inbox) == 0


async def test_the_completion_handoff_takes_what_is_posted_during_a_drain_at_the_next_one():
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    handoff = LoopHandoff(loop)

    def completion() -> None:
        seen.append("completion")
        if seen.count("completion") < POSTS:
            handoff.post(completion)

    handoff.post(completion)
    loop.call_soon(seen.append, "other callback")
    await _until(lambda: seen.count("completion") == POSTS)
    assert seen == ["completion", "other callback"] + ["completion"] * (POSTS - 1)
