"""A host budget refusal through SGLang's own build tells the operator SGLang values that fit.

SGLang's ``--hicache-size`` names the KV host pool alone (the indexer pool comes on top) and
``--hicache-ratio`` multiplies the device pool, so the service's largest pool in GB is no value
for either flag. The rule checked on SGLang's real sizing code: the largest value the refusal
names builds, and the next one up is refused again. The budget is a fake ``/proc`` tree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dsa_async.errors import HostBudgetExceeded
from dsa_async.integrations.sglang import strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the fake /proc trees
from fake_roots import make_root  # noqa: E402

OPT_IN = {"DSA_ASYNC_SGLANG": "1"}
#: a layout the plug-in serves (SGLang's default, page_first, is refused)
LAYOUT = {"mem_layout": "layer_first", "io_backend": "direct"}


@pytest.fixture
def budget(tmp_path, monkeypatch):
    """``budget(available_bytes)``: the next builds see that much host memory, no reserve."""

    def set_available(available_bytes: int) -> None:
        root = make_root(tmp_path / f"budget-{available_bytes}", mem_available_bytes=available_bytes)
        monkeypatch.setitem(strategy.SERVICE_OPTIONS, "config", {
            "budget_root": str(root), "reserve_bytes": 0,
            "ledger_directory": str(tmp_path / "ledger")})

    return set_available


def _refusal(build, **settings) -> str:
    with pytest.raises(HostBudgetExceeded) as refused:
        build(**settings)
    message = str(refused.value)
    assert "--host-pool-gb" not in message and "use auto" not in message, message
    return message


def test_the_hicache_size_it_names_fits_and_one_more_gb_does_not(dsa_hicache, budget):
    budget(2_600_000 * 1024)
    message = _refusal(dsa_hicache, hicache_size_gb=40, env=OPT_IN, **LAYOUT)
    named = re.search(r"lower SGLang's --hicache-size to <= (\d+) \(GB per rank", message)
    assert named, message
    size_gb = int(named.group(1))
    assert size_gb >= 1
    assert re.search(r"set --hicache-size 0 and --hicache-ratio <= [0-9]+\.[0-9]{2}", message)
    cache = dsa_hicache(hicache_size_gb=size_gb, env=OPT_IN, **LAYOUT)  # fits: builds
    cache.close()
    _refusal(dsa_hicache, hicache_size_gb=size_gb + 1, env=OPT_IN, **LAYOUT)


def test_the_hicache_ratio_it_names_fits_and_one_hundredth_more_does_not(dsa_hicache, budget):
    budget(8_000 * 1024)  # a few dozen pages: the 16-page device pool times a ratio near 3
    message = _refusal(dsa_hicache, hicache_ratio=40.0, env=OPT_IN, **LAYOUT)
    named = re.search(r"lower SGLang's --hicache-ratio to <= ([0-9]+\.[0-9]{2})", message)
    assert named, message
    ratio = float(named.group(1))
    cache = dsa_hicache(hicache_ratio=ratio, env=OPT_IN, **LAYOUT)
    cache.close()
    _refusal(dsa_hicache, hicache_ratio=round(ratio + 0.01, 2), env=OPT_IN, **LAYOUT)
