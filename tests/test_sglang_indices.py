"""The SGLang plug-in moves every pool of a transfer list with the KV anchor's one index pair:
it accepts the indexer's indices when they hold the anchor's values, including device indices
that are separate tensors of equal values (SGLang concatenates merged operations per pool), and
refuses indices that differ in what it can see without blocking on the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsa_async.integrations.sglang.engine import _same_indices


def _transfer(host: torch.Tensor, device: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(host_indices=host, device_indices=device)


def test_equal_values_in_separate_tensors_are_the_same_indices():
    host = torch.arange(0, 192)
    anchor = _transfer(host, torch.arange(640, 832))
    merged = _transfer(torch.cat([host[:64], host[64:]]), torch.cat(
        [torch.arange(640, 704), torch.arange(704, 832)]))
    assert _same_indices(merged, anchor)
    device_like = torch.empty(192, dtype=torch.int64, device="meta")  # stands in for a GPU's
    assert _same_indices(_transfer(host, device_like),
                         _transfer(host, torch.empty(192, dtype=torch.int64, device="meta")))


@pytest.mark.parametrize("change", ["host-values", "device-values", "shape", "dtype", "device"])
def test_indices_that_differ_are_refused(change):
    host, device = torch.arange(0, 128), torch.arange(640, 768)
    anchor = _transfer(host, device)
    other = {
        "host-values": _transfer(host + 64, device),
        "device-values": _transfer(host, device + 64),
        "shape": _transfer(host[:64], device[:64]),
        "dtype": _transfer(host, device.to(torch.int32)),
        "device": _transfer(host, torch.empty(128, dtype=torch.int64, device="meta")),
    }[change]
    assert not _same_indices(other, anchor)


def test_a_budget_refusal_names_sglangs_flags():
    """Started by the SGLang plug-in, the host pool follows --hicache-size / --hicache-ratio:
    the refusal says to change those, not the standalone service's settings."""
    from dsa_async.errors import HostBudgetExceeded
    from dsa_async.host_memory.plan import HOST_POOL_SETTING
    from dsa_async.integrations.sglang.host_views import in_sglang_terms

    refusal = HostBudgetExceeded(
        f"host pool refused\n  to fix: lower {HOST_POOL_SETTING} to <= 22.99 GB, or use auto, "
        f"or raise the container's memory limit")
    message = str(in_sglang_terms(refusal))
    assert "--hicache-size" in message and "--hicache-ratio" in message
    assert "--host-pool-gb" not in message and "use auto" not in message
    assert "<= 22.99 GB" in message and "raise the container's memory limit" in message
