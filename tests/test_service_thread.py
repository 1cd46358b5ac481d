"""``ServiceThread``: a service on a loop of its own, used from threads without one."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
from service_fixtures import PAGE, make_buffers, page_bytes, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import ConfigError, HostBudgetExceeded, ServiceClosedError
from dsa_async.front_door.service import ServiceState
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.ledger import HostLedger
from dsa_async.integrations.loop_thread import ServiceThread

WAIT_S = 10


def _config(tmp_path, **kwargs) -> ServiceConfig:
    return ServiceConfig(geometries=(dsa_indexer(num_layers=2),),
                         host_pool=kwargs.pop("host_pool", PoolSize(pages=16)), backend="cpu",
                         ledger_directory=str(tmp_path / "ledger"), **kwargs)


def test_round_trip_from_a_thread_without_a_loop_then_stop_returns_everything(tmp_path):
    buffers = make_buffers(dsa_indexer(num_layers=2), 8)
    owner = ServiceThread.start(_config(tmp_path), buffers, stop_at_exit=False)
    service = owner.service
    try:
        assert service.state is ServiceState.RUNNING
        expected = page_bytes({"dsa_indexer": buffers}, [1, 2])
        backup = service.evict_threadsafe(tokens([1, 2])).wait(WAIT_S)
        service.prefetch_threadsafe(backup.host_pages, tokens([5, 6])).wait(WAIT_S)
        assert all(buffers[i][[5, 6]].equal(expected["dsa_indexer"][i]) for i in range(2))
        service.release_threadsafe(backup.host_pages)
    finally:
        owner.stop(WAIT_S)
    assert service.state is ServiceState.CLOSED
    assert not owner.running
    owner.stop(WAIT_S)  # idempotent


def test_a_start_that_fails_raises_in_the_starting_thread_and_ends_the_loop(tmp_path):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(HostBudgetExceeded):
        ServiceThread.start(_config(tmp_path, host_pool=PoolSize(pages=1 << 40)),
                            make_buffers(dsa_indexer(num_layers=2), 8), name="dsa-async-failing",
                            stop_at_exit=False)
    assert "dsa-async-failing" not in {t.name for t in threading.enumerate()} - before


def test_stop_drains_what_was_submitted(tmp_path):
    buffers = make_buffers(dsa_indexer(num_layers=2), 8)
    owner = ServiceThread.start(_config(tmp_path), buffers, stop_at_exit=False)
    gate = threading.Event()
    transfer = owner.service.evict_threadsafe(range(0, 3 * PAGE), after=gate)
    stopper = threading.Thread(target=owner.stop, args=(WAIT_S,))
    stopper.start()
    gate.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    assert transfer.wait(WAIT_S).pages == 3  # it completed during the drain


def test_interpreter_exit_without_stop_closes_the_service_and_returns_the_reservation(tmp_path):
    # A host that never calls stop(): the exit hook must still drain, close the engine and
    # release the ledger entry (close() hands those steps to worker threads, which refuse
    # work once the interpreter's own exit handlers ran).
    script = _exit_script(tmp_path, [
        "owner = ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8))",
        "owner.service.evict_threadsafe(tokens([1])).wait(10)",
        "print('started', flush=True)",
    ])
    done = _run(script, timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert "started" in done.stdout
    assert done.stderr == "", done.stderr  # nothing failed while closing at exit
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def test_a_stop_that_times_out_leaves_the_close_running_and_a_later_stop_finishes_it(tmp_path):
    """stop(timeout_s) past its bound raises TimeoutError without stopping the loop under the
    close; a concurrent or later stop() waits for that same close, which returns everything."""
    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)
    gate = threading.Event()
    transfer = owner.service.evict_threadsafe(range(0, 2 * PAGE), after=gate)
    with pytest.raises(TimeoutError, match="call stop\\(\\) again"):
        owner.stop(0.2)  # the drain waits for the gate
    assert owner.service.state is ServiceState.CLOSING and owner._thread.is_alive()
    waiter = threading.Thread(target=owner.stop, args=(WAIT_S,))  # a concurrent stop waits too
    waiter.start()
    gate.set()
    owner.stop(WAIT_S)
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    assert owner.service.state is ServiceState.CLOSED and not owner._thread.is_alive()
    assert transfer.wait(WAIT_S).pages == 2
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def _run(script: str, *, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter; its exit code and output."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=timeout_s)


def _exit_script(tmp_path, body: list[str], **config) -> str:
    return "\n".join([
        "import logging, os, sys, threading, time",
        "logging.basicConfig(level=logging.ERROR, stream=sys.stderr)",
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})",
        "from service_fixtures import make_buffers, tokens",
        "from dsa_async.config import PoolSize, ServiceConfig",
        "from dsa_async.geometry import dsa_indexer",
        "from dsa_async.integrations.loop_thread import ServiceThread",
        "config = ServiceConfig(geometries=(dsa_indexer(num_layers=2),),"
        " host_pool=PoolSize(pages=16), backend='cpu',"
        f" ledger_directory={str(tmp_path / 'ledger')!r}, **{config!r})",
        *body,
    ])


def _fork_child_exits_and_parent_closes(tmp_path, before_fork: list[str],
                                        after_fork: list[str] = ()) -> None:
    """Run ``before_fork`` (it starts a service), fork a child that exits through the exit
    handlers, run ``after_fork`` in the parent and wait for the child: the child must exit 0
    and the parent's exit must close the service and return the reservation."""
    script = _exit_script(tmp_path, [
        *before_fork,
        "pid = os.fork()",
        "if pid == 0:",
        "    sys.exit(0)  # runs the exit handlers, the (inherited) hook among them",
        *after_fork,
        "_, status = os.waitpid(pid, 0)",
        "print('child', os.waitstatus_to_exitcode(status), flush=True)",
    ])
    done = _run(script, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert "child 0" in done.stdout
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def test_a_forked_child_exits_and_the_parent_still_closes_at_exit(tmp_path):
    """The exit hook runs only in the process that started the service: a child forked after
    start exits at once, and the parent's exit still closes and returns the reservation."""
    _fork_child_exits_and_parent_closes(tmp_path, [
        "service = ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8))"
        ".service",  # the host keeps only the service: the hook holds the owner
    ])


def test_a_child_forked_while_the_exit_registry_was_busy_still_exits(tmp_path):
    """A thread of the parent held the exit hook's lock at the fork (another service thread
    starting or stopping): the child's copy of the hook must not wait for that lock."""
    _fork_child_exits_and_parent_closes(tmp_path, [
        "from dsa_async.integrations import loop_thread",
        "ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8))",
        "held, go = threading.Event(), threading.Event()",
        "def hold():",
        "    with loop_thread._AT_EXIT_LOCK:",
        "        held.set(); go.wait()",
        "threading.Thread(target=hold, daemon=True).start(); held.wait()",
    ], ["go.set()"])


def test_exit_is_bounded_when_a_copy_never_ends(tmp_path):
    """A copy that never ends (a wedged device) cannot keep the process from exiting: the exit
    hook waits twice the drain timeout and a grace period, then the process exits."""
    script = _exit_script(tmp_path, [
        "def wedged(batch, first_layer):",
        "    threading.Event().wait()",
        "owner = ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8),"
        " fault_hook=wedged)",
        "owner.service.evict_threadsafe(tokens([1]))",
        "time.sleep(0.3)",
        "print('exiting', flush=True)",
    ], drain_timeout_s=0.5)
    done = _run(script, timeout_s=90)
    assert "exiting" in done.stdout
    assert "did not close within" in done.stderr


def test_stop_right_after_start_closes_even_when_the_loop_thread_runs_late(tmp_path, monkeypatch):
    """start() returns while the loop thread may not have reached its loop yet (descheduled):
    a stop() then must still close the service and end the thread, within its bound."""
    import asyncio

    from dsa_async.integrations import loop_thread

    class LateLoop(asyncio.SelectorEventLoop):
        def run_forever(self):
            threading.Event().wait(0.3)  # a loop thread the OS ran late
            return super().run_forever()

    monkeypatch.setattr(loop_thread, "_new_loop", LateLoop)
    for _ in range(2):
        owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                    stop_at_exit=False)
        owner.stop(WAIT_S)
        assert owner.service.state is ServiceState.CLOSED
        assert owner.stopped and not owner._thread.is_alive()
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


@pytest.mark.parametrize("unbounded", [float("inf"), 1e12, 2**2000],
                         ids=["inf", "1e12", "2**2000"])
def test_stop_takes_every_timeout_a_thread_wait_takes(tmp_path, unbounded):
    """stop()'s bound reads as Transfer.wait's: beyond what a wait can bound is no bound; a
    negative, NaN or non-number bound is refused before anything stops."""
    from dsa_async.errors import ArgumentTypeError, ArgumentValueError

    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)
    try:
        for bad, error in ((-1, ArgumentValueError), (float("nan"), ArgumentValueError),
                           (True, ArgumentTypeError), ("5", ArgumentTypeError)):
            with pytest.raises(error, match="timeout_s"):
                owner.stop(bad)
            assert owner.running and owner.service.state is ServiceState.RUNNING
        owner.stop(unbounded)
        assert owner.stopped and owner.service.state is ServiceState.CLOSED
    finally:
        owner.stop(WAIT_S)
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def test_run_after_stop_is_service_closed_and_makes_no_coroutine(tmp_path):
    from dsa_async.errors import ServiceClosedError

    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)
    assert owner.run(lambda: _answer(), timeout_s=float("inf")) == 42
    owner.stop(WAIT_S)
    made = []
    with pytest.raises(ServiceClosedError, match="after stop"):
        owner.run(lambda: made.append(1))
    assert made == []


async def _answer() -> int:
    return 42


def test_ctrl_c_during_start_closes_what_started_and_ends_the_thread(tmp_path):
    script = _exit_script(tmp_path, [
        "import signal",
        "from dsa_async.transfer.cpu import CpuEngine",
        "def slow_engine(*args, **kwargs):",
        "    time.sleep(1.0)  # Ctrl-C lands while the engine starts",
        "    return CpuEngine(*args, **kwargs)",
        "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()",
        "started = time.monotonic()",
        "try:",
        "    ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8),"
        " name='dsa-async-interrupted', engine_factory=slow_engine)",
        "except KeyboardInterrupt:",
        "    alive = any(t.name == 'dsa-async-interrupted' for t in threading.enumerate())",
        "    print('interrupted', 'alive' if alive else 'ended', flush=True)",
    ])
    done = _run(script, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert "interrupted ended" in done.stdout, done.stdout + done.stderr
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def test_exit_after_a_stop_that_timed_out_still_waits_for_that_close(tmp_path):
    script = _exit_script(tmp_path, [
        "import atexit",
        "owner = ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8))",
        "atexit.register(lambda: print('at exit', owner.service.state.value, flush=True))",
        "gate = threading.Event()",
        "owner.service.evict_threadsafe(tokens([1]), after=gate)",
        "try:",
        "    owner.stop(0.1)  # the drain waits for the gate",
        "except TimeoutError:",
        "    print('timed out', flush=True)",
        "threading.Timer(0.5, gate.set).start()  # the copy ends after the host exits",
    ])
    done = _run(script, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert "timed out" in done.stdout
    assert "at exit closed" in done.stdout, done.stdout  # the hook waited for the close
    assert done.stderr == "", done.stderr
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()


def _run_in_a_thread(owner: ServiceThread, make) -> tuple[threading.Thread, list]:
    """``owner.run(make)`` on a thread of its own, started; the list gets its result or
    the exception it raised."""
    outcome: list[BaseException | object] = []

    def call() -> None:
        try:
            outcome.append(owner.run(make))
        except BaseException as exc:  # noqa: BLE001 - what the caller sees
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    return caller, outcome


def test_a_run_still_going_when_stop_comes_ends_with_service_closed(tmp_path):
    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.sleep(3600)

    caller, outcome = _run_in_a_thread(owner, forever)
    assert started.wait(WAIT_S)
    owner.stop(WAIT_S)
    caller.join(WAIT_S)
    assert not caller.is_alive(), "run() never returned after stop()"
    assert len(outcome) == 1 and isinstance(outcome[0], ServiceClosedError), outcome
    assert HostLedger(tmp_path / "ledger").entries() == ()


@pytest.mark.parametrize("escape", [SystemExit(3), KeyboardInterrupt()], ids=type)
def test_system_exit_in_a_run_reaches_its_caller_and_the_service_keeps_running(tmp_path,
                                                                              escape):
    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)
    try:
        async def leave():
            raise escape

        with pytest.raises(type(escape)):
            owner.run(leave, timeout_s=WAIT_S)
        assert owner.running  # the loop thread still runs the service
        backup = owner.service.evict_threadsafe(tokens([1])).wait(WAIT_S)
        owner.service.release_threadsafe(backup.host_pages)
    finally:
        owner.stop(WAIT_S)
    assert owner.stopped and HostLedger(tmp_path / "ledger").entries() == ()


def test_an_exception_that_escapes_the_loop_closes_the_service(tmp_path):
    owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                stop_at_exit=False)

    def escape() -> None:
        raise SystemExit("a callback ended the loop")

    owner.loop.call_soon_threadsafe(escape)
    owner.stop(WAIT_S)  # the service was closed on the way out: nothing waits forever
    assert owner.stopped and owner.service.state is ServiceState.CLOSED
    assert HostLedger(tmp_path / "ledger").entries() == ()


def test_a_stopped_service_thread_is_not_kept_alive_by_the_exit_hook(tmp_path):
    buffers = make_buffers(dsa_indexer(num_layers=2), 8)
    owner = ServiceThread.start(_config(tmp_path), buffers)  # with the exit hook
    alive = weakref.ref(owner), weakref.ref(owner.service), weakref.ref(buffers[0])
    owner.stop(WAIT_S)
    del owner, buffers
    gc.collect()
    assert [ref() for ref in alive] == [None, None, None]


@pytest.mark.parametrize("config", [None, "config", 5])
def test_a_start_with_no_config_says_so(tmp_path, config):
    with pytest.raises(ConfigError):
        ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8),
                            stop_at_exit=False)


def test_a_refused_start_with_an_endless_drain_timeout_raises_its_own_error(tmp_path):
    config = _config(tmp_path, host_pool=PoolSize(pages=1 << 40), drain_timeout_s=1e300)
    with pytest.raises(HostBudgetExceeded):
        ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8),
                            stop_at_exit=False)


def test_a_run_racing_stop_never_waits_forever(tmp_path):
    # run() passes its check, then the service closes and the loop ends around the moment its
    # coroutine is handed over: whichever way it lands, run() ends with ServiceClosedError
    for attempt in range(5):
        owner = ServiceThread.start(_config(tmp_path), make_buffers(dsa_indexer(num_layers=2), 8),
                                    stop_at_exit=False)

        def make():
            threading.Thread(target=owner.stop).start()
            owner._life.closed.result(WAIT_S)  # the loop is ending now
            return asyncio.sleep(0)

        caller, outcome = _run_in_a_thread(owner, make)
        caller.join(WAIT_S)
        assert not caller.is_alive(), f"run() waited forever (attempt {attempt})"
        assert outcome in ([None],) or isinstance(outcome[0], ServiceClosedError), outcome
        owner.stop(WAIT_S)
