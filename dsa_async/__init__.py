"""dsa_async: an asyncio prefetch/eviction service for sparse-attention host-memory offload."""

__version__ = "0.1.0"

from .config import PoolSize, ServiceConfig  # noqa: E402
from .geometry import HostLayout, KvDtype, PageGeometry, dsa_indexer, mla_kv  # noqa: E402
from .host_pool import HostPages  # noqa: E402
from .page_indices import Pages  # noqa: E402
from .request import Transfer, TransferResult  # noqa: E402
from .service import OffloadService, ServiceStatistics  # noqa: E402

__all__ = [
    "HostLayout", "HostPages", "KvDtype", "OffloadService", "PageGeometry", "Pages", "PoolSize",
    "ServiceConfig", "ServiceStatistics", "Transfer", "TransferResult", "dsa_indexer", "mla_kv",
]
