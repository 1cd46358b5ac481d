"""Descriptors that hold a flock for a moment only, closed in every child a fork makes.

A flock belongs to the open file, which ``fork()`` shares with the child: a child forked while
the ledger lock is held (a server starting worker processes while a start reserves on another
thread) would hold that lock for its whole life and stall every start and close on the machine.
The ledger opens such descriptors through :func:`open_transient` and closes them through
:func:`close_transient`; a child closes every one still open first thing after the fork, and a
fork waits while one is being opened or closed, so none slips between the two. Descriptors that
must outlive a fork (an owner lock, which a child inherits on purpose) are not registered here.
Both calls block only on a short lock (and the open or close itself); any thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

_TRANSIENT_FDS: set[int] = set()
_FORK_GUARD = threading.Lock()


def _close_transient_fds_in_child() -> None:
    for fd in _TRANSIENT_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _TRANSIENT_FDS.clear()
    _FORK_GUARD.release()  # taken by the forking thread, which is this one


os.register_at_fork(before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release,
                    after_in_child=_close_transient_fds_in_child)


def open_transient(opener: Callable[[], int]) -> int:
    """``opener()``'s descriptor, registered as transient before any fork can copy it."""
    with _FORK_GUARD:
        fd = opener()
        _TRANSIENT_FDS.add(fd)
    return fd


def close_transient(fd: int) -> None:
    """Close a descriptor from :func:`open_transient` (dropping any flock it holds)."""
    with _FORK_GUARD:
        _TRANSIENT_FDS.discard(fd)
        os.close(fd)
