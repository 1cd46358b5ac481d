"""What the bench measures: figure targets and the scenarios that produce them.

A scenario is a function ``(BenchContext) -> {figure name: number}``. It runs on a worker thread
while the event loop runs on the main thread (so engines can hand completions back to the loop,
and ``ctx.run_on_loop`` can drive asyncio code there). Add one with :func:`register_scenario`;
give each new figure a :class:`Target` with :func:`register_target` so the report can judge it.
A module of scenarios is loaded by importing it from ``dsa_async/bench/__init__.py``.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import BenchInterrupted
from ..geometry import PageGeometry
from .device import BenchDevice


class Comparison(enum.Enum):
    """How a figure is judged against its target."""

    AT_LEAST = ">="  #: higher is better
    AT_MOST = "<="  #: lower is better


@dataclass(frozen=True)
class Target:
    """The bar one figure must reach, with its unit and exact definition."""

    name: str
    comparison: Comparison
    target: float | None  #: ``None``: reported for information, not judged
    unit: str
    definition: str

    def met(self, value: float) -> bool | None:
        """Whether ``value`` reaches the target; ``None`` when there is none."""
        if self.target is None:
            return None
        if self.comparison is Comparison.AT_LEAST:
            return value >= self.target
        return value <= self.target

    @property
    def better(self) -> str:
        return "higher" if self.comparison is Comparison.AT_LEAST else "lower"


#: Figure name -> target, in report order. Extend with :func:`register_target`.
TARGETS: dict[str, Target] = {}


@dataclass
class BenchContext:
    """Everything a scenario may use. One per bench run; scenarios run one at a time."""

    device: BenchDevice
    engine_class: type  #: a ``TransferEngine`` subclass for ``device.backend``
    loop: asyncio.AbstractEventLoop  #: running on another thread than the scenarios
    geometry: PageGeometry
    pairs: int  #: interleaved pairs per figure (>= measure.MIN_PAIRS)
    figure_bytes: int  #: every copy figure moves at least this many bytes per direction
    seed: int = 0
    sweep_batch_pages: tuple[int, ...] = ()  #: batch sizes for the throughput sweep (plot)
    progress: Callable[[str], None] = lambda line: None
    #: Cases whose moved bytes were compared with their source (filled by the scenarios).
    verified: list[str] = field(default_factory=list)
    #: Extra series for the plot, e.g. throughput by batch size (filled by the sweep).
    series: dict[str, list[float]] = field(default_factory=dict)
    #: Set when the bench is asked to stop (Ctrl-C): scenarios stop at their next
    #: :meth:`check_stop`.
    stopping: threading.Event = field(default_factory=threading.Event)

    def check_stop(self) -> None:
        """Raise ``BenchInterrupted`` when the bench was asked to stop. Any thread may call it:
        scenarios do between pairs and rounds, so a stop waits for one measurement at most."""
        if self.stopping.is_set():
            raise BenchInterrupted("the bench was interrupted; this scenario stopped early")

    @property
    def threads(self) -> int:
        return torch.get_num_threads()

    def run_on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the bench's event loop and return its result (blocks this thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


Scenario = Callable[[BenchContext], dict[str, float]]

#: The scenarios ``dsa-async bench`` runs, in order. Extend with :func:`register_scenario`.
SCENARIOS: list[Scenario] = []


def register_scenario(fn: Scenario) -> Scenario:
    """Add ``fn`` to the bench (usable as a decorator); registering twice is a no-op."""
    if fn not in SCENARIOS:
        SCENARIOS.append(fn)
    return fn


def register_target(target: Target) -> Target:
    """Add or replace the target of ``target.name``."""
    TARGETS[target.name] = target
    return target


def scenario_name(fn: Scenario) -> str:
    return getattr(fn, "__name__", repr(fn))
