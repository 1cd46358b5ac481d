"""SGLang 0.5.23 integration tests: SGLang's own DSA hierarchical cache, on one CPU rank.

These run only in the SGLang venv (``bash .ci/sglang-env.sh`` prints its python) and only when
named: ``"$PY" -m pytest -q tests/integration/sglang``. The main suite never collects this
folder (``norecursedirs`` in pyproject.toml), so it never imports SGLang.

The CPU-only stand-ins are in ``cpu_shims.py`` (each says why it exists and that the cache path
never runs what it stands in for); the build and the scheduler-like driving helpers are in
``dsa_hicache_harness.py``.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    raise pytest.UsageError(
        "tests/integration/sglang needs the SGLang venv; run them with its python:\n"
        '  PY="$(bash .ci/sglang-env.sh)" && "$PY" -m pytest -q tests/integration/sglang'
    )

import cpu_shims  # noqa: E402,F401 - sets HF_HUB_OFFLINE before transformers is imported

# SGLang's modules warn once, at import, about the platform they find (no CUDA for AWQ, GGUF,
# Triton) and pull in two third-party modules that warn about deprecations at import. These are
# facts of importing SGLang on a CPU, not of the cache path; the suite turns warnings into
# errors, so the import alone is done under these exact exemptions.
_IMPORT_TIME_WARNINGS = (
    (UserWarning, r"Only CUDA, HIP and XPU support AWQ currently\."),
    (UserWarning, r"Only CUDA, MUSA and NPU support GGUF quantization currently\."),
    (UserWarning, r"Triton is not supported on current platform, roll back to CPU\."),
    (DeprecationWarning, r"builtin type Swig\w+ has no __module__ attribute"),
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
)

with warnings.catch_warnings():
    for _category, _message in _IMPORT_TIME_WARNINGS:
        warnings.filterwarnings("ignore", message=_message, category=_category)
    from dsa_hicache_harness import (  # noqa: E402
        DsaHiCache,
        DsaHiCacheSettings,
        build_dsa_hicache,
        load_plugins_opted_in,
    )


@pytest.fixture
def dsa_hicache(tmp_path: Path) -> Iterator[Callable[..., DsaHiCache]]:
    """Factory: ``dsa_hicache(**settings)`` builds SGLang's DSA hierarchical cache.

    ``settings`` are the fields of ``DsaHiCacheSettings`` (layers, host pool ratio or size,
    write policy, ``--hicache-mem-layout``, ``--hicache-io-backend``,
    ``--hicache-storage-backend`` None or "file", environment variables, model config and
    server-arg overrides). Every cache built is closed after the test.
    """
    built: list[DsaHiCache] = []

    def build(**settings) -> DsaHiCache:
        cache = build_dsa_hicache(
            DsaHiCacheSettings(**settings), tmp_path / f"cache-{len(built)}"
        )
        built.append(cache)
        return cache

    yield build
    for cache in reversed(built):
        cache.close()


@pytest.fixture(scope="session", autouse=True)
def plugins_loaded_as_an_operator_launches() -> Iterator[None]:
    """SGLang loads plug-ins once per process (``load_plugins``); an operator who wants this one
    launches with ``DSA_ASYNC_SGLANG=1``. So it is loaded here once, opted in, and the variable
    is removed again: each test then opts in or not for its own build (``env=``), which the
    strategy reads when SGLang builds the cache."""
    load_plugins_opted_in()
    yield
