"""The device side of the bench: where device buffers live and how a copy is known to be done.

On CPU the "device" buffers are plain tensors and every copy is complete when it returns. On CUDA
the device buffers are on the GPU, the reference's host buffer is page-locked, and every timed
operation ends with ``torch.cuda.synchronize()`` so the clock stops when the bytes have landed.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from ..kinds import Backend


class EngineUnavailable(ConfigError):
    """The requested backend cannot run here (no device, or its engine cannot be imported)."""


@dataclass(frozen=True)
class BenchDevice:
    backend: Backend  #: CPU or CUDA (already resolved from AUTO)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.backend is Backend.CUDA else "cpu")

    @property
    def is_cuda(self) -> bool:
        return self.backend is Backend.CUDA

    def empty(self, *shape: int) -> torch.Tensor:
        """Uninitialised ``uint8`` device bytes of ``shape``."""
        return torch.empty(shape, dtype=torch.uint8, device=self.torch_device)

    def host_reference_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer for the contiguous reference: page-locked on CUDA, plain on CPU."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def name(self) -> str:
        if self.is_cuda:
            return torch.cuda.get_device_name()
        return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def resolve_device(backend: Backend) -> BenchDevice:
    """``AUTO`` -> CUDA when available, else CPU; CUDA without a device is refused."""
    if backend is Backend.AUTO:
        backend = Backend.CUDA if torch.cuda.is_available() else Backend.CPU
    if backend is Backend.CUDA and not torch.cuda.is_available():
        raise EngineUnavailable(
            "--backend cuda needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use --backend cpu or auto"
        )
    return BenchDevice(backend)


def load_engine_class(backend: Backend) -> type:
    """The engine class for ``backend``; the CUDA engine is imported only when asked for."""
    if backend is Backend.CPU:
        from ..transfer.cpu import CpuEngine

        return CpuEngine
    try:
        from ..transfer.cuda import CudaEngine
    except ImportError as exc:
        raise EngineUnavailable(
            f"--backend cuda: cannot import the CUDA engine (dsa_async.transfer.cuda."
            f"CudaEngine): {exc}; use --backend cpu"
        ) from exc
    return CudaEngine


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's last-level cache (shared by every tenant of a VM host), if known."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best: tuple[int, int] | None = None
    for index in base.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def load_average_1m() -> float | None:
    """The 1-minute load average (runnable threads, including the bench's own), if known."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_info(device: BenchDevice) -> dict[str, object]:
    """Where the figures were measured."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "backend": device.backend.value,
        "device_name": device.name(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "llc_bytes": last_level_cache_bytes(),
        "load_average_1m_start": load_average_1m(),
    }
