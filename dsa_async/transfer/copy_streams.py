"""The engine's copy streams: created for it alone, checked distinct, kept at close.

``torch.cuda.Stream()`` takes a stream from PyTorch's fixed pool (32 per priority per device,
handed out round-robin), so once a server has created enough streams a "new" copy stream can
be the forward pass's stream or the other direction's, and the copies would then be ordered
behind that work (or it behind them). These streams are created through the CUDA driver
instead (``cuStreamCreateWithPriority``, non-blocking, so no implicit ordering with the legacy
default stream) and wrapped as ``torch.cuda.ExternalStream``: no other part of the process can
receive them. Loads (H2D) get the highest priority the device offers, because the forward
pass waits on them layer by layer; backups (D2H) the lowest.

A closed engine's streams are not destroyed: they go to a per-device spare list and the next
engine on that device takes them. torch may still record an event on them after the engine
closed: a tensor given ``record_stream`` (a device index tensor the index stream read) or a
pinned buffer a copy read records one on each such stream when it is freed, possibly long
after, and recording on a destroyed stream is an error raised inside a destructor. So the
streams alive per device are at most those of the engines ever open at the same time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..kinds import Direction
from . import cuda_driver


class CopyStreamError(RuntimeError):
    """The copy streams could not be created, or are not distinct from other streams."""


#: Closed engines' streams per device ordinal, for the next engine there: (h2d, d2h, index)
#: handles, the directions' at their priorities (see the module docstring).
_SPARE: dict[int, list[tuple[int, int, int]]] = {}
_SPARE_LOCK = threading.Lock()


@dataclass(frozen=True)
class CopyStreams:
    """One stream per direction on ``device``, owned by one engine, and a third one for the
    small copies of device index tensors to the host (``index``, at the loads' priority: a
    load's batch waits for its indices)."""

    device: torch.device
    streams: dict[Direction, torch.cuda.ExternalStream]
    priorities: dict[Direction, int]
    index: torch.cuda.ExternalStream | None = None

    @classmethod
    def create(cls, device: torch.device) -> CopyStreams:
        """The three streams, a closed engine's on this device if one is spare, else new
        ones. On the calling thread; blocks briefly (driver calls)."""
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        least, greatest = cuda_driver.stream_priority_range(ordinal)
        priorities = {Direction.H2D: greatest, Direction.D2H: least}
        with _SPARE_LOCK:
            spare = _SPARE.get(ordinal)
            triple = spare.pop() if spare else None
        fresh = triple is None
        if fresh:
            triple = _create_three(ordinal, priorities, greatest, device)
        h2d, d2h, index = triple
        made = cls(torch.device("cuda", ordinal),
                   {Direction.H2D: torch.cuda.ExternalStream(h2d, device=device),
                    Direction.D2H: torch.cuda.ExternalStream(d2h, device=device)},
                   priorities, torch.cuda.ExternalStream(index, device=device))
        try:
            made.check_distinct([torch.cuda.current_stream(device),
                                 torch.cuda.default_stream(device)])
        except CopyStreamError:
            if fresh:  # nothing ever used them: nothing can record on them later
                for handle in triple:
                    cuda_driver.destroy_stream(ordinal, handle)
            else:
                made.retire()
            raise
        return made

    @property
    def handles(self) -> dict[Direction, int]:
        """The raw ``cudaStream_t`` of each direction."""
        return {d: int(s.cuda_stream) for d, s in self.streams.items()}

    def _own_handles(self) -> dict[str, int]:
        """Every stream this object owns, by name (the directions' and the index stream)."""
        owned = {d.value: h for d, h in self.handles.items()}
        if self.index is not None:
            owned["index"] = int(self.index.cuda_stream)
        return owned

    def check_distinct(self, others: list[torch.cuda.Stream]) -> None:
        """Raise ``CopyStreamError`` unless the streams are non-null, differ from each other
        and from every stream in ``others``."""
        ours = self._own_handles()
        if 0 in ours.values() or len(set(ours.values())) != len(ours):
            raise CopyStreamError(f"copy streams are not {len(ours)} distinct streams: {ours}")
        for other in others:
            handle = int(other.cuda_stream)
            clash = [name for name, h in ours.items() if h == handle]
            if clash:
                raise CopyStreamError(f"the {clash[0]} copy stream {handle:#x} is also {other}; "
                                      f"copies would be ordered with that stream's work")

    def retire(self) -> None:
        """Keep the streams for the next engine on this device (see the module docstring).
        Call only once nothing is queued on them (after synchronize), once."""
        triple = (int(self.streams[Direction.H2D].cuda_stream),
                  int(self.streams[Direction.D2H].cuda_stream), int(self.index.cuda_stream))
        with _SPARE_LOCK:
            _SPARE.setdefault(self.device.index, []).append(triple)


def _create_three(ordinal: int, priorities: dict[Direction, int], index_priority: int,
                  device: torch.device) -> tuple[int, int, int]:
    """New (h2d, d2h, index) streams; on a failure the ones already made are destroyed
    (nothing used them) and ``CopyStreamError`` raised."""
    made: list[int] = []
    try:
        for priority in (priorities[Direction.H2D], priorities[Direction.D2H], index_priority):
            made.append(cuda_driver.create_stream(ordinal, priority))
    except cuda_driver.CudaDriverError as exc:
        for handle in made:
            cuda_driver.destroy_stream(ordinal, handle)
        raise CopyStreamError(f"could not create the copy streams on {device}: {exc}") from exc
    h2d, d2h, index = made
    return h2d, d2h, index
