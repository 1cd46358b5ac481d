"""The service's own figures, read from its metrics registry (``service.registry``).

Reading is cheap and thread-safe, and works after ``close()``: the registry outlives the service.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ..kinds import Direction, Outcome, PoolState, Timeliness
from ..observability.metrics import PREFIX


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(PREFIX + name, labels)
    return 0.0 if value is None else value


@dataclass(frozen=True)
class ServiceReadings:
    bytes_d2h: int
    bytes_h2d: int
    requests_d2h: int  #: ended done
    requests_h2d: int
    failed_requests: int  #: either direction
    cancelled_requests: int
    transfer_errors: int  #: failed copy batches
    padding_bytes: int
    prefetch_layers_on_time: int
    prefetch_layers_late: int
    prefetch_layers_wasted: int
    host_pool_used_bytes: int
    host_pool_capacity_bytes: int

    @classmethod
    def read(cls, registry: CollectorRegistry) -> ServiceReadings:
        def per_direction(name: str, **labels: str) -> dict[Direction, int]:
            return {d: int(_value(registry, name, direction=d.value, **labels)) for d in Direction}

        moved = per_direction("transfer_bytes_total")
        done = per_direction("requests_total", outcome=Outcome.DONE.value)
        failed = per_direction("requests_total", outcome=Outcome.FAILED.value)
        cancelled = per_direction("requests_total", outcome=Outcome.CANCELLED.value)
        errors = per_direction("transfer_errors_total")
        padding = per_direction("padding_bytes_total")
        layers = {t: int(_value(registry, "prefetch_layers_total", timeliness=t.value))
                  for t in Timeliness}
        return cls(
            bytes_d2h=moved[Direction.D2H], bytes_h2d=moved[Direction.H2D],
            requests_d2h=done[Direction.D2H], requests_h2d=done[Direction.H2D],
            failed_requests=sum(failed.values()), cancelled_requests=sum(cancelled.values()),
            transfer_errors=sum(errors.values()), padding_bytes=sum(padding.values()),
            prefetch_layers_on_time=layers[Timeliness.ON_TIME],
            prefetch_layers_late=layers[Timeliness.LATE],
            prefetch_layers_wasted=layers[Timeliness.WASTED],
            host_pool_used_bytes=int(_value(registry, "host_pool_bytes",
                                            state=PoolState.USED.value)),
            host_pool_capacity_bytes=int(_value(registry, "host_pool_capacity_bytes")),
        )

    @property
    def host_pool_use(self) -> float:
        """Fraction of the host pool holding pages (0..1)."""
        cap = self.host_pool_capacity_bytes
        return self.host_pool_used_bytes / cap if cap else 0.0
