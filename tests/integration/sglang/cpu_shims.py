"""The few stand-ins SGLang 0.5.23's cache code needs to import and build on a CPU-only machine.

Each shim covers something SGLang touches on the way to its DSA hierarchical cache but that the
cache path itself never runs here: an unused import, a GPU query made while resolving server
arguments, and the page-locking of host memory for a GPU that does not exist. Nothing here
stands in for a copy, a completion or a layer gate: those stay SGLang's own (or, later, the
plug-in's), so a test that passes here passed through them.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Iterator

# ServerArgs resolves the model's config through transformers/huggingface_hub, which read this
# at import time; the harness always hands it a local config.json, so the hub is never needed
# and must not be tried (this machine reaches no hub). Set before anything imports them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class _AbsentTorchvisionAttr:
    """Any attribute of the stubbed torchvision: importable, but fails loudly if used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _AbsentTorchvisionAttr:
        if item.startswith("__"):
            raise AttributeError(item)
        return _AbsentTorchvisionAttr(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} was called, but torchvision is only a stub in the SGLang test venv "
            "(the DSA cache path never uses it; see tests/integration/sglang/cpu_shims.py)"
        )

    def __mro_entries__(self, bases):  # a module-level subclass of a torchvision class
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> _AbsentTorchvisionAttr:
        if item.startswith("__"):
            raise AttributeError(item)
        return _AbsentTorchvisionAttr(f"{self.__name__}.{item}")


class TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook that answers ``import torchvision[...]`` with a stub module.

    Why: ``sglang.srt.configs`` imports multimodal utilities at module level
    (``configs/nano_nemotron_vl.py`` -> ``multimodal/internvl_utils.py:5``
    ``import torchvision.transforms``), so even ``memory_pool`` cannot import without it.
    The real torchvision cannot be installed: its wheel pins a CUDA torch and would replace the
    CPU build. The DSA cache path (pools, controller, radix tree) never calls torchvision; any
    call on the stub raises.
    """

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        module.__version__ = "0.0.0+dsa-async-stub"


def install_torchvision_stub() -> None:
    """Install the hook once, ahead of the real path finders (idempotent)."""
    if not any(isinstance(f, TorchvisionStubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionStubFinder())


@contextlib.contextmanager
def gpu_capability_for_arg_resolution(capability: tuple[int, int]) -> Iterator[None]:
    """Answer ``torch.cuda.get_device_capability()`` while ServerArgs are resolved.

    Why: for DeepSeek DSA models SGLang's argument resolution asks the GPU for its compute
    capability to pick the DSA attention backends and the default KV-cache dtype
    (``arg_groups/model_hook.py:341``, ``arg_groups/overrides.py:512`` and ``:631``); a CPU
    torch raises there. Only resolution runs under this context: the cache path never asks.
    ``capability`` stands for the GPU a deployment would have, e.g. (9, 0) for an H100/H200
    (bf16 KV by default) or (10, 0) for a B200 (fp8 KV by default).
    """
    import torch

    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: tuple(capability)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


@contextlib.contextmanager
def host_pools_without_page_locking() -> Iterator[None]:
    """Allocate host pools for a "cpu" device pool without page-locking them.

    Why: SGLang picks the host allocation function by the device pool's device type
    (``pool_host/common.py`` ``ALLOC_MEMORY_FUNCS``, used at ``pool_host/mla.py:434`` and
    ``pool_host/dsa.py:281``); for any type but npu/musa/xpu it is
    ``alloc_with_host_register``, which page-locks through ``torch.cuda.cudart()`` and fails on a
    CPU torch. Here the device pool is itself host memory, so there is nothing to lock for. The
    stand-in is SGLang's own ``alloc_with_host_register`` with ``pin_memory=False``: the same
    allocator (default mmap, or the storage backend's) still allocates every byte. It is
    registered under "cpu" only while a cache is built.
    """
    from sglang.srt.mem_cache.pool_host import common

    def alloc_without_page_locking(
        dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None
    ):
        return common.alloc_with_host_register(
            dims, dtype, device, False, allocator, registration_granularity_bytes
        )

    had_entry = "cpu" in common.ALLOC_MEMORY_FUNCS
    previous = common.ALLOC_MEMORY_FUNCS.get("cpu")
    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_without_page_locking
    try:
        yield
    finally:
        if had_entry:
            common.ALLOC_MEMORY_FUNCS["cpu"] = previous
        else:
            del common.ALLOC_MEMORY_FUNCS["cpu"]
