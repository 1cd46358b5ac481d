"""dsa_async as the transfer engine of SGLang 0.5.23's DSA hierarchical cache (a plug-in).

SGLang loads every installed plug-in of the entry-point group ``sglang.srt.plugins`` in each of
its processes (``SGLANG_PLUGINS`` is a whitelist of names; empty loads all) and calls its
``register()``. This one is active only when asked: with ``DSA_ASYNC_SGLANG=1`` in the
environment, ``register()`` registers a stack strategy that builds the hierarchical cache of
DSA models (DeepSeek-V3.2) on this project's service; without it, ``register()`` does nothing.
The strategy reads the variable again when SGLang builds the cache, so a process that loaded
the plug-in with it and builds without it gets SGLang's own cache.

What the strategy does (strategy.py): it refuses, before anything is allocated, the settings it
cannot serve (refusals.py, each naming the SGLang flag); it starts one ``OffloadService`` per
scheduler process on an event-loop thread of its own (``ServiceThread``), whose budget check and
machine-wide ledger reservation come first; SGLang's MLA KV and indexer host pools are views of
the service's arenas (one allocation, the bytes SGLang's L3 storage backends read); the
controller's transfer engine and layer counter are the service's (engine.py, layer_counter.py).
"""

from __future__ import annotations

from .opt_in import OPT_IN_VARIABLE, opted_in

__all__ = ["OPT_IN_VARIABLE", "opted_in", "register"]

_registered = False


def register() -> None:
    """SGLang's plug-in hook: register the stack strategy when opted in; else do nothing.

    Called by SGLang in every process it starts (scheduler, tokenizer, detokenizer); only the
    scheduler builds a cache, so elsewhere the registration is never used. Idempotent."""
    global _registered
    if not opted_in() or _registered:
        return
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import register_stack_strategy

    from .strategy import DsaAsyncStrategy

    register_stack_strategy(DsaAsyncStrategy())
    _registered = True
