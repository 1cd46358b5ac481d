"""The engine's copy streams: created for it alone, checked distinct, destroyed at close.

``torch.cuda.Stream()`` takes a stream from PyTorch's fixed pool (32 per priority per device,
handed out round-robin), so once a server has created enough streams a "new" copy stream can
be the forward pass's stream or the other direction's, and the copies would then be ordered
behind that work (or it behind them). These streams are created through the CUDA driver
instead (``cuStreamCreateWithPriority``, non-blocking, so no implicit ordering with the legacy
default stream) and wrapped as ``torch.cuda.ExternalStream``: no other part of the process can
receive them. Loads (H2D) get the highest priority the device offers, because the forward
pass waits on them layer by layer; backups (D2H) the lowest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kinds import Direction
from . import cuda_driver


class CopyStreamError(RuntimeError):
    """The copy streams could not be created, or are not distinct from other streams."""


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
        """Create the three streams on the calling thread. Blocks briefly (driver calls)."""
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        least, greatest = cuda_driver.stream_priority_range(ordinal)
        priorities = {Direction.H2D: greatest, Direction.D2H: least}
        handles: dict[Direction, int] = {}
        index_handle = None
        try:
            for direction, priority in priorities.items():
                handles[direction] = cuda_driver.create_stream(ordinal, priority)
            index_handle = cuda_driver.create_stream(ordinal, greatest)
        except cuda_driver.CudaDriverError as exc:
            for handle in handles.values():
                cuda_driver.destroy_stream(ordinal, handle)
            raise CopyStreamError(f"could not create the copy streams on {device}: {exc}") from exc
        streams = {d: torch.cuda.ExternalStream(h, device=device) for d, h in handles.items()}
        made = cls(torch.device("cuda", ordinal), streams, priorities,
                   torch.cuda.ExternalStream(index_handle, device=device))
        try:
            made.check_distinct([torch.cuda.current_stream(device),
                                 torch.cuda.default_stream(device)])
        except CopyStreamError:
            made.destroy()
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

    def destroy(self) -> None:
        """Destroy the streams. Call only once nothing is queued on them (after synchronize)."""
        ordinal = self.device.index
        for handle in self._own_handles().values():
            cuda_driver.destroy_stream(ordinal, handle)
