"""How one pool's bytes are laid out on each side, as the copy code sees them.

Device buffers come as the inference server holds them: a list of per-layer tensors (each
``[device_pages, bytes_per_page_per_layer]`` bytes, separately allocated as SGLang does, or
views of one allocation), or one 3-D tensor ``[num_layers, device_pages, bytes_per_page_per_layer]``.
Any dtype is accepted; the copy sees raw bytes. When the per-layer tensors are equally spaced
views of one allocation, a fused 3-D view is built so one copy can cross every layer.

The host arena is seen as ``[num_layers, host_pages, bytes_per_page_per_layer]`` whatever its
layout (``page_first`` gives a strided view).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..geometry import HostLayout, PageGeometry

DeviceBuffers = torch.Tensor | Sequence[torch.Tensor]


def _check_plain_memory(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor whose memory is not its elements laid out densely: a quantized,
    sparse, nested or other non-strided tensor, or a lazily conjugated / negated view (its
    bytes are not the values it reads as). torch cannot view those as raw bytes; a quantized
    one may even crash the process on the attempt, so nothing touches its memory first."""
    if t.is_quantized:
        raise ConfigError(
            f"{what} is a quantized tensor ({t.dtype}); device buffers are copied as raw bytes: "
            f"pass the tensor holding its integer values (e.g. .int_repr() of it, kept alive "
            f"as the buffer the server writes)")
    if t.is_nested or t.layout is not torch.strided:
        kind = "nested" if t.is_nested else str(t.layout)
        raise ConfigError(
            f"{what} is a {kind} tensor; device buffers must be dense (torch.strided) "
            f"tensors whose memory holds the pages")
    if t.is_conj() or t.is_neg():
        raise ConfigError(
            f"{what} is a lazily {'conjugated' if t.is_conj() else 'negated'} view; its bytes "
            f"are not the values it reads as: pass the tensor it is a view of")


def _as_page_rows(t: torch.Tensor, geometry: PageGeometry, what: str) -> torch.Tensor:
    """View one layer's tensor as ``uint8 [pages, bytes_per_page_per_layer]`` without copying."""
    row = geometry.bytes_per_page_per_layer
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    _check_plain_memory(t, what)
    if not t.is_contiguous():
        raise ConfigError(f"{what} must be contiguous (got strides {t.stride()})")
    nbytes = t.numel() * t.element_size()
    if nbytes % row:
        raise ConfigError(
            f"{what} holds {nbytes:,} B, not a whole number of {geometry.name} pages of "
            f"{row:,} B ({geometry.page_size_tokens} tokens x {geometry.bytes_per_token_per_layer} "
            f"B); shape {tuple(t.shape)} dtype {t.dtype}"
        )
    try:
        return t.reshape(-1).view(torch.uint8).view(-1, row)
    except RuntimeError as exc:  # anything else torch cannot see as bytes (a subclass's rule)
        raise ConfigError(f"{what} cannot be viewed as raw bytes ({exc}); pass a plain dense "
                          f"tensor of shape {tuple(t.shape)}") from exc


def _fused_view(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """A ``[L, P, B]`` view when the layers are equally spaced views of one allocation."""
    if len(layers) < 2:
        return layers[0].unsqueeze(0) if layers else None
    base = layers[0]
    storage = base.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage or t.shape != base.shape for t in layers):
        return None
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0]
    if step < base.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    rows, row_bytes = base.shape
    # Storages made separately over the same memory (slices of one buffer through numpy or
    # frombuffer) start at one address but may each cover only part of it: view the layers
    # through the largest, and only if it covers them all.
    widest = max(layers, key=lambda t: t.untyped_storage().nbytes())
    if offsets[0] + step * (len(layers) - 1) + rows * row_bytes > widest.untyped_storage().nbytes():
        return None
    return torch.as_strided(widest, (len(layers), rows, row_bytes), (step, row_bytes, 1),
                            offsets[0])


@dataclass(frozen=True)
class PoolBinding:
    """One pool's host arena and device buffers, viewed as page rows of raw bytes."""

    geometry: PageGeometry
    host: torch.Tensor  #: uint8 [L, host_pages, B] (strided for page_first)
    device_layers: tuple[torch.Tensor, ...]  #: L x uint8 [device_pages, B]
    device_fused: torch.Tensor | None  #: uint8 [L, device_pages, B] when one allocation
    #: With ``device_fused``: whether run copies across its layers also beat per-layer index
    #: copies when runs are short (single scattered pages). Measured when the CPU engine
    #: starts (copyplan.measure_fused_for_short_runs): it depends on the machine.
    fused_for_short_runs: bool = True

    @functools.cached_property
    def layers_wide(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per layer, ``(host, device)`` rows viewed in the widest element type both allow
        (:func:`same_width`), for index ops. Made once per binding: the views cost more Python
        time than a small batch's copy of one layer. (A binding made by ``dataclasses.replace``
        makes its own.)"""
        return tuple(same_width(self.host[i], d) for i, d in enumerate(self.device_layers))

    @functools.cached_property
    def host_rows_contiguous(self) -> bool:
        """Whether each layer's host rows are one contiguous block (``layer_first``)."""
        return bool(self.host[0].is_contiguous())

    @property
    def device_pages(self) -> int:
        return int(self.device_layers[0].shape[0])

    @property
    def device(self) -> torch.device:
        return self.device_layers[0].device


def bind_pool(geometry: PageGeometry, arena: torch.Tensor, device: DeviceBuffers) -> PoolBinding:
    """Check ``device`` against ``geometry`` and build the views the copy code uses."""
    name = geometry.name
    if isinstance(device, torch.Tensor):
        _check_plain_memory(device, f"pool {name!r}: the device tensor")
        if device.dim() != 3 or device.shape[0] != geometry.num_layers:
            raise ConfigError(
                f"pool {name!r}: a single device tensor must be 3-D [num_layers="
                f"{geometry.num_layers}, pages, bytes]; got shape {tuple(device.shape)}"
            )
        layers = [_as_page_rows(device[i], geometry, f"pool {name!r} layer {i}")
                  for i in range(geometry.num_layers)]
    elif isinstance(device, Sequence) and not isinstance(device, (str, bytes)):
        if len(device) != geometry.num_layers:
            raise ConfigError(
                f"pool {name!r}: got {len(device)} per-layer device tensors for "
                f"{geometry.num_layers} layers; pass one tensor per layer"
            )
        layers = [_as_page_rows(t, geometry, f"pool {name!r} layer {i}")
                  for i, t in enumerate(device)]
    else:
        raise ConfigError(
            f"pool {name!r}: device buffers must be a list of per-layer tensors or one 3-D "
            f"tensor, got {type(device).__name__}"
        )
    if len({(t.shape, t.device) for t in layers}) != 1:
        raise ConfigError(f"pool {name!r}: every layer must have the same shape and device")
    if layers[0].shape[0] == 0:
        raise ConfigError(
            f"pool {name!r}: the device buffers hold no pages; give each layer at least one "
            f"page of {geometry.bytes_per_page_per_layer:,} B")
    host = arena if geometry.host_layout is HostLayout.LAYER_FIRST else arena.transpose(0, 1)
    return PoolBinding(geometry, host, tuple(layers), _fused_view(layers))


def check_disjoint(bindings: Sequence[PoolBinding]) -> None:
    """Raise ``ConfigError`` when two layers' device buffers (of one pool or of two) share
    bytes: each layer's pages must be its own, or copies into one layer overwrite another's
    (e.g. the same tensor passed for every layer). Views of one allocation that do not
    overlap (a 3-D buffer) are fine. Tensors without memory (``meta``) are not compared."""
    spans = []
    for binding in bindings:
        for i, t in enumerate(binding.device_layers):
            if t.device.type == "meta":
                continue
            start = t.data_ptr()
            spans.append((t.device, start, start + t.numel() * t.element_size(),
                          f"pool {binding.geometry.name!r} layer {i}"))
    spans.sort(key=lambda span: (str(span[0]), span[1]))
    for (device_a, _, end_a, what_a), (device_b, start_b, end_b, what_b) in zip(spans,
                                                                                  spans[1:]):
        if device_a == device_b and start_b < end_a:
            raise ConfigError(
                f"the device buffers of {what_a} and {what_b} share "
                f"{min(end_a, end_b) - start_b:,} B of "
                f"memory: every layer needs pages of its own (one tensor per layer, or one "
                f"[num_layers, pages, bytes] tensor), not the same tensor twice")


def wide_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest element type that divides rows, strides and alignment.

    Index ops copy element by element: on ``uint8`` rows they are several times slower than
    on ``int64`` rows, and 16-byte ``complex128`` elements are faster still (measured: a
    scatter into per-layer tensors went from 0.57 to 0.76 of a contiguous copy). Only bytes
    move; nothing is interpreted as numbers.
    """
    row = t.shape[-1]
    # torch views bytes as wider elements only from a storage offset that is a multiple of the
    # width, which an aligned address does not imply (a block that itself starts unaligned)
    offset_bytes = t.storage_offset() * t.element_size()
    for dtype, size in ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4),
                        (torch.int16, 2)):
        if row % size == 0 and t.data_ptr() % size == 0 and offset_bytes % size == 0 and all(
            s % size == 0 for s in t.stride()[:-1]
        ):
            return t.view(dtype)
    return t


def same_width(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of both sides of one index op in the widest element type both allow.

    Index ops need both sides in one element type; each side alone may allow a different
    width (e.g. device rows 8-byte but not 16-byte aligned), so the narrower one wins."""
    wide_a, wide_b = wide_view(a), wide_view(b)
    if wide_a.dtype == wide_b.dtype:
        return wide_a, wide_b
    narrow = wide_a if wide_a.element_size() < wide_b.element_size() else wide_b
    return a.view(narrow.dtype), b.view(narrow.dtype)
