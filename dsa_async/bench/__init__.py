"""``dsa-async bench``: every performance figure as a ratio measured in one run on one machine.

Importing this package registers the built-in scenarios. To add figures, write a module that
calls :func:`register_target` and :func:`register_scenario` and import it below.
"""

from . import (  # noqa: F401 - registers them
    copy_scenarios,
    cuda_launch_scenarios,
    pool_scenarios,
    overlap_scenario,  # after the pool: its import registers the scheduler scenario first
    scale_scenarios,
    service_scenarios,
    thread_scenarios,
)
from .registry import (
    SCENARIOS,
    TARGETS,
    BenchContext,
    Comparison,
    Target,
    register_scenario,
    register_target,
)

__all__ = [
    "SCENARIOS",
    "TARGETS",
    "BenchContext",
    "Comparison",
    "Target",
    "register_scenario",
    "register_target",
]
