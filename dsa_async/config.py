"""Service configuration: frozen, validated once at construction, never probes memory."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .errors import ConfigError, as_float, check_fits_int64, is_real_number, shown
from .geometry import PageGeometry, dsa_indexer
from .kinds import Backend, parse_enum


@dataclass(frozen=True)
class PoolSize:
    """Host pool size: ``pages``, ``bytes`` (rounded down to whole pages) or auto.

    Auto is the largest pool that fits the budget, at most ``max_pages`` when given.
    """

    pages: int | None = None
    bytes: int | None = None
    max_pages: int | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.pages, self.bytes) if v is not None]
        if len(given) > 1:
            raise ConfigError("PoolSize takes pages or bytes, not both (neither means auto)")
        for name in ("pages", "bytes", "max_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"PoolSize.{name} must be an int, got {shown(value)}")
            if value is not None and value <= 0:
                raise ConfigError(f"PoolSize.{name} must be > 0, got {shown(value)}; use auto "
                                  f"to fit the pool into the budget")
            if value is not None:
                check_fits_int64(f"PoolSize.{name}", value)
        if self.max_pages is not None and given:
            fixed = "pages" if self.pages is not None else "bytes"
            raise ConfigError(
                f"PoolSize.max_pages caps auto sizing; with {fixed} given it would be ignored: "
                f"drop it, or drop {fixed} to size the pool automatically")

    @classmethod
    def auto(cls, max_pages: int | None = None) -> PoolSize:
        return cls(max_pages=max_pages)

    @property
    def is_auto(self) -> bool:
        return self.pages is None and self.bytes is None


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"ServiceConfig.{name} must be an int, got {shown(value)}")
    if value < low:
        raise ConfigError(f"ServiceConfig.{name} must be >= {low}, got {shown(value)}")
    check_fits_int64(f"ServiceConfig.{name}", value)


def _check_seconds(name: str, value: object) -> float:
    """``value`` as float seconds: a positive finite real number of any type."""
    if not is_real_number(value):
        raise ConfigError(f"ServiceConfig.{name} must be a number of seconds, got {shown(value)}")
    seconds = as_float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ConfigError(f"ServiceConfig.{name} must be a positive finite number of seconds, "
                          f"got {shown(value)}")
    return seconds


def _check_path(name: str, value: object) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"ServiceConfig.{name} must be a directory path (str or os.PathLike) "
                          f"or None, got {shown(value)} ({type(value).__name__})")


@dataclass(frozen=True)
class ServiceConfig:
    """What the service needs to know. Validates types and ranges; probes nothing.

    ``geometries``: one per pool, names matching the device-buffer mapping (a single pool's
    buffers pair with the first geometry). All share one page table and page size.
    """

    geometries: tuple[PageGeometry, ...] = field(default_factory=lambda: (dsa_indexer(),))
    host_pool: PoolSize = field(default_factory=PoolSize.auto)
    backend: Backend = Backend.AUTO
    max_inflight_bytes_d2h: int = 1 << 30
    max_inflight_bytes_h2d: int = 1 << 30
    max_queued_requests: int = 4096
    host_wait_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    reserve_bytes: int | None = None
    budget_root: str | None = None
    ledger_directory: str | None = None
    #: Device staging per copy direction (cuda backend), allocated at start, never later.
    device_staging_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        geometries = self.geometries
        if isinstance(geometries, PageGeometry):
            geometries = (geometries,)
        if not isinstance(geometries, Sequence) or not geometries or not all(
            isinstance(g, PageGeometry) for g in geometries
        ):
            raise ConfigError(f"ServiceConfig.geometries must be PageGeometry values, got "
                              f"{self.geometries!r}")
        object.__setattr__(self, "geometries", tuple(geometries))
        names = [g.name for g in geometries]
        if len(set(names)) != len(names):
            raise ConfigError(f"pool names must be distinct, got {names}")
        if len({g.page_size_tokens for g in geometries}) != 1:
            raise ConfigError("pools that share a page table must share page_size_tokens, got "
                              f"{[(g.name, g.page_size_tokens) for g in geometries]}")
        if not isinstance(self.host_pool, PoolSize):
            raise ConfigError(f"ServiceConfig.host_pool must be a PoolSize (PoolSize(pages=...), "
                              f"PoolSize(bytes=...) or PoolSize.auto()), got {self.host_pool!r}")
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        _check_int("max_inflight_bytes_d2h", self.max_inflight_bytes_d2h, 1)
        _check_int("max_inflight_bytes_h2d", self.max_inflight_bytes_h2d, 1)
        _check_int("max_queued_requests", self.max_queued_requests, 1)
        for name in ("host_wait_timeout_s", "drain_timeout_s"):
            object.__setattr__(self, name, _check_seconds(name, getattr(self, name)))
        if self.reserve_bytes is not None:
            _check_int("reserve_bytes", self.reserve_bytes, 0)
        _check_int("device_staging_bytes", self.device_staging_bytes, 1)
        for name in ("budget_root", "ledger_directory"):
            _check_path(name, getattr(self, name))
        shared_page_bytes = sum(g.bytes_per_page for g in geometries)
        if self.host_pool.bytes is not None and self.host_pool.bytes < shared_page_bytes:
            raise ConfigError(
                f"ServiceConfig.host_pool=PoolSize(bytes={self.host_pool.bytes:,}) holds no "
                f"whole page: one page of {'+'.join(names)} takes {shared_page_bytes:,} B; give "
                f"at least that, a page count (PoolSize(pages=...)) or PoolSize.auto()")
        widest_row = max(g.bytes_per_page_per_layer for g in geometries)
        if self.device_staging_bytes < 2 * widest_row:  # two halves of one page row each
            raise ConfigError(
                f"ServiceConfig.device_staging_bytes={self.device_staging_bytes:,} is below two "
                f"page rows of the widest pool ({widest_row:,} B each); give at least "
                f"{2 * widest_row:,} B (default {64 << 20:,})")

    @property
    def page_size_tokens(self) -> int:
        return self.geometries[0].page_size_tokens

    @property
    def num_layers(self) -> int:
        return max(g.num_layers for g in self.geometries)
