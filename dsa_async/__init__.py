"""dsa_async: an asyncio prefetch/eviction service for sparse-attention host-memory offload.

The public surface: the service, its configuration and page geometry, the handles it returns,
and every error class it raises (all subclasses of ``DsaAsyncError``).
"""

from ._moved import install as _install_moved
from ._version import __version__
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
