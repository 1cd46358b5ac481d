"""The forward-pass thread: runs steps one after another, layer by layer.

For each layer of a step it

1. waits for that layer of every prefetch the step needs (``Transfer.wait_layer``: on the CPU
   backend this blocks until the layer is copied; on CUDA it makes this thread's stream wait on
   the layer's event, so what follows is ordered after the copy without blocking the CPU);
2. sums the rows of that layer of the pages the step loaded, *before* anything overwrites
   them: together these give the checksum of what the load brought back;
3. runs the layer's compute (a ``[dim, dim]`` matmul and a tanh: real work, never a sleep);
4. writes that layer of the pages holding the step's new tokens (seeded contents) and sums
   what it wrote: together these give the checksum recorded for those pages.

Results go back to the event loop through ``post`` (thread-safe); the loop owns every decision.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..completion.transfer import Transfer
from ..errors import INT64_MAX
from .pagedata import PagePatterns

log = logging.getLogger(__name__)

#: The largest ``compute_dim`` whose ``[D, D]`` matrix has a 64-bit element count (torch sizes).
MAX_COMPUTE_DIM = math.isqrt(INT64_MAX)


@dataclass(frozen=True)
class WriteJob:
    pages: np.ndarray  #: device pages to (re)write, int64 [n]
    seeds: np.ndarray  #: one seed per page, uint64 [n]


@dataclass(eq=False)
class Step:
    """One turn's forward pass. ``waits``: prefetches to wait for layer by layer (some may
    belong to earlier steps, e.g. a shared prompt still loading); ``checks``: device pages the
    step's own prefetches load, to checksum; ``writes``: pages of the new tokens."""

    waits: tuple[Transfer, ...]
    checks: tuple[np.ndarray, ...]
    writes: tuple[WriteJob, ...]
    context: object = None  #: the engine's bookkeeping; opaque here


@dataclass(frozen=True)
class StepResult:
    checked: tuple[np.ndarray, ...] = ()  #: uint64 checksums per ``checks`` entry
    written: tuple[np.ndarray, ...] = ()  #: uint64 checksums per ``writes`` entry
    error: BaseException | None = None
    waited_s: float = 0.0  #: time spent in wait_layer
    busy_s: float = 0.0  #: whole step


@dataclass
class ForwardPassStats:
    steps: int = 0
    failed_steps: int = 0
    first_error: str | None = None  #: the first failed step's error, as text
    layers: int = 0
    busy_s: float = 0.0
    waited_s: float = 0.0


class ForwardPass:
    """A daemon thread running submitted steps in order; ``post(step, result)`` after each."""

    def __init__(self, patterns: PagePatterns, *, num_layers: int, compute_dim: int,
                 post: Callable[[Step, StepResult], None], seed: int = 0) -> None:
        self._patterns = patterns
        self._num_layers = num_layers
        self._dim = compute_dim
        self._post = post
        self._seed = seed
        self._queue: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dsa-async-forward", daemon=True)
        self.stats = ForwardPassStats()

    def start(self) -> None:
        self._thread.start()

    def submit(self, step: Step) -> None:
        """Queue ``step`` behind the ones already submitted. Never blocks."""
        self._queue.put(step)

    def stop(self) -> None:
        """Finish the submitted steps, then end the thread. Blocks: run it off the loop."""
        self._queue.put(None)
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        device = self._patterns.device
        setup_error: BaseException | None = None
        try:  # a compute size that does not fit fails every step, reported to the loop
            gen = torch.Generator().manual_seed(self._seed)
            scale = self._dim ** -0.5
            weight = (torch.randn(self._dim, self._dim, generator=gen) * scale).to(device)
            state = torch.randn(self._dim, self._dim, generator=gen).to(device)
        except Exception as exc:  # noqa: BLE001 - reported with each step
            setup_error, weight, state = exc, None, None
        while (step := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                if setup_error is not None:
                    raise RuntimeError(f"the forward pass could not set up its compute "
                                       f"(--compute-dim {self._dim}): {setup_error!r}"
                                       ) from setup_error
                result, state = self._forward(step, weight, state)
            except BaseException as exc:  # noqa: BLE001 - reported to the loop
                result = StepResult(error=exc, busy_s=time.perf_counter() - started)
            self.stats.steps += 1
            if result.error is not None:
                self.stats.failed_steps += 1
                if self.stats.first_error is None:
                    self.stats.first_error = f"{type(result.error).__name__}: {result.error}"
            self.stats.busy_s += result.busy_s
            self.stats.waited_s += result.waited_s
            try:
                self._post(step, result)
            except RuntimeError:  # the loop is gone: nobody is left to tell
                log.debug("step result dropped: the event loop is closed")

    def _forward(self, step: Step, weight: torch.Tensor, state: torch.Tensor
                 ) -> tuple[StepResult, torch.Tensor]:
        patterns = self._patterns
        started = time.perf_counter()
        waited = 0.0
        checks = [(patterns.index(pages), patterns.new_sums(len(pages))) for pages in step.checks]
        writes = [(patterns.index(job.pages), patterns.constants(job.seeds),
                   patterns.new_sums(len(job.pages))) for job in step.writes]
        for layer in range(self._num_layers):
            if step.waits:
                wait_from = time.perf_counter()
                for transfer in step.waits:
                    transfer.wait_layer(layer)
                waited += time.perf_counter() - wait_from
            for index, sums in checks:  # before this step's writes can touch these pages
                patterns.sum_layer(layer, index, sums)
            state = torch.tanh(state @ weight)  # the layer's compute
            for index, constants, sums in writes:
                patterns.write_layer(layer, index, constants, sums)
        checked = tuple(patterns.fold(sums) for _index, sums in checks)
        written = tuple(patterns.fold(sums) for _index, _c, sums in writes)
        self.stats.layers += self._num_layers
        return StepResult(checked, written, None, waited, time.perf_counter() - started), state
