"""Suite-wide wiring: uvloop for every asyncio test, clean skips for GPU tests, ``--soak``."""

from __future__ import annotations

import pytest
import uvloop


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config, item):  # noqa: ARG001 - hook signature
    """Run every asyncio test on uvloop, as the inference server does."""
    return {"uvloop": uvloop.new_event_loop}


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long soak test (dsa-async serve for DSA_ASYNC_SOAK_S seconds)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _skip_marked(items, marker: str, reason: str) -> None:
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--soak"):
        _skip_marked(items, "soak", "soak run: pass --soak (and DSA_ASYNC_SOAK_S) to run it")
    if not _cuda_available():
        _skip_marked(items, "gpu", "needs a CUDA device; none is available here")
