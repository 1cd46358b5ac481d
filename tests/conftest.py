"""Suite-wide wiring: uvloop for every asyncio test, clean skips for GPU tests, ``--soak``."""

from __future__ import annotations

import pytest
import uvloop


#: what reached a test loop's exception handler: an exception raised in a callback, a task's
#: or future's exception nobody retrieved. The service must never send anything there.
_loop_errors: list[dict] = []


def _new_test_loop() -> uvloop.Loop:
    loop = uvloop.new_event_loop()

    def record(loop, context: dict) -> None:
        _loop_errors.append(context)
        loop.default_exception_handler(context)

    loop.set_exception_handler(record)
    return loop


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(config, item):  # noqa: ARG001 - hook signature
    """Run every asyncio test on uvloop, as the inference server does, with a loop that
    remembers what reached its exception handler (a test that expects such a report sets a
    handler of its own)."""
    return {"uvloop": _new_test_loop}


@pytest.fixture(autouse=True)
def no_loop_errors():
    """Fail a test whose loop's exception handler was called: a crash in a loop callback
    (a timer, a done callback) is otherwise only logged while requests still end."""
    _loop_errors.clear()
    yield
    reported, _loop_errors[:] = list(_loop_errors), []
    assert not reported, f"the loop's exception handler was called: {reported}"


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
