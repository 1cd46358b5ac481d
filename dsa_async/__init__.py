"""dsa_async: an asyncio prefetch/eviction service for sparse-attention host-memory offload.

The public surface: the service, its configuration and page geometry, the handles it returns,
and every error class it raises (all subclasses of ``DsaAsyncError``).
"""

from ._version import __version__
from .config import PoolSize, ServiceConfig
from .errors import (
    ConfigError,
    DsaAsyncError,
    HostBudgetExceeded,
    HostPoolExhausted,
    IndexTypeError,
    IndexValueError,
    LedgerError,
    LivenessViolation,
    PageAlignmentError,
    PagesInFlightError,
    QueueFullError,
    ServiceClosedError,
    TransferFailedError,
    UnknownHostPagesError,
    UnsupportedSettingError,
)
from .geometry import HostLayout, KvDtype, PageGeometry, dsa_indexer, mla_kv
from .handle import Transfer
from .host_pool import HostPages
from .page_indices import Pages
from .result import TransferResult
from .service import OffloadService, ServiceStatistics

__all__ = [
    "__version__",
    # the service and what it takes and returns
    "HostLayout", "HostPages", "KvDtype", "OffloadService", "PageGeometry", "Pages", "PoolSize",
    "ServiceConfig", "ServiceStatistics", "Transfer", "TransferResult", "dsa_indexer", "mla_kv",
    # errors
    "ConfigError", "DsaAsyncError", "HostBudgetExceeded", "HostPoolExhausted", "IndexTypeError",
    "IndexValueError", "LedgerError", "LivenessViolation", "PageAlignmentError",
    "PagesInFlightError", "QueueFullError", "ServiceClosedError", "TransferFailedError",
    "UnknownHostPagesError", "UnsupportedSettingError",
]
