import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_roots import GIB, make_root, write_meminfo, write_proc_stat

from dsa_async.errors import ConfigError, HostBudgetExceeded, LedgerError
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.ledger import (
    LEDGER_ENV,
    LEDGER_SCHEMA,
    HostLedger,
    default_ledger_directory,
    read_process_start_ticks,
)
from dsa_async.host_memory.plan import reserve_host_pools

REPO = Path(__file__).resolve().parents[1]
INDEXER = dsa_indexer()
BUDGET_BYTES = 10 * GIB  # MemAvailable of the fake root; tests reserve 0 extra

# A co-located rank: reserve, report, then hold the reservation until stdin closes.
RANK_SCRIPT = """
import sys
from dsa_async.errors import HostBudgetExceeded
from dsa_async.geometry import dsa_indexer
from dsa_async.ledger import HostLedger
from dsa_async.plan import reserve_host_pools

requested, root, directory, wait_for_go = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if wait_for_go:
    sys.stdin.readline()
try:
    plan, reservation = reserve_host_pools(
        [dsa_indexer()], requested_bytes=requested, root=root, ledger=HostLedger(directory),
        reserve_bytes=0,
    )
    print("OK", reservation.entry_id, flush=True)
except HostBudgetExceeded:
    print("REFUSED", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def root(tmp_path):
    return make_root(tmp_path, mem_total_bytes=16 * GIB, mem_available_bytes=BUDGET_BYTES)


@pytest.fixture
def ledger_dir(tmp_path):
    return tmp_path / "ledger"


def start_rank(requested_bytes, root, ledger_dir, *, wait_for_go=False):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            RANK_SCRIPT,
            str(requested_bytes),
            str(root),
            str(ledger_dir),
            "1" if wait_for_go else "0",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def stop(proc):
    proc.stdin.close()
    proc.wait(timeout=30)
    proc.stdout.close()


def reserve(root, ledger, requested_bytes):
    return reserve_host_pools(
        [INDEXER], requested_bytes=requested_bytes, root=root, ledger=ledger, reserve_bytes=0
    )


def write_ledger(directory: Path, entries, *, mode=0o600):
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / "ledger.json"
    path.write_text(json.dumps({"schema": LEDGER_SCHEMA, "entries": entries}))
    path.chmod(mode)
    return path


def entry(entry_id, pid, start_time_ticks, reserved_bytes=GIB, allocated_bytes=0):
    return {
        "id": entry_id,
        "pid": pid,
        "start_time_ticks": start_time_ticks,
        "label": "indexer",
        "reserved_bytes": reserved_bytes,
        "allocated_bytes": allocated_bytes,
    }


# --- co-located processes --------------------------------------------------------------------


def test_second_process_asking_60_percent_is_refused_while_the_first_holds_60(root, ledger_dir):
    sixty_percent = BUDGET_BYTES * 6 // 10
    first = start_rank(sixty_percent, root, ledger_dir)
    try:
        assert first.stdout.readline().split()[0] == "OK"
        with pytest.raises(HostBudgetExceeded) as refused:
            reserve(root, HostLedger(ledger_dir), sixty_percent)
        message = str(refused.value)
        assert f"pid {first.pid} 'indexer'" in message
        assert "other reservations" in message and str(ledger_dir / "ledger.json") in message
        first.kill()  # SIGKILL: no chance to release
        first.wait(timeout=30)
        ledger = HostLedger(ledger_dir)
        plan, reservation = reserve(root, ledger, sixty_percent)  # the dead entry is reclaimed
        assert [e.pid for e in ledger.entries()] == [os.getpid()]
        reservation.release()
    finally:
        first.kill()
        stop(first)


def test_two_processes_racing_for_60_percent_cannot_both_pass(root, ledger_dir):
    sixty_percent = BUDGET_BYTES * 6 // 10
    ranks = [start_rank(sixty_percent, root, ledger_dir, wait_for_go=True) for _ in range(2)]
    try:
        for rank in ranks:
            rank.stdin.write("go\n")
            rank.stdin.flush()
        verdicts = sorted(rank.stdout.readline().split()[0] for rank in ranks)
        assert verdicts == ["OK", "REFUSED"]
        held = HostLedger(ledger_dir).entries()
        assert len(held) == 1 and held[0].pid in {r.pid for r in ranks}
    finally:
        for rank in ranks:
            stop(rank)
    assert HostLedger(ledger_dir).entries() == ()  # both exited: nothing left behind


# --- liveness --------------------------------------------------------------------------------


def test_reused_pid_with_another_start_time_is_treated_as_gone(tmp_path, ledger_dir):
    proc_root = tmp_path / "procroot"
    write_proc_stat(proc_root, 4242, 2000, comm="evil) (name")  # same pid, later start: reused
    write_proc_stat(proc_root, 4343, 3000, comm="python 3")  # same pid and start: alive
    write_proc_stat(proc_root, 4545, 5000, state="Z")  # zombie: holds no memory
    write_ledger(
        ledger_dir,
        [
            entry("reused", 4242, 1000),
            entry("alive", 4343, 3000),
            entry("gone", 4444, 4000),
            entry("zombie", 4545, 5000),
        ],
    )
    ledger = HostLedger(ledger_dir, proc_root=proc_root)
    assert [e.entry_id for e in ledger.peek()] == ["alive"]
    assert (
        len(json.loads((ledger_dir / "ledger.json").read_text())["entries"]) == 4
    )  # peek wrote nothing
    assert [e.entry_id for e in ledger.entries()] == ["alive"]
    assert [e["id"] for e in json.loads((ledger_dir / "ledger.json").read_text())["entries"]] == [
        "alive"
    ]
    assert ledger.pending_bytes() == GIB


def test_start_time_is_field_22_even_when_comm_has_spaces_and_parens(tmp_path):
    write_proc_stat(tmp_path, 77, 123456, comm="a) b (c")
    assert read_process_start_ticks(77, tmp_path) == 123456
    assert read_process_start_ticks(78, tmp_path) is None
    assert read_process_start_ticks(os.getpid()) is not None


# --- counting --------------------------------------------------------------------------------


def test_allocated_bytes_are_not_counted_twice(tmp_path, ledger_dir):
    root = make_root(tmp_path, mem_total_bytes=16 * GIB, mem_available_bytes=BUDGET_BYTES)
    ledger = HostLedger(ledger_dir)
    plan, held = reserve(root, ledger, 4 * GIB)
    assert ledger.pending_bytes() == plan.requested_bytes
    held.mark_allocated(plan.requested_bytes)
    assert ledger.pending_bytes() == 0
    assert ledger.pending_bytes(exclude_entry=held.entry_id) == 0
    # The allocation now shows up in MemAvailable (rounded to whole kB as meminfo reports it).
    after_kib = (BUDGET_BYTES - plan.requested_bytes) // 1024
    write_meminfo(root, mem_total_bytes=16 * GIB, mem_available_bytes=after_kib * 1024)
    auto, second = reserve_host_pools([INDEXER], root=root, ledger=ledger, reserve_bytes=0)
    assert auto.available_bytes == after_kib * 1024  # not minus the allocation a second time
    assert auto.num_pages == after_kib * 1024 // INDEXER.bytes_per_page
    second.release()
    held.release()


def test_partly_allocated_reservation_counts_only_its_remainder(ledger_dir):
    ledger = HostLedger(ledger_dir)
    with ledger.reserve(3 * GIB, label="kv") as held:
        held.mark_allocated(GIB)
        assert held.allocated_bytes == GIB
        assert ledger.pending_bytes() == 2 * GIB
        assert ledger.pending_bytes(exclude_entry=held.entry_id) == 0
        with pytest.raises(ConfigError, match="exceed"):
            held.mark_allocated(4 * GIB)
    assert held.released and ledger.pending_bytes() == 0


def test_release_is_idempotent(ledger_dir):
    ledger = HostLedger(ledger_dir)
    keep = ledger.reserve(GIB, label="keep")
    held = ledger.reserve(GIB, label="indexer")
    held.release()
    held.release()
    with held:
        pass
    assert [e.entry_id for e in ledger.entries()] == [keep.entry_id]
    with pytest.raises(LedgerError, match="released"):
        held.mark_allocated(0)
    keep.release()


# --- file safety -----------------------------------------------------------------------------


def test_directory_is_0700_and_files_are_0600(tmp_path):
    directory = tmp_path / "nested" / "ledger"
    old_umask = os.umask(0o022)
    try:
        held = HostLedger(directory).reserve(GIB, label="indexer")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "ledger.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((directory / "ledger.lock").stat().st_mode) == 0o600
    held.release()


def test_default_directory_is_private_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv(LEDGER_ENV, raising=False)
    assert default_ledger_directory().name == f"dsa_async-{os.geteuid()}"
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "x"))
    assert default_ledger_directory() == tmp_path / "x"
    assert HostLedger().directory == tmp_path / "x"


@pytest.mark.parametrize("under", ["a-file", "proc"])
def test_a_ledger_directory_that_cannot_be_created_is_a_ledger_error(tmp_path, under):
    """A ledger directory below a regular file, or in a tree nobody may create in, is
    refused with LedgerError naming the path and the setting to change (it leaked
    NotADirectoryError / FileNotFoundError)."""
    if under == "a-file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "sub" / "ledger"
    else:
        path = Path("/proc/dsa-async-no-such/ledger")
    with pytest.raises(LedgerError, match=f"cannot create the host ledger directory {path}.*"
                                          f"{LEDGER_ENV}"):
        HostLedger(path).pending_bytes()


def test_group_or_world_accessible_directory_is_refused(ledger_dir):
    ledger_dir.mkdir()
    ledger_dir.chmod(0o755)
    with pytest.raises(LedgerError, match=r"group/world-accessible \(mode 0755\).*chmod 700"):
        HostLedger(ledger_dir).pending_bytes()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_directory_owned_by_another_user_is_refused(ledger_dir):
    ledger_dir.mkdir(mode=0o700)
    os.chown(ledger_dir, 65534, 65534)
    with pytest.raises(LedgerError, match="owned by uid 65534"):
        HostLedger(ledger_dir).reserve(GIB, label="indexer")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_file_owned_by_another_user_is_refused(ledger_dir):
    path = write_ledger(ledger_dir, [])
    os.chown(path, 65534, 65534)
    with pytest.raises(LedgerError, match=f"{path}.*owned by uid 65534"):
        HostLedger(ledger_dir).entries()


def test_ledger_file_with_an_open_mode_is_refused(ledger_dir):
    path = write_ledger(ledger_dir, [], mode=0o644)
    with pytest.raises(LedgerError, match=f"{path}.*mode 0644.*rm {path}"):
        HostLedger(ledger_dir).entries()


def test_symlinked_ledger_file_is_refused(tmp_path, ledger_dir):
    ledger_dir.mkdir(mode=0o700)
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    (ledger_dir / "ledger.json").symlink_to(target)
    with pytest.raises(LedgerError, match="cannot be opened"):
        HostLedger(ledger_dir).entries()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "\xff\xfe",
        "[1, 2]",
        json.dumps({"schema": "other/9", "entries": []}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": {}}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [{"id": "x"}]}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("x", 1, 1) | {"pid": "1"}]}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("x", 1, 1) | {"reserved_bytes": -1}]}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("x", 1, 1) | {"allocated_bytes": True}]}),
        json.dumps(
            {"schema": LEDGER_SCHEMA, "entries": [entry("x", 1, 1, reserved_bytes=1, allocated_bytes=2)]}
        ),
        "[" * 100_000,
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("a\u0000b", 1, 1)]}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("x" * 300, 4_000_000, 1)]}),
        json.dumps({"schema": LEDGER_SCHEMA, "entries": [entry("../ledger", 1, 1)]}),
    ],
    ids=[
        "not-json",
        "not-utf8",
        "not-an-object",
        "foreign-schema",
        "entries-not-a-list",
        "missing-fields",
        "pid-as-string",
        "negative-bytes",
        "bool-as-int",
        "allocated-over-reserved",
        "deeply-nested",
        "id-with-a-nul",  # no owner lock file can have that name: a crash, not a refusal
        "id-too-long-for-a-file-name",  # its owner lock cannot be opened: kept forever
        "id-naming-another-file",
    ],
)
def test_corrupt_or_foreign_ledger_is_a_clear_error(ledger_dir, content):
    path = write_ledger(ledger_dir, [])
    path.write_text(content, encoding="latin-1")
    for access in (HostLedger(ledger_dir).entries, HostLedger(ledger_dir).peek):
        with pytest.raises(LedgerError, match=f"{path} is not a valid dsa_async ledger.*rm {path}"):
            access()


def test_empty_ledger_file_is_an_empty_ledger(ledger_dir):
    write_ledger(ledger_dir, []).write_text("")
    assert HostLedger(ledger_dir).entries() == ()


def test_peek_creates_nothing(tmp_path):
    directory = tmp_path / "absent"
    assert HostLedger(directory).peek() == ()
    assert not directory.exists()


def test_nested_transaction_on_one_thread_is_refused(ledger_dir):
    ledger = HostLedger(ledger_dir)
    with ledger.transaction() as txn:
        held = txn.add(GIB, label="indexer")
        with pytest.raises(LedgerError, match="already open"):
            ledger.pending_bytes()
    held.release()
    assert ledger.entries() == ()


def test_processes_creating_a_nested_ledger_directory_at_once_all_reserve(tmp_path):
    """Several ranks starting together on a ledger directory whose parent does not exist yet:
    whichever creates it, the others use it (no FileExistsError), and every reservation lands."""
    import threading

    directory = tmp_path / "not" / "yet" / "ledger"
    start = threading.Barrier(6)
    errors: list[BaseException] = []
    reservations = []

    def rank() -> None:
        start.wait()
        try:
            reservations.append(HostLedger(directory).reserve(1024, label="rank"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert len(HostLedger(directory).entries()) == 6
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for reservation in reservations:
        reservation.release()


def test_a_live_owner_whose_pid_the_reader_cannot_see_keeps_its_reservation(root, ledger_dir,
                                                                            tmp_path):
    """A rank in another PID namespace (a container sharing the ledger directory) has a pid
    that means nothing, or another process, in this reader's /proc: its owner lock, held while
    it runs, keeps its reservation counted. Simulated by a reader whose /proc is empty."""
    sixty_percent = BUDGET_BYTES * 6 // 10
    other = start_rank(sixty_percent, root, ledger_dir)
    try:
        assert other.stdout.readline().split()[0] == "OK"
        blind = HostLedger(ledger_dir, proc_root=tmp_path / "empty-proc")  # sees no process
        assert [e.pid for e in blind.entries()] == [other.pid]
        with pytest.raises(HostBudgetExceeded):
            reserve(root, blind, sixty_percent)
    finally:
        stop(other)
    # gone (its lock went with it): the blind reader drops the entry and its owner lock
    assert HostLedger(ledger_dir, proc_root=tmp_path / "empty-proc").entries() == ()
    assert not list(ledger_dir.glob("owner-*.lock"))


def test_a_killed_owner_is_dropped_even_if_its_pid_looks_alive(root, ledger_dir):
    """The owner lock decides: once the owner is gone its lock is free, whatever the pid (here
    the pid of a live process, as after pid reuse in another namespace)."""
    other = start_rank(GIB, root, ledger_dir)
    assert other.stdout.readline().split()[0] == "OK"
    other.kill()
    other.wait(timeout=30)
    other.stdout.close()
    other.stdin.close()
    (entry_json,) = json.loads((ledger_dir / "ledger.json").read_text())["entries"]
    entry_json["pid"], entry_json["start_time_ticks"] = os.getpid(), read_process_start_ticks(
        os.getpid())
    (ledger_dir / "ledger.json").write_text(json.dumps(
        {"schema": LEDGER_SCHEMA, "entries": [entry_json]}))
    assert HostLedger(ledger_dir).entries() == ()


def test_a_ledger_that_cannot_be_written_is_a_ledger_error_leaving_no_owner_lock(ledger_dir):
    """A full or read-only file system: a LedgerError naming the file and what to change; the
    owner lock of the reservation that was never written is closed and removed."""
    ledger = HostLedger(ledger_dir)
    ledger.entries()  # the directory exists
    blocker = ledger_dir / f".ledger.json.{os.getpid()}.{threading.get_ident()}.tmp"
    blocker.mkdir()  # the temporary file cannot be created: as on a full /dev/shm
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(LedgerError, match=r"cannot write the host-memory ledger .*DSA_ASYNC_LEDGER"):
        ledger.reserve(GIB, label="never written")
    assert not list(ledger_dir.glob("owner-*.lock"))
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    blocker.rmdir()
    assert ledger.entries() == ()


def test_a_release_the_ledger_cannot_write_still_lets_every_process_reclaim_the_entry(
        ledger_dir):
    """A full file system when a reservation is released (a failed start, close()): the
    entry stays in the file, but its owner lets go of its lock, so every reader (this process
    or another) reads it as gone instead of counting it while this process lives."""
    ledger = HostLedger(ledger_dir)
    keep = ledger.reserve(GIB, label="keep")
    held = ledger.reserve(2 * GIB, label="indexer")
    blocker = ledger_dir / f".ledger.json.{os.getpid()}.{threading.get_ident()}.tmp"
    blocker.mkdir()  # the temporary file cannot be created: as on a full /dev/shm
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(LedgerError, match="cannot write the host-memory ledger"):
        held.release()
    assert set(os.listdir("/proc/self/fd")) < fds_before  # its owner lock is closed
    assert json.loads((ledger_dir / "ledger.json").read_text())["entries"][1]["id"] == (
        held.entry_id)  # still written
    blocker.rmdir()
    assert [e.entry_id for e in ledger.entries()] == [keep.entry_id]
    assert [e.entry_id for e in HostLedger(ledger_dir).entries()] == [keep.entry_id]
    held.release()  # a retry finds nothing left to do and succeeds
    assert held.released
    assert [p.name for p in ledger_dir.glob("owner-*.lock")] == [f"owner-{keep.entry_id}.lock"]
    keep.release()


def _lock_is_free(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_process_forked_during_a_transaction_does_not_keep_the_ledger_locked(ledger_dir):
    """A server forks workers while a start reserves on another thread: the child must not
    share the transaction's flock for its life, or every start and close on the machine waits
    for it to exit."""
    ledger = HostLedger(ledger_dir)
    inside, leave = threading.Event(), threading.Event()

    def transaction():
        with ledger.transaction():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=transaction)
    holder.start()
    assert inside.wait(10)
    child = os.fork()
    if child == 0:  # the child lives on, doing nothing with the ledger
        time.sleep(30)
        os._exit(0)
    try:
        leave.set()
        holder.join(10)
        # The child closes its copy first thing after the fork, once it is scheduled; without
        # that it would hold the lock for the 30 s it lives.
        deadline = time.monotonic() + 10
        while not _lock_is_free(ledger.lock_path):
            assert time.monotonic() < deadline, "the forked child keeps the ledger locked"
            time.sleep(0.01)
        assert ledger.reserve(GIB, label="after the fork").reserved_bytes == GIB
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_gone_owner_probed_by_another_reader_at_that_moment_is_still_gone(ledger_dir):
    """Readers probe owner locks without the ledger lock (peek: plan, every metrics scrape). A
    probe at the moment a start decides must not make a gone owner look alive to it (a start
    refused although its pool fits)."""
    ledger = HostLedger(ledger_dir)
    ledger.entries()
    write_ledger(ledger_dir, [entry("gone", 4_000_000, 1)])
    owner_lock = ledger_dir / "owner-gone.lock"
    owner_lock.touch(mode=0o600)
    probe = os.open(owner_lock, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another reader's probe, in progress
        assert ledger.entries() == ()
    finally:
        os.close(probe)
