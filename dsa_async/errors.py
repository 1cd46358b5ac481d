"""Every error the package raises, in one place.

Errors about caller input subclass ``ValueError`` (or ``TypeError`` for a wrong type), so callers
that already catch those keep working. Resource refusals subclass ``MemoryError``. Messages say
what was wrong, the values involved, and what to change; values a caller passed are shown with
:func:`shown`, which never fails (Python ints have no bound: ``10**400`` is beyond any float and
``10**5000`` beyond what ``str()`` converts), so a refusal is never an ``OverflowError`` or
``ValueError`` raised while building its message.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import operator
import threading


class DsaAsyncError(Exception):
    """Base class of every error raised by dsa_async."""


# --- caller input -----------------------------------------------------------------------------


class ConfigError(DsaAsyncError, ValueError):
    """A configuration value is out of range or not one of the accepted values."""


class UnsupportedSettingError(ConfigError):
    """A host server's setting that an integration cannot serve (the message names the flag to
    change); raised at start, before anything is allocated."""


class IndexValueError(DsaAsyncError, ValueError):
    """An index tensor has a bad value or shape: negative, out of range, 2-D, mismatched lengths."""


class IndexTypeError(DsaAsyncError, TypeError):
    """An index argument has the wrong type, dtype or device."""


class ArgumentTypeError(DsaAsyncError, TypeError):
    """An argument other than an index has the wrong type: a release of something that is not
    a ``HostPages`` handle, an ``after=`` producer the backend cannot wait for, a layer, page
    count or timeout that is not a number."""


class ArgumentValueError(DsaAsyncError, ValueError):
    """An argument other than an index is out of range: a layer the service does not have, a
    negative or NaN timeout, a page count below one."""


class PageAlignmentError(DsaAsyncError, ValueError):
    """Host and device tokens of a pair do not share their in-page offset, or a page maps twice."""


class UnknownHostPagesError(DsaAsyncError, ValueError):
    """Host pages that this pool never handed out, or that were already released."""


class PagesInFlightError(DsaAsyncError, ValueError):
    """Host pages cannot be released while a copy reads or writes them."""


# --- resources --------------------------------------------------------------------------------


class HostBudgetExceeded(DsaAsyncError, MemoryError):
    """The requested host pool does not fit the host-memory budget. Nothing was allocated.

    The budget plan's figures, where the refusal is one (``None`` otherwise, e.g. for
    page-locking): ``max_pages_that_fit``, the largest pool in pages per rank that the budget
    held at the refusal; ``available_bytes``, the budget left for it after the other
    reservations (negative when they exceed what the probe found free); ``bytes_per_page``, one shared page of every pool; ``reservations``, the
    ledger's live entries at the refusal (those ``available_bytes`` excludes)."""

    def __init__(self, message: str, *, max_pages_that_fit: int | None = None,
                 available_bytes: int | None = None, bytes_per_page: int | None = None,
                 reservations: tuple = ()) -> None:
        super().__init__(message)
        self.max_pages_that_fit = max_pages_that_fit
        self.available_bytes = available_bytes
        self.bytes_per_page = bytes_per_page
        self.reservations = reservations


class HostPoolExhausted(DsaAsyncError, MemoryError):
    """Not enough free pages in the host pool for a request."""


class QueueFullError(DsaAsyncError, RuntimeError):
    """The service's bound on queued requests is reached; the request was not accepted."""


# --- state ------------------------------------------------------------------------------------


class ServiceClosedError(DsaAsyncError, RuntimeError):
    """The service is not running (not started yet, closing or closed)."""


class TransferFailedError(DsaAsyncError, RuntimeError):
    """A copy batch failed; ``__cause__`` holds the original exception."""


class CopyNotRunError(TransferFailedError):
    """A copy batch that never ran because something it had to wait for failed: a producer
    named in ``after=``, or the backup whose host pages it reads. Its requests fail with it as
    the cause; ``transfer_errors_total`` does not count it (no copy failed)."""


class WrongThreadError(DsaAsyncError, RuntimeError):
    """A call made on a thread it must not run on: a blocking wait on a thread that runs an
    event loop (it would stall the loop), or a blocking runner called on its own loop thread."""


class TransferNotDoneError(DsaAsyncError, asyncio.InvalidStateError):
    """``Transfer.result()`` / ``exception()`` of a request that has not ended yet (also the
    ``asyncio.InvalidStateError`` a future would raise)."""


class LedgerError(DsaAsyncError, RuntimeError):
    """The machine-wide reservation ledger file is corrupt, foreign or unsafe to use."""


class OutputWriteError(DsaAsyncError, OSError):
    """A command's output file (``serve --json-summary``, ``bench --json`` / ``--plot``) could
    not be written at the end of the run (a full disk, a device that refuses the write)."""


class BenchInterrupted(DsaAsyncError):
    """``dsa-async bench`` was asked to stop (Ctrl-C) while measuring: raised in the bench's
    worker thread at the next point where a measurement can stop."""


# --- internal invariants ----------------------------------------------------------------------


class CopySkipped(DsaAsyncError):
    """A batch whose every request was cancelled while it still waited for its producers or
    dependencies: the engine dropped it without copying. Internal: its requests end cancelled,
    and batches that needed its data fail with it as the cause."""


class LivenessViolation(DsaAsyncError, AssertionError):
    """A queued request waits on nothing that ends by itself (``Scheduler.check_liveness``)."""


# --- values in messages -----------------------------------------------------------------------

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
    return shortened(text)


def shortened(text: str) -> str:
    """``text`` as it is, or past 80 characters its first 60 and its length."""
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def check_fits_int64(name: str, value: int) -> None:
    """Refuse (``ConfigError``) a size or count beyond int64: no tensor, pool or page table
    can hold it, and arithmetic on it would only fail later, further from the caller."""
    if value > INT64_MAX:
        raise ConfigError(f"{name} must be at most {INT64_MAX:,} (it is a size or count, "
                          f"held as int64), got {shown(value)}")


# --- scalar arguments ---------------------------------------------------------------------------


def int_argument(name: str, value: object) -> int:
    """``value`` as an int: any integer type (``int``, a numpy integer: what
    ``operator.index`` takes) but a bool; else ``ArgumentTypeError`` naming ``name``."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ArgumentTypeError(f"{name} must be an int, got {shown(value)} "
                            f"({type(value).__name__})")


def is_real_number(value: object) -> bool:
    """Whether ``value`` is a real number a caller may give for seconds: an int or float of
    any kind (numpy's included), never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def wait_bound_s(timeout_s: object, name: str = "timeout_s") -> float | None:
    """``timeout_s`` as a bound for a thread's blocking wait: ``None`` for no bound (also for an
    infinite one, or one longer than the platform's waits allow); ``ArgumentTypeError`` for a
    non-number, ``ArgumentValueError`` for NaN and negative values."""
    if timeout_s is None:
        return None
    if not is_real_number(timeout_s):
        raise ArgumentTypeError(f"{name} must be a number of seconds or None, got "
                                f"{shown(timeout_s)} ({type(timeout_s).__name__})")
    if not timeout_s >= 0:  # negative, or NaN
        raise ArgumentValueError(f"{name} must be >= 0 seconds or None, got {shown(timeout_s)}")
    return None if timeout_s > threading.TIMEOUT_MAX else float(timeout_s)
