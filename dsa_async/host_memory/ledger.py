"""One host-memory ledger per machine and user, shared by every pool and co-located process.

The ledger is a JSON file (``ledger.json``, mode 0600) in a private directory (mode 0700):
``$DSA_ASYNC_LEDGER``, else ``/dev/shm/dsa_async-<uid>``, else ``<tempdir>/dsa_async-<uid>``.
Every read-modify-write holds ``fcntl.flock`` on ``ledger.lock`` beside it, and the file is
replaced atomically, so lock-free readers (``peek``) never see half a file. Co-located ranks
share the ledger only when they see the same directory: point ``$DSA_ASYNC_LEDGER`` at a shared
private directory when containers have separate ``/dev/shm``.

An entry records who reserved (pid and process start time) and how much: ``reserved_bytes`` and
the part already ``allocated_bytes``. Allocated bytes already show up in MemAvailable and cgroup
usage, so only ``reserved_bytes - allocated_bytes`` of each entry counts against the budget
again. Entries whose owner is gone are dropped on every locked access.

Whether an owner lives is told by an owner lock: each reservation holds ``fcntl.flock`` on its
own ``owner-<id>.lock`` beside the ledger for as long as it lasts, and the kernel drops that lock
when the process dies. Locks are seen across PID namespaces (containers sharing the directory),
where the pid means nothing to a reader's ``/proc``. An entry without an owner lock (written by
hand, or by an older writer) falls back to the pid: no such pid, a zombie, or a pid reused by a
process with a different start time is gone. A child forked from the owner inherits its lock
and keeps the reservation alive while it runs; it never releases it. A child forked while a
transaction holds the ledger lock closes its copy at once, so it cannot stall other processes.

Every call here blocks on file I/O and on the lock; call it from a worker thread, never from the
event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError, LedgerError, shown
from .transient_fds import close_transient, open_transient

LEDGER_ENV = "DSA_ASYNC_LEDGER"
LEDGER_FILE_NAME = "ledger.json"
LOCK_FILE_NAME = "ledger.lock"
LEDGER_SCHEMA = "dsa_async.ledger/1"
_DEAD_STATES = frozenset("ZX")  # zombie / dead: the process no longer holds memory
_ENTRY_INT_FIELDS = ("pid", "start_time_ticks", "reserved_bytes", "allocated_bytes")
_ENTRY_FIELDS = frozenset(("id", "label") + _ENTRY_INT_FIELDS)
#: An entry id: what ``uuid4().hex`` writes; anything else would not name an owner lock file.
_ENTRY_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


def default_ledger_directory() -> Path:
    """``$DSA_ASYNC_LEDGER``, else a private directory in /dev/shm (or the temp dir)."""
    configured = os.environ.get(LEDGER_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
    return parent / f"dsa_async-{os.geteuid()}"


def read_process_start_ticks(pid: int, proc_root: str | os.PathLike[str] = "/") -> int | None:
    """Start time (clock ticks after boot, field 22 of ``/proc/<pid>/stat``) of a live process.

    ``None`` when the process is gone or a zombie. Blocking: one small file read.
    """
    try:
        text = (Path(proc_root) / "proc" / str(pid) / "stat").read_text(
            encoding="utf-8", errors="replace"
        )
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    # comm (field 2) may hold spaces and parentheses; fields after the last ')' are plain.
    rest = text[text.rfind(")") + 1 :].split()
    if len(rest) < 20 or not rest[19].isdigit() or rest[0] in _DEAD_STATES:
        return None
    return int(rest[19])  # rest[0] is field 3, so field 22 is rest[19]


@dataclass(frozen=True)
class LedgerEntry:
    """One reservation in the ledger."""

    entry_id: str
    pid: int
    start_time_ticks: int
    label: str
    reserved_bytes: int
    allocated_bytes: int

    @property
    def pending_bytes(self) -> int:
        """Reserved bytes not yet allocated: the part the budget probe cannot see yet."""
        return max(0, self.reserved_bytes - self.allocated_bytes)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.entry_id,
            "pid": self.pid,
            "start_time_ticks": self.start_time_ticks,
            "label": self.label,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
        }


class LedgerTransaction:
    """The live entries while the ledger lock is held; changes are written when it closes."""

    def __init__(self, ledger: HostLedger, entries: list[LedgerEntry], dirty: bool) -> None:
        self._ledger = ledger
        self._entries = entries
        self.dirty = dirty
        self._added: list[tuple[str, int]] = []  # (entry id, owner lock fd) of add()

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    def pending_bytes(self, exclude_entry: str | None = None) -> int:
        return sum(e.pending_bytes for e in self._entries if e.entry_id != exclude_entry)

    def add(self, reserved_bytes: int, *, label: str) -> Reservation:
        """Record a reservation of this process; it is written when the transaction closes.
        Its owner lock is taken now and held until the reservation is released."""
        _check_bytes("reserved_bytes", reserved_bytes)
        pid, start_time_ticks = self._ledger._own_identity()
        entry = LedgerEntry(uuid.uuid4().hex, pid, start_time_ticks, str(label), reserved_bytes, 0)
        owner_fd = self._ledger._hold_owner_lock(entry.entry_id)
        self._entries.append(entry)
        self._added.append((entry.entry_id, owner_fd))
        self.dirty = True
        return Reservation(self._ledger, entry, owner_fd)

    def _drop_added(self) -> None:
        """The transaction failed before its entries were written: close and remove the owner
        locks :meth:`add` took (nobody holds their reservations)."""
        for entry_id, fd in self._added:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ledger._owner_lock_path(entry_id))
            os.close(fd)
        self._added.clear()

    def _set_allocated(self, entry_id: str, allocated_bytes: int) -> bool:
        for i, entry in enumerate(self._entries):
            if entry.entry_id == entry_id:
                self._entries[i] = replace(entry, allocated_bytes=allocated_bytes)
                self.dirty = True
                return True
        return False

    def _remove(self, entry_id: str) -> None:
        kept = [e for e in self._entries if e.entry_id != entry_id]
        self.dirty = self.dirty or len(kept) != len(self._entries)
        self._entries = kept


class Reservation:
    """This process's claim on ``reserved_bytes`` of host memory. Blocking methods (ledger I/O).

    ``release()`` is idempotent; ``with`` releases on exit.
    """

    def __init__(self, ledger: HostLedger, entry: LedgerEntry, owner_fd: int | None = None) -> None:
        self.ledger = ledger
        self.entry_id = entry.entry_id
        self.reserved_bytes = entry.reserved_bytes
        self.label = entry.label
        self.allocated_bytes = entry.allocated_bytes
        self._owner_pid = entry.pid
        self._owner_fd = owner_fd  # holds the owner lock (flock) while the reservation lasts
        self.released = False

    def mark_allocated(self, nbytes: int) -> None:
        """Record that ``nbytes`` (0..reserved_bytes) of the reservation are now allocated."""
        _check_bytes("allocated bytes", nbytes)
        if nbytes > self.reserved_bytes:
            raise ConfigError(
                f"allocated bytes {nbytes:,} exceed the reservation's {self.reserved_bytes:,} B"
            )
        if self.released:
            raise LedgerError(f"reservation {self.entry_id} was already released")
        with self.ledger.transaction() as txn:
            if not txn._set_allocated(self.entry_id, nbytes):
                raise LedgerError(
                    f"reservation {self.entry_id} ({self.label}) is no longer in {self.ledger.path}; "
                    f"the file was deleted or rewritten while this process held it"
                )
        self.allocated_bytes = nbytes

    def release(self) -> None:
        """Drop the entry from the ledger. Idempotent; a forked child never drops its parent's."""
        if self.released or os.getpid() != self._owner_pid:
            return
        try:
            with self.ledger.transaction() as txn:
                txn._remove(self.entry_id)
        except BaseException:
            # The entry may still be in the file (a full disk refused the write). Let go of
            # its owner lock but keep the lock file: every process then reads the entry as
            # gone and reclaims it. Unlinking the file would send them to the pid check,
            # which counts the entry as long as this process lives. ``release()`` may be
            # called again.
            self._let_go_of_owner_lock(remove_file=False)
            raise
        self._let_go_of_owner_lock(remove_file=True)  # the entry is gone: its lock goes too
        self.released = True

    def _let_go_of_owner_lock(self, *, remove_file: bool) -> None:
        if self._owner_fd is None:
            return
        fd, self._owner_fd = self._owner_fd, None
        if remove_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.ledger._owner_lock_path(self.entry_id))
        os.close(fd)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else f"allocated={self.allocated_bytes:,}"
        return f"Reservation({self.entry_id}, {self.label!r}, reserved={self.reserved_bytes:,}, {state})"


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {shown(value)}")


class HostLedger:
    """The machine-wide ledger in ``directory`` (default: ``default_ledger_directory()``).

    ``proc_root`` is where ``proc/<pid>/stat`` is read to tell live owners from gone ones.
    Every method blocks (file I/O, ``flock``).
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, *, proc_root: str | os.PathLike[str] = "/"
    ):
        self.directory = Path(directory) if directory is not None else default_ledger_directory()
        self.path = self.directory / LEDGER_FILE_NAME
        self.lock_path = self.directory / LOCK_FILE_NAME
        self.proc_root = Path(proc_root)
        self._identity: tuple[int, int] | None = None
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"HostLedger({str(self.directory)!r})"

    # --- public, each one locked access ------------------------------------------------------

    def entries(self) -> tuple[LedgerEntry, ...]:
        """Live entries (dropping those of gone owners)."""
        with self.transaction() as txn:
            return txn.entries

    def pending_bytes(self, exclude_entry: str | None = None) -> int:
        """Sum of ``reserved - allocated`` over live entries, leaving out ``exclude_entry``."""
        with self.transaction() as txn:
            return txn.pending_bytes(exclude_entry)

    def reserve(self, reserved_bytes: int, *, label: str) -> Reservation:
        """Record a reservation without a budget check (``plan.reserve_host_pools`` checks)."""
        with self.transaction() as txn:
            return txn.add(reserved_bytes, label=label)

    def peek(self) -> tuple[LedgerEntry, ...]:
        """Live entries without writing anything or creating the directory (for ``plan``)."""
        if not self.directory.exists():
            return ()
        self._check_directory()
        return tuple(e for e in self._load() if self._is_live(e, prune=False))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[LedgerTransaction]:
        """Hold the ledger lock; yield the live entries; write them back if changed.

        Not re-entrant on one thread (a nested ``flock`` on a new descriptor would deadlock).
        """
        if getattr(self._local, "active", False):
            raise LedgerError(f"{self.path}: a ledger transaction is already open on this thread")
        self._ensure_directory()
        lock_fd = open_transient(lambda: self._open_checked(self.lock_path, create=True))
        self._local.active = True
        txn = None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            stored = self._load()
            live = [e for e in stored if self._is_live(e)]
            txn = LedgerTransaction(self, live, dirty=len(live) != len(stored))
            yield txn
            if txn.dirty:
                self._store(txn.entries)
        except BaseException:
            if txn is not None:
                txn._drop_added()  # never written: their owner locks go too
            raise
        finally:
            self._local.active = False
            close_transient(lock_fd)  # closing the descriptor drops the flock

    # --- internals ---------------------------------------------------------------------------

    def _own_identity(self) -> tuple[int, int]:
        pid = os.getpid()
        if self._identity is None or self._identity[0] != pid:
            start = read_process_start_ticks(pid, self.proc_root)
            if start is None:
                raise LedgerError(
                    f"cannot read this process's start time from "
                    f"{self.proc_root / 'proc' / str(pid) / 'stat'}; the ledger needs a Linux /proc"
                )
            self._identity = (pid, start)
        return self._identity

    def _owner_lock_path(self, entry_id: str) -> Path:
        return self.directory / f"owner-{entry_id}.lock"

    def _hold_owner_lock(self, entry_id: str) -> int:
        """Create and lock the owner lock of a new entry; the descriptor holds the lock."""
        fd = self._open_checked(self._owner_lock_path(entry_id), create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _is_live(self, entry: LedgerEntry, *, prune: bool = True) -> bool:
        """Whether the entry's owner still runs: its owner lock is held (by it, in any PID
        namespace); without an owner lock, its pid and start time. ``prune``: remove the owner
        lock of a gone owner (under the ledger lock; ``peek`` writes nothing)."""
        path = self._owner_lock_path(entry.entry_id)
        try:
            fd = open_transient(lambda: os.open(
                path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK))
        except FileNotFoundError:
            return read_process_start_ticks(entry.pid, self.proc_root) == entry.start_time_ticks
        except OSError:
            return True  # cannot tell: keep the reservation (the budget stays safe)
        try:
            # Shared: refused while the owner holds it (exclusively), but compatible with other
            # readers probing it at the same moment (a scrape's peek must not make a gone
            # owner look alive to a start deciding whether its pool fits).
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # its owner holds it
        except OSError:
            return True
        else:
            if prune:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return False
        finally:
            close_transient(fd)

    def _unsafe(self, what: str, path: Path, why: str, fix: str) -> LedgerError:
        return LedgerError(f"host-memory ledger {what} {path} {why}; {fix}")

    def _check_mode(self, what: str, path: Path, st: os.stat_result, fix: str) -> None:
        if st.st_uid != os.geteuid():
            raise self._unsafe(
                what, path, f"is owned by uid {st.st_uid}, not this user (uid {os.geteuid()})", fix
            )
        if st.st_mode & 0o077:
            raise self._unsafe(
                what, path, f"is group/world-accessible (mode {stat.S_IMODE(st.st_mode):04o})", fix
            )

    def _check_directory(self) -> None:
        st = os.stat(self.directory)
        fix = f"use a private directory: chmod 700 {self.directory}, or set ${LEDGER_ENV} to another one"
        if not stat.S_ISDIR(st.st_mode):
            raise self._unsafe("directory", self.directory, "is not a directory", fix)
        self._check_mode("directory", self.directory, st, fix)

    def _ensure_directory(self) -> None:
        try:
            self._make_directory()
        except LedgerError:
            raise
        except OSError as exc:  # a parent that is a file, or a tree nobody may write
            raise LedgerError(
                f"cannot create the host ledger directory {self.directory}: {exc.strerror} "
                f"({type(exc).__name__}); set ${LEDGER_ENV} (or ServiceConfig.ledger_directory) "
                f"to a directory this process can create") from exc

    def _make_directory(self) -> None:
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(self.directory.parent, exist_ok=True)
            try:
                os.mkdir(self.directory, 0o700)
            except FileExistsError:  # another process made it meanwhile: checked below
                pass
            else:
                os.chmod(self.directory, 0o700)
        else:
            os.chmod(self.directory, 0o700)  # mkdir's mode is masked by the umask
        self._check_directory()

    def _open_checked(self, path: Path, *, create: bool) -> int:
        """Open a ledger file without following links; refuse one that is not ours and private."""
        # O_NONBLOCK: a FIFO planted here must not hang the open.
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_RDWR if create else os.O_RDONLY)
        created = False
        try:
            try:
                fd = (
                    os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                    if create
                    else os.open(path, flags)
                )
                created = create
            except FileExistsError:
                fd = os.open(path, flags)
        except OSError as exc:
            raise self._unsafe(
                "file", path, f"cannot be opened ({exc.strerror})", f"delete it (rm {path})"
            ) from None
        try:
            if created:
                os.fchmod(fd, 0o600)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._unsafe("file", path, "is not a regular file", f"delete it (rm -r {path})")
            self._check_mode("file", path, st, f"delete it (rm {path}) or chmod 600 it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _corrupt(self, why: str) -> LedgerError:
        return LedgerError(
            f"host-memory ledger {self.path} is not a valid dsa_async ledger ({why}); delete it "
            f"(rm {self.path}) - the reservations of dsa_async processes running now are then "
            f"forgotten, so restart them if any"
        )

    def _load(self) -> list[LedgerEntry]:
        if not os.path.lexists(self.path):
            return []
        fd = self._open_checked(self.path, create=False)
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        if not raw.strip():
            return []
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise self._corrupt(f"not JSON: {type(exc).__name__}") from None
        if not isinstance(data, dict) or data.get("schema") != LEDGER_SCHEMA:
            raise self._corrupt(f"no schema {LEDGER_SCHEMA!r}")
        if not isinstance(data.get("entries"), list):
            raise self._corrupt("'entries' is not a list")
        return [self._parse_entry(i, item) for i, item in enumerate(data["entries"])]

    def _parse_entry(self, index: int, item: object) -> LedgerEntry:
        if not isinstance(item, dict) or set(item) != _ENTRY_FIELDS:
            raise self._corrupt(
                f"entry {index} does not have exactly the fields {sorted(_ENTRY_FIELDS)}"
            )
        for key in _ENTRY_INT_FIELDS:
            value = item[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise self._corrupt(f"entry {index}: {key} is not an int >= 0")
        if not isinstance(item["id"], str) or not isinstance(item["label"], str):
            raise self._corrupt(f"entry {index}: id and label must be strings")
        if not _ENTRY_ID.fullmatch(item["id"]):
            raise self._corrupt(f"entry {index}: id {shown(item['id'])} is not 1 to 64 letters, "
                                f"digits, '_' or '-'")
        if item["allocated_bytes"] > item["reserved_bytes"]:
            raise self._corrupt(f"entry {index}: allocated_bytes exceeds reserved_bytes")
        return LedgerEntry(
            item["id"],
            item["pid"],
            item["start_time_ticks"],
            item["label"],
            item["reserved_bytes"],
            item["allocated_bytes"],
        )

    def _store(self, entries: tuple[LedgerEntry, ...]) -> None:
        payload = json.dumps(
            {"schema": LEDGER_SCHEMA, "entries": [e.to_json() for e in entries]}, indent=1
        )
        tmp = self.directory / f".{LEDGER_FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    os.fchmod(f.fileno(), 0o600)
                    f.write(payload)
                os.replace(tmp, self.path)  # readers see the old file or the new one, never half
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # a full or read-only file system, a file size limit
            raise LedgerError(
                f"cannot write the host-memory ledger {self.path}: {exc.strerror or exc} "
                f"({type(exc).__name__}); free space there (df {self.directory}) or set "
                f"${LEDGER_ENV} (or ServiceConfig.ledger_directory) to a writable private "
                f"directory") from exc
