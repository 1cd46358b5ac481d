"""Page geometry: how many bytes a token, a page and a pool take, and the model presets.

Worked example (DeepSeek-V3.2 DSA indexer, the default)::

    bytes per token per layer = index_head_dim + index_head_dim // quant_block_size * 4
                              = 128 + 128 // 128 * 4 = 132 B   (fp8 key + one fp32 scale)
    page, one layer           = 64 tokens * 132 B = 8,448 B   (block-split: 64 * 128 B keys,
                                                                then 64 * 4 B scales)
    page, all 61 layers       = 8,448 * 61 = 515,328 B

Because the page is block-split, one token's bytes are not contiguous, so the page is the unit of
transfer: it moves as an opaque block of ``bytes_per_page_per_layer`` bytes.

Several pools (indexer, MLA KV, draft) share one page table: page ``p`` of each pool holds the
same tokens, so one request moves page ``p`` in all of them.
"""

from __future__ import annotations

import enum
import resource
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, check_fits_int64, shown

DSA_PAGE_SIZE_TOKENS = 64

#: The host's memory page (4 KiB on most x86 hosts, 64 KiB on many aarch64 ones, e.g. Grace):
#: every host arena starts on a boundary of it, and page-lock registrations cover whole pages.
HOST_PAGE_BYTES = resource.getpagesize()
DEEPSEEK_V32_LAYERS = 61


class HostLayout(enum.Enum):
    """Order of the host arena's dimensions."""

    LAYER_FIRST = "layer_first"  #: [layers, pages, bytes_per_page_per_layer]
    PAGE_FIRST = "page_first"  #: [pages, layers, bytes_per_page_per_layer]


class KvDtype(enum.Enum):
    """MLA KV cache storage type."""

    FP8 = "fp8"  #: 512 nope (fp8) + 16 scale + 128 rope (bf16) = 656 B per token per layer
    BF16 = "bf16"  #: 576 * 2 = 1,152 B per token per layer


MLA_KV_BYTES_PER_TOKEN_PER_LAYER = {KvDtype.FP8: 656, KvDtype.BF16: 1152}


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {shown(value)}")
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {shown(value)}")
    check_fits_int64(name, value)
    return value


def as_flag(name: str, value: object) -> bool:
    """A yes/no argument: a bool (or numpy bool), never any truthy value (``'no'`` is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be True or False, got {type(value).__name__} {shown(value)}")
    return bool(value)


@dataclass(frozen=True)
class PageGeometry:
    """Byte geometry of one paged pool (one cache, e.g. the DSA indexer) and its host layout.

    All sizes are in bytes of the ``uint8`` storage (itemsize 1).
    """

    name: str
    bytes_per_token_per_layer: int
    num_layers: int = DEEPSEEK_V32_LAYERS
    page_size_tokens: int = DSA_PAGE_SIZE_TOKENS
    host_layout: HostLayout = HostLayout.LAYER_FIRST

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"pool name must be a non-empty str, got {self.name!r}")
        _positive_int("bytes_per_token_per_layer", self.bytes_per_token_per_layer)
        _positive_int("num_layers", self.num_layers)
        _positive_int("page_size_tokens", self.page_size_tokens)
        if not isinstance(self.host_layout, HostLayout):
            raise ConfigError(
                f"host_layout must be a HostLayout, got {self.host_layout!r}; "
                f"use one of {[m.value for m in HostLayout]}"
            )

    @property
    def bytes_per_page_per_layer(self) -> int:
        """One page of one layer: ``page_size_tokens * bytes_per_token_per_layer``."""
        return self.page_size_tokens * self.bytes_per_token_per_layer

    @property
    def bytes_per_page(self) -> int:
        """One page across all layers."""
        return self.bytes_per_page_per_layer * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """One token across all layers."""
        return self.bytes_per_token_per_layer * self.num_layers

    def bytes_for_pages(self, num_pages: int) -> int:
        """Host bytes of ``num_pages`` pages across all layers."""
        return num_pages * self.bytes_per_page

    def arithmetic(self, num_pages: int) -> str:
        """The size formula spelled out, for error messages and plans."""
        return (
            f"{self.name}: {num_pages:,} pages x {self.num_layers} layers x "
            f"{self.bytes_per_page_per_layer:,} B/page/layer "
            f"({self.page_size_tokens} tokens x {self.bytes_per_token_per_layer} B) "
            f"= {self.bytes_for_pages(num_pages):,} B"
        )


def dsa_indexer(
    *,
    index_head_dim: int = 128,
    quant_block_size: int = 128,
    num_layers: int = DEEPSEEK_V32_LAYERS,
    with_draft: bool = False,
    page_size_tokens: int = DSA_PAGE_SIZE_TOKENS,
    host_layout: HostLayout = HostLayout.LAYER_FIRST,
    name: str = "indexer",
) -> PageGeometry:
    """The DSA indexer cache: fp8 keys plus one fp32 scale per ``quant_block_size`` of the head.

    ``with_draft`` adds the MTP draft layer (speculative decoding) to the layer count.
    """
    _positive_int("index_head_dim", index_head_dim)
    _positive_int("quant_block_size", quant_block_size)
    if index_head_dim % quant_block_size:
        raise ConfigError(
            f"index_head_dim={index_head_dim} must be a multiple of "
            f"quant_block_size={quant_block_size}"
        )
    per_token = index_head_dim + index_head_dim // quant_block_size * 4
    return PageGeometry(
        name=name,
        bytes_per_token_per_layer=per_token,
        num_layers=_positive_int("num_layers", num_layers) + as_flag("with_draft", with_draft),
        page_size_tokens=page_size_tokens,
        host_layout=host_layout,
    )


def mla_kv(
    dtype: KvDtype = KvDtype.FP8,
    *,
    num_layers: int = DEEPSEEK_V32_LAYERS,
    with_draft: bool = False,
    page_size_tokens: int = DSA_PAGE_SIZE_TOKENS,
    host_layout: HostLayout = HostLayout.LAYER_FIRST,
    name: str = "kv",
) -> PageGeometry:
    """The MLA KV cache: 656 B (fp8) or 1,152 B (bf16) per token per layer."""
    if not isinstance(dtype, KvDtype):
        raise ConfigError(f"kv dtype {dtype!r} is not known; use one of {[m.value for m in KvDtype]}")
    return PageGeometry(
        name=name,
        bytes_per_token_per_layer=MLA_KV_BYTES_PER_TOKEN_PER_LAYER[dtype],
        num_layers=_positive_int("num_layers", num_layers) + as_flag("with_draft", with_draft),
        page_size_tokens=page_size_tokens,
        host_layout=host_layout,
    )


MODELS = ("deepseek-v3.2",)


def model_pools(
    model: str,
    *,
    kv_dtype: KvDtype | None = None,
    with_draft: bool = False,
    num_layers: int = DEEPSEEK_V32_LAYERS,
    host_layout: HostLayout = HostLayout.LAYER_FIRST,
) -> tuple[PageGeometry, ...]:
    """The pools a model needs: the indexer, and the MLA KV pool when ``kv_dtype`` is given."""
    if model not in MODELS:
        raise ConfigError(f"model {model!r} is not known; use one of {list(MODELS)}")
    pools = [dsa_indexer(num_layers=num_layers, with_draft=with_draft, host_layout=host_layout)]
    if kv_dtype is not None:
        pools.append(
            mla_kv(kv_dtype, num_layers=num_layers, with_draft=with_draft, host_layout=host_layout)
        )
    return tuple(pools)
