"""Page-locking host arenas in place, exactly their bytes, and undoing it.

The host pool allocates each arena as a plain ``uint8`` tensor of exactly the bytes its geometry
needs (``pin_memory=True`` would round the allocation up to a power of two). This module
page-locks those bytes where they lie with ``cudaHostRegister`` and unregisters them on close.

Chunks and alignment. ``[ptr, ptr + nbytes)`` is registered exactly, as a series of chunks
(1 GiB by default, so no single driver call pins an unbounded range). The first chunk starts at
``ptr`` whatever its alignment and the last one ends at ``ptr + nbytes``; every boundary in
between is a multiple of the host page size (``resource.getpagesize()``: 4 KiB on most x86
hosts, 64 KiB on many aarch64 ones), so two chunks never share a page. A
registration covers the whole pages it touches; a partial page at either end of the arena may
therefore be shared with a neighbouring allocation. If that neighbour is itself registered, the
driver refuses the chunk as already registered: the chunk is then retried without its partial
end pages, which stay page-locked by the neighbour's registration.

Copies and registration edges. One ``cudaMemcpyAsync`` must stay inside one registration: the
driver does not stitch two registrations together, it refuses such a range
(``cudaErrorInvalidValue``) or treats it as pageable memory, and a pageable device-to-host copy
blocks the issuing thread until it is done. Chunk edges fall anywhere inside a page row (rows
are not host-page multiples), so moving the edges cannot avoid this for multi-page runs; instead
:meth:`HostPinning.registration_map` gives the copy code every edge and it splits each host
range there (``registrations.RegistrationMap.split``). Chunks are registered with
``cudaHostRegisterMapped`` too, so gather/scatter kernels can reach the arena through unified
addressing (``mapped``); those have no edge limit.

Locked-memory limit. The CUDA driver pins registered memory itself; as far as known (not
measured here) it does not count ``cudaHostRegister`` against ``RLIMIT_MEMLOCK``, so refusals
print the limit for reference only and do not advise raising it. A refusal for memory means
host memory or the driver's own limits ran out: make the pool smaller. Any other refusal (the
device or system not allowing registration in place, e.g. ``cudaErrorNotSupported``) says so
and that a smaller pool will not help.

Error isolation. A failed CUDA runtime call also leaves its code as the calling thread's "last
error", which PyTorch's next kernel-launch check on that thread would report as its own failure.
Every register/unregister call therefore runs on a short-lived helper thread, whose error state
dies with it; the result codes are checked explicitly.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..errors import HostBudgetExceeded
from .registrations import HOST_PAGE_BYTES, RegistrationMap, tensor_span

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 30
#: ``cudaHostRegisterPortable``: page-locked for every CUDA context, not only the current one.
CUDA_HOST_REGISTER_PORTABLE = 1
#: ``cudaHostRegisterMapped``: also mapped into the device address space (kernels may use it).
CUDA_HOST_REGISTER_MAPPED = 2
CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713

T = TypeVar("T")


def _align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def _align_up(value: int, alignment: int) -> int:
    return _align_down(value + alignment - 1, alignment)


def chunk_ranges(ptr: int, nbytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 page_bytes: int = HOST_PAGE_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` pieces that cover ``[ptr, ptr + nbytes)`` exactly, in order.

    Inner boundaries are multiples of ``page_bytes``; each piece is at most ``chunk_bytes``
    long. Example: ``ptr=0x1040, nbytes=10,000, chunk_bytes=4096`` gives
    ``[(0x1040, 0x2000), (0x2000, 0x3000), (0x3000, 0x3750)]``.
    """
    if chunk_bytes <= 0 or chunk_bytes % page_bytes:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {page_bytes}")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    end = ptr + nbytes
    pieces = []
    start = ptr
    while start < end:
        stop = min(end, _align_down(start + chunk_bytes, page_bytes))
        pieces.append((start, stop))
        start = stop
    return pieces


def memlock_limit_text() -> str:
    """``RLIMIT_MEMLOCK`` as ``soft=..., hard=...`` (``unlimited`` spelled out)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def spell(value: int) -> str:
        return "unlimited" if value == resource.RLIM_INFINITY else f"{value:,} B"

    return f"RLIMIT_MEMLOCK soft={spell(soft)}, hard={spell(hard)}"


def cuda_error_text(code: int) -> str:
    try:
        cudart = torch.cuda.cudart()
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} (cudaError {code})"
    except Exception:  # noqa: BLE001 - the code alone still says what failed
        return f"cudaError {code}"


def run_isolated(device: torch.device, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a fresh thread bound to ``device``; return its result or raise its error.

    The thread's CUDA "last error" dies with it, so a refused call cannot resurface later as
    the failure of an unrelated kernel launch on the caller's thread.
    """
    box: dict[str, object] = {}

    def body() -> None:
        try:
            torch.cuda.set_device(device)  # no stray context on device 0 for other ranks
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=body, name="dsa-async-pinning", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def _register(start: int, stop: int, flags: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(start, stop - start, flags))


def _unregister(start: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(start))


@dataclass(frozen=True)
class Registration:
    """One registered chunk: ``[start, stop)``, unregistered by its ``start``."""

    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class HostPinning:
    """Registrations made by one engine; ``pinned_bytes`` is exactly what it page-locked.

    ``foreign_bytes``: bytes of the given ranges that were already page-locked by someone else
    (left alone); ``pageable_edge_bytes``: partial end pages not registered by their own chunk
    because a neighbouring registration already holds their page (see the module docstring).
    """

    def __init__(self, device: torch.device, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 flags: int = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED) -> None:
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.flags = flags
        self.registrations: list[Registration] = []
        self.foreign_bytes = 0
        #: ``[start, stop)`` chunks found page-locked by someone else (their edges are unknown)
        self.foreign_ranges: list[tuple[int, int]] = []
        self.pageable_edge_bytes = 0
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self.registrations)

    def registration_map(self) -> RegistrationMap:
        """Every registration edge of this engine, ours and foreign (copies split there)."""
        with self._lock:
            ranges = [(r.start, r.stop) for r in self.registrations] + list(self.foreign_ranges)
        return RegistrationMap(ranges)

    def own_map(self) -> RegistrationMap:
        """Only the registrations this object made (mapped for the device with its flags)."""
        with self._lock:
            return RegistrationMap((r.start, r.stop) for r in self.registrations)

    def register_tensor_bytes(self, tensor: torch.Tensor, what: str) -> None:
        """Page-lock the bytes of ``tensor`` (a CPU tensor: from its first element to its last,
        not the rest of the allocation it may be a view into), once."""
        if tensor.device.type != "cpu":
            raise ValueError(f"{what}: expected a host (CPU) tensor, got device {tensor.device}")
        self.register(*tensor_span(tensor), what)

    def register(self, ptr: int, nbytes: int, what: str) -> None:
        """Page-lock ``[ptr, ptr + nbytes)``. On failure, undoes this call's chunks and raises
        ``HostBudgetExceeded`` naming the bytes and the memlock limit."""
        with self._lock:
            if any(r.start < ptr + nbytes and ptr < r.stop for r in self.registrations):
                return  # already ours (two pools on one storage): register once
        pieces = chunk_ranges(ptr, nbytes, self.chunk_bytes)
        done, foreign, edges, failure = run_isolated(
            self.device, lambda: self._register_pieces(ptr, ptr + nbytes, pieces))
        with self._lock:
            self.registrations.extend(done)
            self.foreign_ranges.extend(foreign)
            foreign = sum(stop - start for start, stop in foreign)
            self.foreign_bytes += foreign
            self.pageable_edge_bytes += edges
        if foreign:
            log.info("%s: %d B were already page-locked elsewhere; left as they are", what,
                     foreign)
        if failure is not None:
            start, stop, code = failure
            if code == CUDA_ERROR_MEMORY_ALLOCATION:
                to_fix = (f"Make the host pool smaller (ServiceConfig.host_pool) or free host "
                          f"memory. For reference: {memlock_limit_text()} (as far as known "
                          f"the driver does not charge cudaHostRegister to it)")
            else:
                to_fix = ("The driver refused it for another reason than memory, so a "
                          "smaller pool will not help: the CUDA backend page-locks its host "
                          "pool in place, which some systems do not allow (the device "
                          "attribute cudaDevAttrHostRegisterSupported is 0 on some "
                          "virtualized or confidential-computing GPUs)")
            raise HostBudgetExceeded(
                f"could not page-lock {what}: cudaHostRegister refused {stop - start:,} B at "
                f"offset {start - ptr:,} of the arena's {nbytes:,} B with "
                f"{cuda_error_text(code)}; nothing of this arena stays page-locked. {to_fix}"
            )

    def _register_pieces(self, lo: int, hi: int, pieces: list[tuple[int, int]]):
        """Runs on the isolated thread. Returns (registrations, foreign, edges, failure)."""
        done: list[Registration] = []
        foreign: list[tuple[int, int]] = []
        edges = 0
        for start, stop in pieces:
            code = _register(start, stop, self.flags)
            if code == CUDA_SUCCESS:
                done.append(Registration(start, stop))
                continue
            if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                # A partial end page may be held by a neighbour's registration: retry whole
                # inner pages only. Chunk boundaries inside the arena are page-aligned already.
                inner_start = _align_up(start, HOST_PAGE_BYTES) if start == lo else start
                inner_stop = _align_down(stop, HOST_PAGE_BYTES) if stop == hi else stop
                trimmed = (inner_start, inner_stop) != (start, stop) and inner_start < inner_stop
                if trimmed:
                    code = _register(inner_start, inner_stop, self.flags)
                    if code == CUDA_SUCCESS:
                        done.append(Registration(inner_start, inner_stop))
                        edges += (stop - start) - (inner_stop - inner_start)
                        continue
                if not trimmed or code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                    foreign.append((start, stop))  # page-locked by its owner: leave it alone
                    continue
                # the trimmed retry failed otherwise (out of memory...): a failure as below
            for reg in done:  # undo this call's chunks: all or nothing
                _unregister(reg.start)
            return [], [], 0, (start, stop, code)
        return done, foreign, edges, None

    def unregister_all(self) -> list[str]:
        """Unregister every chunk this object registered; returns problems (empty when clean)."""
        with self._lock:
            registrations, self.registrations = self.registrations, []
        if not registrations:
            return []

        def undo() -> list[str]:
            problems = []
            for reg in registrations:
                code = _unregister(reg.start)
                if code != CUDA_SUCCESS:
                    problems.append(f"cudaHostUnregister({reg.start:#x}, {reg.nbytes:,} B): "
                                    f"{cuda_error_text(code)}")
            return problems

        problems = run_isolated(self.device, undo)
        for problem in problems:
            log.warning("unregistering host memory: %s", problem)
        return problems
