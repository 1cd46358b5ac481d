"""Closed vocabularies used across the package.

Every label value a metric can carry and every choice a config can make is one of these enums,
so code compares members, never strings. ``value`` is the spelling users type and Prometheus shows.
"""

from __future__ import annotations

import enum


class _FastEnum(enum.Enum):
    """Members hash by identity: they are singletons, and the hot path keys dicts by them
    (``Enum.__hash__`` hashes the member name on every lookup)."""

    __hash__ = object.__hash__


class Direction(_FastEnum):
    """Which way a copy moves bytes."""

    D2H = "d2h"  #: device to host: backing pages up (eviction)
    H2D = "h2d"  #: host to device: loading pages back (prefetch)


class Outcome(_FastEnum):
    """How an accepted request ended. Every accepted request ends in exactly one of these."""

    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Timeliness(_FastEnum):
    """Whether a prefetched layer was ready before its consumer asked for it."""

    ON_TIME = "on_time"
    LATE = "late"
    WASTED = "wasted"


class PoolState(_FastEnum):
    """Host pool byte states exported as a gauge."""

    USED = "used"
    FREE = "free"
    IN_FLIGHT = "in_flight"


class BudgetKind(_FastEnum):
    """Budget figures exported as a gauge, read from the probe at scrape time."""

    LIMIT = "limit"
    RESERVED = "reserved"
    AVAILABLE = "available"
    RESERVE = "reserve"
    FREE = "free"


class Backend(_FastEnum):
    """Transfer backend. ``AUTO`` resolves once, at construction, to CUDA when available."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


def parse_enum(enum_cls: type[enum.Enum], value: object, setting: str) -> enum.Enum:
    """Return the member of ``enum_cls`` spelled ``value`` (a member or its string value).

    Raises ``ConfigError`` naming the setting, the value and the accepted spellings.
    """
    from .errors import ConfigError

    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if member.value == value:
            return member
    choices = ", ".join(repr(m.value) for m in enum_cls)
    raise ConfigError(f"{setting}={value!r} is not a known value; use one of {choices}")


# Python 3.11's EnumType defines ``__getattr__``, which turns every ``Direction.D2H`` into a
# slow attribute look-up (~150 ns, against ~10 ns for a module global). The per-request paths
# name the members through these aliases.
D2H, H2D = Direction.D2H, Direction.H2D
DONE, FAILED, CANCELLED = Outcome.DONE, Outcome.FAILED, Outcome.CANCELLED
