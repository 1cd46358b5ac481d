"""dsa_async: an asyncio prefetch/eviction service for sparse-attention host-memory offload."""

__version__ = "0.1.0"
