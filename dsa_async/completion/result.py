"""What a finished request moved (``TransferResult``), as a caller reads it.

Built once per request on the loop thread when its copy ends; frozen. Pure data, never blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..host_memory.pool import HostPages
from ..kinds import Direction


@dataclass(frozen=True, init=False)
class TransferResult:
    """What a finished request moved. ``device_s``: the copy batch's device-timed duration."""

    direction: Direction
    pages: int
    bytes: int
    padded_tokens: int
    device_s: float
    host_pages: HostPages | None  #: evictions: where the pages were backed up

    def __init__(self, direction: Direction, pages: int, bytes: int,  # noqa: A002 - the field
                 padded_tokens: int, device_s: float, host_pages: HostPages | None) -> None:
        # One result per request: plain stores into the instance dict instead of the generated
        # frozen __init__'s six object.__setattr__ calls. Still frozen (assignment raises).
        fields = self.__dict__
        fields["direction"] = direction
        fields["pages"] = pages
        fields["bytes"] = bytes
        fields["padded_tokens"] = padded_tokens
        fields["device_s"] = device_s
        fields["host_pages"] = host_pages
