"""A CUDA tensor over a page-locked host arena, for kernels that read or write it directly.

After ``cudaHostRegister`` with ``cudaHostRegisterMapped``, the arena's pages are in the device's
address space. When the device may use the host address itself (every visible device reports
``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``, so ``cuMemHostGetDevicePointer`` returns the host
address), one tensor can span every registration of the arena: each access of a kernel is
translated page by page, so registration edges do not matter to kernels (they do to memcpy,
see ``registrations``).

The view is built through ``__cuda_array_interface__`` (``torch.as_tensor`` on an object that
describes the device address), which wraps the memory without copying and without owning it:
the engine keeps the arena alive and unregisters it only after its streams are idle.
"""

from __future__ import annotations

import logging

import torch

from . import cuda_driver
from .registrations import RegistrationMap, tensor_span

log = logging.getLogger(__name__)


class _DeviceBytes:
    """Describes ``nbytes`` bytes at device address ``ptr`` (CUDA Array Interface, v3)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # plain memory, no pending work to order against
        }


def mapped_view(host: torch.Tensor, device: torch.device,
                registered: RegistrationMap) -> torch.Tensor | None:
    """``host`` (a CPU tensor, any strides) as a tensor on ``device`` over the same bytes.

    Returns ``None`` (the copy code then uses memcpy paths only) when part of the arena is
    not in one of our mapped registrations, or when the device reaches registered memory only
    through a different address. Blocks briefly (driver queries); any thread.
    """
    base, nbytes = tensor_span(host)  # the arena's bytes, not the allocation around them
    if not registered.covers(base, nbytes):
        log.info("host arena at %#x (%d B) is not wholly in this engine's mapped registrations; "
                 "scattered pages move by memcpy", base, nbytes)
        return None
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    try:
        same_address = cuda_driver.device_attribute(
            ordinal, cuda_driver.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)
        starts = [max(a, base) for a, b in registered.ranges if a < base + nbytes and b > base]
        pointers_match = all(cuda_driver.host_device_pointer(ordinal, p) == p for p in starts)
    except cuda_driver.CudaDriverError as exc:
        log.info("no device mapping of the host arena (%s); scattered pages move by memcpy", exc)
        return None
    if not (same_address and pointers_match):
        log.info("device %d reaches registered host memory through other addresses; "
                 "scattered pages move by memcpy", ordinal)
        return None
    flat = torch.as_tensor(_DeviceBytes(base, nbytes), device=device)
    if flat.data_ptr() != base or flat.device.type != "cuda":  # never a copy: refuse instead
        log.warning("mapped view of %#x came back at %#x on %s; not used", base,
                    flat.data_ptr(), flat.device)
        return None
    return flat.as_strided(host.shape, host.stride(), 0)
