"""Device-true prefetch timeliness: did the consumer's stream actually wait for a layer?

When a forward-pass thread asks for layer *i* (``CudaEngine.wait_layer``), a timing event, the
*probe*, is recorded on its current stream first. The probe completes when that stream has run
everything queued before the request, i.e. when the stream was ready to use the layer. Once
the layer's event completed, the two are compared::

    probe not complete yet            -> on time (the layer landed before the stream got there)
    probe.elapsed_time(layer) <= 0    -> on time
    probe.elapsed_time(layer) >  0    -> late, the stream waited that long (ms)

The completion thread resolves every probe of a batch before its events go back to the pool
(an event's timestamp is only meaningful until it is recorded again).

A probe is *armed* only once its ``wait_layer`` call is about to return normally; the
completion thread calls ``classify`` for armed probes and stores the verdict of unarmed ones
for their caller, so ``classify`` runs exactly once per call that returns and never for a call
that raises (timeout or failure).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

Classify = Callable[[bool, float], None]
ON_TIME = (False, 0.0)


class LayerProbe:
    """One ``wait_layer`` call's probe. Fields are guarded by the batch's progress lock."""

    __slots__ = ("armed", "cancelled", "classify", "event", "layer", "verdict")

    def __init__(self, layer: int, event: torch.cuda.Event, classify: Classify) -> None:
        self.layer = layer
        self.event = event
        self.classify = classify
        self.armed = False  #: its wait_layer returns normally: the completion thread classifies
        self.cancelled = False  #: its wait_layer raised: nobody classifies
        self.verdict: tuple[bool, float] | None = None  #: resolved before it was armed


def verdict(probe: torch.cuda.Event, layer_event: torch.cuda.Event | None) -> tuple[bool, float]:
    """``(late, waited_s)`` for a probe whose layer event completed. Never blocks."""
    try:
        if layer_event is None or not probe.query():
            return ON_TIME  # the consumer's stream had not reached its wait when the layer was done
        waited_ms = probe.elapsed_time(layer_event)  # layer done minus consumer ready
    except RuntimeError:  # an event without timing, or a device fault: no device verdict
        log.debug("no device timestamps for a layer probe; counted on time", exc_info=True)
        return ON_TIME
    return (True, waited_ms / 1e3) if waited_ms > 0 else ON_TIME


def call_classify(classify: Classify, late: bool, waited_s: float) -> None:
    """Run a caller's ``classify``; its errors are logged, never raised into engine threads."""
    try:
        classify(late, waited_s)
    except Exception:  # noqa: BLE001 - a metrics callback must not stop the completion thread
        log.exception("prefetch timeliness callback failed")
