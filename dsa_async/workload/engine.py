"""The loop side of the workload: a small serving engine over a hierarchical page cache.

One turn at a time is *admitted*: its conversation's pages (the shared system prompt's and its
own) must be on the device, plus room for the tokens it appends. Admission

* waits while a segment it needs is being backed up (the prefetch needs the host copy);
* evicts least recently used segments until enough device pages are free (backups through
  ``OffloadService.evict`` with the segment's exact token range, so the service pads it);
* prefetches hosted segments into free device pages (``OffloadService.prefetch``), with a
  deadline from how many steps are ahead, and hands the step to the forward-pass thread at once,
  so loads overlap the steps in front of it (at most ``pipeline_depth`` steps in flight).

When a step comes back, the pages it loaded are checked against the checksums recorded when
they were backed up, the pages it wrote get their new checksums, and its segments become
evictable again. Between steps the engine keeps ``low_watermark_pages`` free by evicting early,
so backups overlap compute too. The moves themselves (backups, loads, host copies and the
service's host-pressure hook, :meth:`ServingEngine.on_host_pressure`) are ``PageTiers``'
(tiers.py); this module decides when.

Everything here runs on the event-loop thread and never blocks it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from dataclasses import dataclass, field

import numpy as np

from ..completion.transfer import Transfer
from ..front_door.service import OffloadService
from .consumer import ForwardPass, ForwardPassStats, Step, StepResult, WriteJob
from .conversations import Conversation, Turn
from .counters import WorkloadCounters
from .device_cache import DeviceCache
from .host_cache import HostCache
from .pagedata import PagePatterns
from .segments import Segment, SegmentState, pages_spanned
from .tiers import PageTiers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    page_size_tokens: int
    device_pages: int
    num_layers: int
    context_pages: int  #: most device pages one conversation may use (prompt + own)
    low_watermark_pages: int  #: evict early to keep this many device pages free
    pipeline_depth: int = 2  #: steps handed to the forward pass and not yet back
    max_conversations: int = 64
    compute_dim: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pipeline_depth * self.context_pages + self.context_pages > self.device_pages:
            raise ValueError(
                f"device_pages={self.device_pages} cannot hold {self.pipeline_depth} steps in "
                f"flight plus one being admitted of up to {self.context_pages} pages each")

    @classmethod
    def for_device(cls, *, page_size_tokens: int, device_pages: int, num_layers: int,
                   **kwargs) -> EngineSettings:
        """A conversation may use a quarter of the device cache; an eighth is kept free."""
        return cls(page_size_tokens=page_size_tokens, device_pages=device_pages,
                   num_layers=num_layers, context_pages=max(2, device_pages // 4),
                   low_watermark_pages=max(1, device_pages // 8), **kwargs)

    @property
    def context_tokens(self) -> int:
        return self.context_pages * self.page_size_tokens


@dataclass(eq=False)
class ConversationState:
    conversation_id: str
    prompt: Segment | None  #: the shared system prompt's whole pages (None: none to share)
    prompt_tokens: int
    own: Segment
    busy: bool = False  #: a turn of it is admitted and not back
    closed: bool = False


@dataclass(eq=False)
class _Pending:
    conversation: ConversationState
    turn: Turn
    future: asyncio.Future


@dataclass(eq=False)
class _StepContext:
    conversation: ConversationState
    segments: tuple[Segment, ...]  #: pinned by this step
    #: (segment, device pages, checksums its host copy holds), as Step.checks; the checksums
    #: are taken at launch: the host copy may be released once its load is done
    loads: list[tuple[Segment, np.ndarray, np.ndarray]] = field(default_factory=list)
    writes: list[tuple[Segment, np.ndarray]] = field(default_factory=list)  #: (seg, offsets)
    tokens: int = 0
    future: asyncio.Future | None = None


class ServingEngine:
    #: where segments' pages are and the copies between tiers (a subclass may change it)
    tiers_class: type[PageTiers] = PageTiers

    def __init__(self, service: OffloadService, patterns: PagePatterns, settings: EngineSettings,
                 counters: WorkloadCounters | None = None) -> None:
        self.service = service
        self.settings = settings
        self.counters = counters if counters is not None else WorkloadCounters()
        self.tiers = self.tiers_class(service, settings.device_pages, self.counters, self._wake_up)
        self._patterns = patterns
        self._loop = asyncio.get_running_loop()
        self._prompts: dict[str, Segment] = {}
        self._conversations: dict[str, ConversationState] = {}
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._wake = asyncio.Event()
        self._steps_in_flight = 0
        self._seeds = itertools.count(1)
        self._seed_base = (settings.seed & 0xFFFFFF) << 40
        self._step_s = 0.02  # running estimate of one step's time, for prefetch deadlines
        self._closing = False
        self._forward = ForwardPass(patterns, num_layers=settings.num_layers,
                                    compute_dim=settings.compute_dim, post=self._post_result,
                                    seed=settings.seed)
        self._admit_task: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._forward.start()
        self._admit_task = self._loop.create_task(self._admit_loop(), name="dsa-async-admit")

    @property
    def admission(self) -> asyncio.Task | None:
        """The admission task: it runs until :meth:`drain`; ending earlier means it failed."""
        return self._admit_task

    @property
    def device(self) -> DeviceCache:
        """The device page table (the tiers')."""
        return self.tiers.device

    @property
    def host(self) -> HostCache:
        """The host copies (the tiers')."""
        return self.tiers.host

    @property
    def forward_stats(self) -> ForwardPassStats:
        return self._forward.stats

    @property
    def active_conversations(self) -> int:
        return len(self._conversations)

    @property
    def steps_in_flight(self) -> int:
        return self._steps_in_flight

    async def drain(self) -> None:
        """Admit nothing more; finish the steps in flight and every copy this engine started.

        Turns still waiting are cancelled. Afterwards no copy of ours is queued or running.
        """
        self._closing = True
        task, self._admit_task = self._admit_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                log.error("admission ended with %r", task.exception())
        while self._waiting:
            self._waiting.popleft().future.cancel()
        await self._until(lambda: self._steps_in_flight == 0)
        await asyncio.to_thread(self._forward.stop)
        await self._until(lambda: not self.tiers.copies_in_flight)

    def release_everything(self) -> None:
        """Drop every segment: device pages back to the page table, host handles back to the
        service. Call after :meth:`drain`; deferred releases go once nothing holds them."""
        assert self._closing and self._steps_in_flight == 0
        for conversation in list(self._conversations.values()):
            self._conversations.pop(conversation.conversation_id, None)
        for segment in list(self.tiers.segments):
            self.tiers.retire(segment)
        self._prompts.clear()
        self.host.retry_deferred()

    def _wake_up(self) -> None:
        self._wake.set()

    def on_host_pressure(self, pages_needed: int) -> int:
        """The service's ``on_host_pressure`` hook (on the loop): release least recently used
        host copies that no prefetch reads."""
        return self.tiers.on_host_pressure(pages_needed)

    async def _until(self, condition) -> None:
        while not condition():
            self._wake.clear()
            await self._wake.wait()

    # --- conversations and turns ------------------------------------------------------------

    def open_conversation(self, conversation: Conversation) -> ConversationState:
        ps = self.settings.page_size_tokens
        prompt_segment, prompt_tokens = None, 0
        if conversation.system_prompt is not None:
            prompt_tokens = min(conversation.system_prompt.tokens,
                                (self.settings.context_pages - 1) * ps)
            whole = prompt_tokens // ps * ps
            if whole:
                key = conversation.system_prompt.prompt_id
                prompt_segment = self._prompts.get(key)
                if prompt_segment is None or prompt_segment.end_token != whole:
                    prompt_segment = Segment(f"prompt:{key}", 0, whole, ps, shared=True)
                    self._prompts[key] = prompt_segment
                    self.tiers.segments.add(prompt_segment)
        own = Segment(f"conversation:{conversation.conversation_id}", prompt_tokens,
                      prompt_tokens, ps)
        self.tiers.segments.add(own)
        state = ConversationState(conversation.conversation_id, prompt_segment, prompt_tokens, own)
        self._conversations[conversation.conversation_id] = state
        self.counters.conversations_started += 1
        return state

    def close_conversation(self, state: ConversationState, *, finished: bool = True) -> None:
        """The conversation ended (``finished``) or was abandoned: its own pages go, now or
        when its turn in flight is back."""
        if self._conversations.pop(state.conversation_id, None) is None:
            return
        state.closed = True
        if finished:
            self.counters.conversations_finished += 1
        if not state.busy:
            self.tiers.retire(state.own)

    async def run_turn(self, state: ConversationState, turn: Turn) -> None:
        """Queue one turn of ``state`` and wait until its forward pass is back."""
        if self._closing:
            raise RuntimeError("the engine is draining: it admits no more turns")
        future = self._loop.create_future()
        self._waiting.append(_Pending(state, turn, future))
        self._wake.set()
        await future  # cancelling the caller cancels the turn if it is not admitted yet

    # --- admission --------------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        depth = self.settings.pipeline_depth
        while True:
            while self._waiting and self._waiting[0].future.done():
                self._waiting.popleft()  # its caller gave up
            if not self._waiting or self._steps_in_flight >= depth:
                self._wake.clear()
                await self._wake.wait()
                continue
            pending = self._waiting[0]
            state = pending.conversation
            new_end = self._fit_turn(state, pending.turn)
            segments = [s for s in (state.prompt, state.own) if s is not None]
            evicting = [s.evicted for s in segments if s.state is SegmentState.EVICTING]
            if evicting:  # its host copy is being written: load it once the backup is done
                await asyncio.wait(evicting)
                continue
            need = self._pages_needed(state, new_end)
            if self.device.free_pages < need:
                self.tiers.evict_for(need + self.settings.low_watermark_pages, keep=segments)
                if self.device.free_pages < need:
                    self._wake.clear()
                    await self._wake.wait()  # an eviction or a step ends
                    continue
            self._waiting.popleft()
            self._launch(pending, new_end)

    def _fit_turn(self, state: ConversationState, turn: Turn) -> int:
        """The conversation's end token after ``turn``; starts the conversation over (a new own
        segment) when it would outgrow its share of the device."""
        own = state.own
        prompt_pages = state.prompt.num_pages if state.prompt is not None else 0
        limit = self.settings.context_tokens
        end = own.end_token + turn.tokens
        if prompt_pages + pages_spanned(own.first_token, end, own.page_size) <= \
                self.settings.context_pages:
            return end
        if own.num_tokens:
            self.counters.context_resets += 1
            self.tiers.retire(own)
            own = Segment(own.key, state.prompt_tokens, state.prompt_tokens, own.page_size)
            self.tiers.segments.add(own)
            state.own = own
        return min(own.end_token + turn.tokens, limit)

    def _pages_needed(self, state: ConversationState, new_end: int) -> int:
        need = 0
        prompt = state.prompt
        if prompt is not None and prompt.state in (SegmentState.HOSTED, SegmentState.ABSENT):
            need += prompt.num_pages
        own = state.own
        after = pages_spanned(own.first_token, new_end, own.page_size)
        if own.state is SegmentState.RESIDENT:
            need += after - own.num_pages
        else:
            need += after
        return need

    def _launch(self, pending: _Pending, new_end: int) -> None:
        """Allocate, prefetch and hand the step to the forward pass. Synchronous: nothing can
        change between the page count check and here."""
        state = pending.conversation
        segments = tuple(s for s in (state.prompt, state.own) if s is not None)
        context = _StepContext(state, segments, future=pending.future)
        waits: list[Transfer] = []
        for segment in segments:
            segment.pins += 1
            self.device.discard(segment)
        deadline_s = self._steps_in_flight * self._step_s
        prompt = state.prompt
        if prompt is not None:
            if prompt.state is SegmentState.LOADING:
                waits.append(prompt.loading)  # another step loads it; wait for its layers too
            if prompt.state is SegmentState.HOSTED:
                self._load(prompt, deadline_s, context, waits)
            if prompt.state is SegmentState.ABSENT:  # never cached, lost, or its load refused
                self._compute(prompt, prompt.first_token, prompt.end_token, context)
        own = state.own
        old_end = own.end_token
        if own.state is SegmentState.HOSTED:
            self._load(own, deadline_s, context, waits)
        if own.state is SegmentState.ABSENT:
            old_end = own.first_token  # nothing cached: compute it all again
        self._compute(own, old_end, new_end, context)
        context.tokens = new_end - own.end_token
        own.end_token = new_end
        state.busy = True
        step = Step(tuple(waits), tuple(pages for _s, pages, _c in context.loads),
                    tuple(WriteJob(seg.device_pages[offsets], self._new_seeds(offsets.size))
                          for seg, offsets in context.writes), context)
        self._steps_in_flight += 1
        self._forward.submit(step)

    def _load(self, segment: Segment, deadline_s: float, context: _StepContext,
              waits: list[Transfer]) -> None:
        transfer = self.tiers.load(segment, deadline_s)
        if transfer is None:  # refused: the segment is computed again instead
            return
        context.loads.append((segment, segment.device_pages, segment.host_checksums))
        waits.append(transfer)

    def _compute(self, segment: Segment, old_end: int, new_end: int,
                 context: _StepContext) -> None:
        """Give ``segment`` the pages for ``[first_token, new_end)`` and schedule the writes of
        every page holding tokens ``[old_end, new_end)``."""
        ps = segment.page_size
        cached = pages_spanned(segment.first_token, old_end, ps)
        after = pages_spanned(segment.first_token, new_end, ps)
        if segment.state is SegmentState.ABSENT:
            if segment.cached_before and segment.num_tokens:
                self.counters.recomputed_pages += segment.num_pages
            segment.cached_before = True
            segment.device_pages = np.zeros(0, dtype=np.int64)
            segment.checksums = np.zeros(0, dtype=np.uint64)
            segment.state = SegmentState.RESIDENT
        grow = after - segment.device_pages.size
        if grow:
            segment.device_pages = np.concatenate([segment.device_pages, self.device.allocate(grow)])
            segment.checksums = np.concatenate([segment.checksums, np.zeros(grow, np.uint64)])
        first = old_end // ps - segment.first_page if cached else 0
        offsets = np.arange(first, after, dtype=np.int64)
        if offsets.size:
            context.writes.append((segment, offsets))

    def _new_seeds(self, n: int) -> np.ndarray:
        return np.fromiter((self._seed_base | next(self._seeds) for _ in range(n)),
                           dtype=np.uint64, count=n)

    # --- step completion --------------------------------------------------------------------

    def _post_result(self, step: Step, result: StepResult) -> None:
        """From the forward-pass thread."""
        self._loop.call_soon_threadsafe(self._on_step_done, step, result)

    def _on_step_done(self, step: Step, result: StepResult) -> None:
        context: _StepContext = step.context
        counters = self.counters
        self._steps_in_flight -= 1
        self._step_s = 0.8 * self._step_s + 0.2 * result.busy_s
        if result.error is None:
            for (segment, _pages, expected), got in zip(context.loads, result.checked,
                                                        strict=True):
                self._check_load(segment, got, expected)
            for (segment, offsets), got in zip(context.writes, result.written, strict=True):
                segment.checksums[offsets] = got
                counters.computed_pages += got.size
                if segment.host is not None:  # its host copy no longer matches
                    self.tiers.drop_host(segment)
            counters.turns_finished += 1
            counters.tokens_appended += context.tokens
        else:
            counters.failed_steps += 1
            counters.errors += 1
            log.error("forward pass failed: %r; its conversation's pages are dropped",
                      result.error)
            for segment in {*(s for s, _p, _c in context.loads), *(s for s, _o in context.writes)}:
                if segment.pins == 1:  # only this step uses it: its contents are unknown
                    self.tiers.lose(segment)
        for segment in context.segments:
            segment.pins -= 1
            if segment.pins == 0:
                if segment.retired:
                    self.tiers.retire(segment)
                elif segment.state is SegmentState.RESIDENT:
                    self.device.touch(segment)
        state = context.conversation
        state.busy = False
        if state.closed:
            self.tiers.retire(state.own)
        if not context.future.done():
            if result.error is None:
                context.future.set_result(None)
            else:
                context.future.set_exception(result.error)
        if not self._closing:
            self.tiers.evict_for(self.settings.low_watermark_pages)
        self._wake.set()

    def _check_load(self, segment: Segment, got: np.ndarray, expected: np.ndarray) -> None:
        assert got.shape == expected.shape
        bad = np.flatnonzero(got != expected)
        self.counters.verified_pages += got.size
        if bad.size:
            self.counters.mismatches += int(bad.size)
            log.error("%r: %d of %d prefetched pages differ from their backup (first: logical "
                      "page %d, device page %d)", segment, bad.size, got.size,
                      segment.first_page + int(bad[0]), int(segment.device_pages[bad[0]]))
        segment.checksums[:got.size] = got  # the pages after them are this step's new ones
        segment.state = SegmentState.RESIDENT
        segment.loading = None
