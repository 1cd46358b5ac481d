"""dsa_async: an asyncio prefetch/eviction service for sparse-attention host-memory offload.

The public surface: the service, its configuration and page geometry, the handles it returns,
and every error class it raises (all subclasses of ``DsaAsyncError``).
"""

import importlib
from typing import TYPE_CHECKING

from ._moved import install as _install_moved
from ._version import __version__

#: Each public name -> the module (under this package) that defines it. They are imported on
#: first use (``from dsa_async import OffloadService``), so ``import dsa_async`` and the
#: command line's first step do not wait seconds for torch.
_DEFINED_IN = {
    "TransferResult": "completion.result", "Transfer": "completion.transfer",
    "PoolSize": "config", "ServiceConfig": "config",
    "OffloadService": "front_door.service", "ServiceStatistics": "front_door.service",
    "HostLayout": "geometry", "KvDtype": "geometry", "PageGeometry": "geometry",
    "dsa_indexer": "geometry", "mla_kv": "geometry",
    "HostPages": "host_memory.pool", "Pages": "paging.tokens",
    **dict.fromkeys((
        "ArgumentTypeError", "ArgumentValueError", "BenchInterrupted", "ConfigError",
        "CopyNotRunError", "CopySkipped", "DsaAsyncError", "HostBudgetExceeded",
        "HostPoolExhausted", "IndexTypeError", "IndexValueError", "LedgerError",
        "LivenessViolation", "OutputWriteError", "PageAlignmentError", "PagesInFlightError",
        "QueueFullError", "ServiceClosedError", "TransferFailedError", "TransferNotDoneError",
        "UnknownHostPagesError", "UnsupportedSettingError", "WrongThreadError"), "errors"),
}

if TYPE_CHECKING:  # what a type checker and an IDE see
    from .completion.result import TransferResult
    from .completion.transfer import Transfer
    from .config import PoolSize, ServiceConfig
    from .errors import (
        ArgumentTypeError,
        ArgumentValueError,
        BenchInterrupted,
        ConfigError,
        CopyNotRunError,
        CopySkipped,
        DsaAsyncError,
        HostBudgetExceeded,
        HostPoolExhausted,
        IndexTypeError,
        IndexValueError,
        LedgerError,
        LivenessViolation,
        OutputWriteError,
        PageAlignmentError,
        PagesInFlightError,
        QueueFullError,
        ServiceClosedError,
        TransferFailedError,
        TransferNotDoneError,
        UnknownHostPagesError,
        UnsupportedSettingError,
        WrongThreadError,
    )
    from .front_door.service import OffloadService, ServiceStatistics
    from .geometry import HostLayout, KvDtype, PageGeometry, dsa_indexer, mla_kv
    from .host_memory.pool import HostPages
    from .paging.tokens import Pages


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (then a plain attribute)."""
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_DEFINED_IN})


__all__ = [
    "__version__",
    # the service and what it takes and returns
    "HostLayout", "HostPages", "KvDtype", "OffloadService", "PageGeometry", "Pages", "PoolSize",
    "ServiceConfig", "ServiceStatistics", "Transfer", "TransferResult", "dsa_indexer", "mla_kv",
    # errors
    "ArgumentTypeError", "ArgumentValueError", "BenchInterrupted", "ConfigError",
    "CopyNotRunError", "CopySkipped", "DsaAsyncError", "HostBudgetExceeded", "HostPoolExhausted",
    "IndexTypeError", "IndexValueError", "LedgerError", "LivenessViolation", "OutputWriteError",
    "PageAlignmentError",
    "PagesInFlightError", "QueueFullError", "ServiceClosedError", "TransferFailedError",
    "TransferNotDoneError", "UnknownHostPagesError", "UnsupportedSettingError",
    "WrongThreadError",
]

_install_moved(__name__)  # the import paths of modules that moved keep working
