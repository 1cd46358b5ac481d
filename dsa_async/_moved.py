"""Import paths of modules that moved into subpackages keep working, with a warning.

Every module used to sit at the package root (``dsa_async.budget``, ``dsa_async.exposition``,
...). Importing such a path now gives the module at its new place, the very same module object
(so ``monkeypatch`` on it patches the real one), after a ``DeprecationWarning`` that names the new
path. A module whose contents were split between modules gives a read-only view of the names it
had. Installed once by the package root; never blocks.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module (under ``dsa_async.``) -> the module(s) holding its names now, in lookup order.
MOVED: dict[str, tuple[str, ...]] = {
    "service": ("front_door.service",),
    "producers": ("front_door.producers",),
    "thread_submit": ("front_door.thread_submit",),
    "pages": ("paging.tokens", "paging.runs"),
    "page_seq": ("paging.tokens", "paging.runs"),
    "aligned_tokens": ("paging.tokens", "paging.runs"),
    "page_indices": ("paging.tokens",),
    "device_indices": ("paging.device_indices",),
    "scheduler": ("scheduling.scheduler",),
    "hazards": ("scheduling.hazards",),
    "liveness": ("scheduling.liveness",),
    "loop_producers": ("scheduling.loop_producers",),
    "request": ("scheduling.request", "completion.transfer", "completion.result"),
    "budget": ("host_memory.budget",),
    "ledger": ("host_memory.ledger",),
    "plan": ("host_memory.plan",),
    "host_pool": ("host_memory.pool",),
    "extents": ("host_memory.extents",),
    "metrics": ("observability.metrics",),
    "batch_metrics": ("observability.batch_metrics",),
    "exposition": ("observability.exposition",),
    "loop_lag": ("observability.loop_lag",),
    "cli_bench": ("cli.bench",),
    "cli_plan": ("cli.plan",),
    "cli_serve": ("cli.serve",),
}


class _MovedView(types.ModuleType):
    """The names an old module had, looked up in the modules that hold them now."""

    def __init__(self, name: str, homes: tuple[types.ModuleType, ...]) -> None:
        super().__init__(name, f"Moved: see {', '.join(m.__name__ for m in homes)}.")
        self._homes = homes

    def __getattr__(self, attr: str) -> object:
        for home in self._homes:
            if hasattr(home, attr):
                return getattr(home, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _Loader(importlib.abc.Loader):
    def __init__(self, package: str, old: str, new: tuple[str, ...]) -> None:
        self._package, self._old, self._new = package, old, new

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: types.ModuleType) -> None:
        new_names = [f"{self._package}.{name}" for name in self._new]
        warnings.warn(f"{self._package}.{self._old} moved to {' and '.join(new_names)}; "
                      f"import it from there", DeprecationWarning,
                      stacklevel=2)  # the importer: warn() skips the import system's frames
        homes = tuple(importlib.import_module(name) for name in new_names)
        target = homes[0] if len(homes) == 1 else _MovedView(module.__name__, homes)
        # The import system returns whatever sys.modules holds under the name after exec.
        sys.modules[module.__name__] = target


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``<package>.<old name>`` for the names in :data:`MOVED`, and nothing else."""

    def __init__(self, package: str) -> None:
        self._package = package

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        package, _, old = fullname.rpartition(".")
        if package != self._package or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(
            fullname, _Loader(package, old, MOVED[old]))


def install(package: str) -> None:
    """Make the old import paths of ``package`` resolve (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder(package))
