"""The liveness rule (nothing waits without a reason), checked on demand.

Whenever the loop is idle, every queued request must be held by something that ends by itself:

* a loop producer (asyncio future or event) that has not finished;
* a request it follows that is in flight, or queued and itself held;
* a wait for host pages whose deadline timer is armed;
* the in-flight byte bound of its direction, with copies in flight there (their completion
  schedules the next pass).

Requests in the engine are in flight: they end when their copy does. A queued request held by
nothing would wait until unrelated traffic arrives, which may be never. The randomized tests
call :func:`check_liveness` after every step; it reads state only (loop thread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ..errors import LivenessViolation
from ..kinds import D2H, H2D, Direction
from .request import QUEUED, SUBMITTED, Request


class Queues(Protocol):
    """What the rule reads of the scheduler (scheduler.py), and nothing else."""

    flush_pending: bool
    queues: Mapping[Direction, Sequence[Request]]
    inflight_bytes: Mapping[Direction, int]

    def waits_for_host_pages(self, request: Request) -> bool: ...


def check_liveness(scheduler: Queues) -> None:
    """Raise ``LivenessViolation`` naming the first queued request that nothing holds.

    Meaningful once the loop has run its ready callbacks: while a pass over the queues is
    scheduled, that pass decides, so nothing is checked then."""
    if scheduler.flush_pending:
        return
    held: dict[int, bool] = {}
    for direction in (H2D, D2H):
        for request in scheduler.queues[direction]:
            reason = _why_held(scheduler, request, held)
            if reason is None:
                raise LivenessViolation(
                    f"request {request.seq} ({request.direction.value}, {request.num_pages} "
                    f"pages, {request.nbytes} B) is queued and nothing that ends by itself "
                    f"holds it: deps {_describe_deps(request)}, loop producers pending "
                    f"{request.loop_waits}, waiting for host pages "
                    f"{scheduler.waits_for_host_pages(request)}, in-flight bytes "
                    f"{scheduler.inflight_bytes[direction]}")


def _why_held(scheduler: Queues, request: Request, held: dict[int, bool]) -> str | None:
    known = held.get(request.seq)
    if known is not None:
        return "a held dependency" if known else None
    held[request.seq] = False  # deps point to earlier requests: no cycle, but be safe
    reason = None
    if request.loop_waits:
        reason = "a loop producer"
    elif scheduler.inflight_bytes[request.direction] > 0:
        reason = "the in-flight byte bound"
    elif scheduler.waits_for_host_pages(request):
        reason = "host pages, with a deadline"
    else:
        for dep, _needs in request.deps:
            if dep.state is SUBMITTED or (dep.state is QUEUED
                                          and _why_held(scheduler, dep, held) is not None):
                reason = f"request {dep.seq}"
                break
    held[request.seq] = reason is not None
    return reason


def _describe_deps(request: Request) -> str:
    return "[" + ", ".join(f"{dep.seq}:{dep.state.value}" for dep, _ in request.deps) + "]"
