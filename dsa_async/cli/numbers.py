"""Number options of the CLI: parsed strictly, refused with the text and the accepted range.

Only ASCII numerals are numbers here: Python's ``int()``/``float()`` also take other scripts'
digits (``'١٢٣'`` is 123), which an operator's flag should never mean by accident. Every integer
fits 64 bits (tensor sizes and indices are int64). Each parser is an ``argparse`` type: it
raises ``argparse.ArgumentTypeError`` (exit 2) and never blocks.
"""

from __future__ import annotations

import argparse
import math
import re

from ..errors import INT64_MAX, shown
from ..host_memory.plan import GB_BYTES

AUTO = "auto"

#: An integer literal as ``int()`` takes it, ASCII only (underscores between digits allowed).
_INT_TEXT = re.compile(r"\s*([+-]?)[0-9]+(?:_[0-9]+)*\s*")


def _int(text: str, what: str) -> int | float:
    digits = _INT_TEXT.fullmatch(text)
    if digits is None:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not {what} (ASCII digits)")
    try:
        return int(text)
    except ValueError:  # too many digits for int(): beyond any bound here
        return -math.inf if digits.group(1) == "-" else math.inf


def _float(text: str, what: str) -> float:
    value = None
    if text.isascii():
        try:
            value = float(text)
        except ValueError:
            pass
    if value is None:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not {what} (ASCII digits)")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{shown(text)} must be finite")
    return value


def bounded_int(text: str, *, low: int, what: str = "an integer", high: int = INT64_MAX,
                why: str = "a count that fits 64 bits") -> int:
    """An integer in ``[low, high]``."""
    value = _int(text, what)
    if value < low:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be >= {low}")
    if value > high:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is out of range: use {low} to {high} ({why})")
    return int(value)


def positive_int(text: str) -> int:
    return bounded_int(text, low=1)


def positive_float(text: str, what: str = "a number") -> float:
    value = _float(text, what)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} must be > 0")
    return value


def positive_seconds(text: str) -> float:
    return positive_float(text, "a number of seconds")


def _gb_to_bytes(text: str, *, allow_zero: bool) -> int:
    gb = _float(text, "a number of GB")
    if gb < 0 or (gb == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(
            f"{shown(text)} must be a finite number {'>=' if allow_zero else '>'} 0 (of GB)")
    nbytes = gb * GB_BYTES  # finite GB can still overflow to inf bytes (1e300 GB)
    if not math.isfinite(nbytes) or (nbytes := round(nbytes)) > INT64_MAX:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} GB is beyond 64 bits of bytes; use at most "
            f"{INT64_MAX // GB_BYTES:,} GB")
    return nbytes


def host_pool_bytes(text: str) -> int | None:
    """``--host-pool-gb``: GB (10**9 B) > 0, or ``auto`` (returned as ``None``)."""
    if text.strip().lower() == AUTO:
        return None
    nbytes = _gb_to_bytes(text, allow_zero=False)
    if nbytes == 0:
        raise argparse.ArgumentTypeError(f"{shown(text)} GB rounds to 0 bytes")
    return nbytes


def reserve_bytes(text: str) -> int:
    """``--reserve-gb``: GB >= 0."""
    return _gb_to_bytes(text, allow_zero=True)
