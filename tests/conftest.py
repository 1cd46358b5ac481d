"""Suite-wide wiring: uvloop for every asyncio test, and clean skips for GPU tests."""

from __future__ import annotations

import pytest
import uvloop


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config, item):  # noqa: ARG001 - hook signature
    """Run every asyncio test on uvloop, as the inference server does."""
    return {"uvloop": uvloop.new_event_loop}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
