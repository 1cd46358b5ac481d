"""The few CUDA driver calls PyTorch does not expose, through ``ctypes`` on ``libcuda.so.1``.

* streams of our own with a priority (``cuStreamCreateWithPriority``): PyTorch's
  ``torch.cuda.Stream()`` hands out streams from a fixed pool per priority, round-robin, so
  one of them can be the very stream another part of the server got;
* the device address of registered host memory (``cuMemHostGetDevicePointer``) and whether the
  device may use the host address itself (``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``).

The driver library is the single one of the process (the runtime that PyTorch links sits on
it), so handles made here are the ones PyTorch's runtime sees. Every call runs inside the
device's primary context (the context the runtime uses), pushed on the calling thread for the
call and popped after it. Importing this module needs no device; calls raise
``CudaDriverError`` (a ``RuntimeError``) with the driver's own message.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

#: ``CU_STREAM_NON_BLOCKING``: no implicit ordering with the legacy default stream; every
#: ordering this backend needs is made explicit with events.
CU_STREAM_NON_BLOCKING = 0x1
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
CUDA_SUCCESS = 0


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"cannot load the CUDA driver library libcuda.so.1: {exc}") from exc
    _check(lib.cuInit(0), "cuInit", lib)
    return lib


def _error_text(code: int, lib: ctypes.CDLL) -> str:
    text = ctypes.c_char_p()
    if lib.cuGetErrorString(code, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
        return f"{text.value.decode(errors='replace')} (CUresult {code})"
    return f"CUresult {code}"


def _check(code: int, call: str, lib: ctypes.CDLL | None = None) -> None:
    if code != CUDA_SUCCESS:
        raise CudaDriverError(f"{call} failed: {_error_text(code, lib or _driver())}")


@contextlib.contextmanager
def primary_context(ordinal: int) -> Iterator[ctypes.CDLL]:
    """The device's primary context current on this thread for the block. Blocks briefly."""
    lib = _driver()
    device = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    context = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
           "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            yield lib
        finally:
            popped = ctypes.c_void_p()
            lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(device)


def device_attribute(ordinal: int, attribute: int) -> int:
    lib = _driver()
    device = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
    value = ctypes.c_int()
    _check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
           f"cuDeviceGetAttribute({attribute})")
    return value.value


def stream_priority_range(ordinal: int) -> tuple[int, int]:
    """``(least, greatest)``; numerically lower is higher priority (e.g. ``(0, -5)``)."""
    with primary_context(ordinal) as lib:
        least, greatest = ctypes.c_int(), ctypes.c_int()
        _check(lib.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
               "cuCtxGetStreamPriorityRange")
        return least.value, greatest.value


def create_stream(ordinal: int, priority: int) -> int:
    """A new non-blocking stream of ``priority`` on the device; returns its handle."""
    with primary_context(ordinal) as lib:
        stream = ctypes.c_void_p()
        _check(lib.cuStreamCreateWithPriority(ctypes.byref(stream),
                                              ctypes.c_uint(CU_STREAM_NON_BLOCKING),
                                              ctypes.c_int(priority)),
               f"cuStreamCreateWithPriority(priority={priority})")
        return int(stream.value or 0)


def destroy_stream(ordinal: int, handle: int) -> None:
    """Destroy a stream made by :func:`create_stream`; work already queued still completes."""
    with primary_context(ordinal) as lib:
        _check(lib.cuStreamDestroy_v2(ctypes.c_void_p(handle)), "cuStreamDestroy")


def host_device_pointer(ordinal: int, host_ptr: int) -> int:
    """The device address of registered, mapped host memory at ``host_ptr``."""
    with primary_context(ordinal) as lib:
        device_ptr = ctypes.c_uint64()
        _check(lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device_ptr),
                                                ctypes.c_void_p(host_ptr), ctypes.c_uint(0)),
               f"cuMemHostGetDevicePointer({host_ptr:#x})")
        return int(device_ptr.value)
