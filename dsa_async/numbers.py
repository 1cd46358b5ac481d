"""Numbers from callers: read as floats, and shown in error messages.

Python ints have no bound; a caller may pass one beyond any float (``10**400``) or beyond
what ``str()`` converts (4,300 digits): a refusal must still be a clear error, never an
``OverflowError`` or ``ValueError`` raised while building its message.
"""

from __future__ import annotations

import math

from .errors import ConfigError

#: The largest size or count a setting may hold: tensor sizes and offsets are int64.
INT64_MAX = 2**63 - 1


def as_float(value: int | float) -> float:
    """``value`` as a float; an int too large for one reads as an infinity of its sign."""
    try:
        return float(value)
    except OverflowError:  # Python ints have no bound, floats do
        return math.inf if value > 0 else -math.inf


def shown(value: object) -> str:
    """``value`` for an error message: its repr (shortened past 80 characters), or for an
    int too large for a float its length (hundreds of digits help nobody)."""
    if isinstance(value, int) and not math.isfinite(as_float(value)):
        try:
            return f"an int of {len(str(abs(value)))} digits"
        except ValueError:  # beyond int()'s 4,300 digits: str() refuses it too
            return f"an int of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except ValueError:  # e.g. a list holding an int beyond 4,300 digits
        return f"a {type(value).__name__} too large to show"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check_fits_int64(name: str, value: int) -> None:
    """Refuse (``ConfigError``) a size or count beyond int64: no tensor, pool or page table
    can hold it, and arithmetic on it would only fail later, further from the caller."""
    if value > INT64_MAX:
        raise ConfigError(f"{name} must be at most {INT64_MAX:,} (it is a size or count, "
                          f"held as int64), got {shown(value)}")
