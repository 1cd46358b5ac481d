"""Small real services on the CPU backend, with private ledgers, for the service tests."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import torch

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.front_door.service import OffloadService
from dsa_async.geometry import dsa_indexer, mla_kv
from dsa_async.transfer.cpu import CpuEngine

PAGE = 64


def make_buffers(geometry, device_pages: int, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (device_pages, geometry.bytes_per_page_per_layer),
                          dtype=torch.uint8, generator=gen) for _ in range(geometry.num_layers)]


class CaptureRecordingEngine(CpuEngine):
    """A CPU engine that records on which thread each default producer is captured."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.captured_on: list[int] = []

    def capture_producer(self):
        self.captured_on.append(threading.get_ident())
        return None


class DeviceDecides(CpuEngine):
    """Copies as the CPU engine does, but rules on lateness as the CUDA engine does: only a
    consumer that waited on the device counts as late (none here), never a thread's own wait
    for the copy to start. Its copies are done by the time it hands a batch back, so a
    consumer woken by the start finds its layer already copied (gate its requests with loop
    producers: an engine producer would hold the loop in ``submit``)."""

    waits_on_device = True
    BOUND_S = 10

    def submit(self, batch):
        handle = super().submit(batch)
        handle.wait_ready(self.num_layers - 1, self.BOUND_S)
        return handle

    def wait_layer(self, handle, layer, timeout_s, classify):
        handle.wait_ready(layer, timeout_s)
        classify(False, 0.0)


class LateIndexEngine(CpuEngine):
    """The CPU engine, deferring every index *tensor* the way the CUDA engine defers CUDA ones:
    submit checks only its shape, and the worker reads the values when it resolves the batch,
    after the request's producers (device_indices.py). Ranges, arrays and lists are still read
    at submit."""

    def defers_indices(self, tensor) -> bool:
        return True

    def stage_indices(self, tensor, producers):
        return lambda: tensor.numpy()  # read when the worker resolves the batch


def offset_layers(geometry, device_pages: int, offset_bytes: int, gap_bytes: int | None,
                  gen: torch.Generator) -> list[torch.Tensor]:
    """Per-layer ``uint8 [device_pages, row]`` tensors starting ``offset_bytes`` into their
    storage: each layer in its own allocation (``gap_bytes`` None) or views of one allocation
    with ``gap_bytes`` between consecutive layers."""
    row = geometry.bytes_per_page_per_layer
    size = device_pages * row
    if gap_bytes is None:
        layers = []
        for _ in range(geometry.num_layers):
            base = torch.randint(0, 256, (size + offset_bytes,), dtype=torch.uint8, generator=gen)
            layers.append(base[offset_bytes:].view(device_pages, row))
        return layers
    step = size + gap_bytes
    base = torch.randint(0, 256, (offset_bytes + step * geometry.num_layers,), dtype=torch.uint8,
                         generator=gen)
    return [base[offset_bytes + i * step: offset_bytes + i * step + size].view(device_pages, row)
            for i in range(geometry.num_layers)]


def make_service(tmp_path, *, layers: int = 3, host_pages: int = 32, device_pages: int = 24,
                 with_kv: bool = False, **config_kwargs) -> tuple[OffloadService, dict]:
    geometries = [dsa_indexer(num_layers=layers)]
    if with_kv:
        geometries.append(mla_kv(num_layers=layers))
    buffers = {g.name: make_buffers(g, device_pages, seed=i) for i, g in enumerate(geometries)}
    config = ServiceConfig(geometries=tuple(geometries), host_pool=PoolSize(pages=host_pages),
                           backend="cpu", ledger_directory=str(tmp_path / "ledger"),
                           **config_kwargs)
    service = OffloadService(config, buffers)
    return service, buffers


def page_bytes(buffers: dict, pages) -> dict:
    """Copy of every pool's bytes of ``pages`` (device side), per layer."""
    index = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    return {name: [layer[index].clone() for layer in layers] for name, layers in buffers.items()}


def tokens(pages, *, page: int = PAGE) -> torch.Tensor:
    return torch.as_tensor((np.asarray(pages)[:, None] * page + np.arange(page)).reshape(-1))


def on_plain_thread(fn) -> concurrent.futures.Future:
    """Run ``fn()`` on a new daemon thread that runs no event loop (as a server's scheduler or
    forward-pass thread); its result or error as a future."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def target() -> None:
        try:
            outcome.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            outcome.set_exception(exc)

    threading.Thread(target=target, name="no-loop-thread", daemon=True).start()
    return outcome
