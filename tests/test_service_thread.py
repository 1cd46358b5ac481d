"""``ServiceThread``: a service on a loop of its own, used from threads without one."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from service_fixtures import PAGE, make_buffers, page_bytes, tokens

from dsa_async.config import PoolSize, ServiceConfig
from dsa_async.errors import HostBudgetExceeded
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
    script = "\n".join([
        "import logging, sys",
        "logging.basicConfig(level=logging.ERROR, stream=sys.stderr)",
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})",
        "from service_fixtures import make_buffers, tokens",
        "from dsa_async.config import PoolSize, ServiceConfig",
        "from dsa_async.geometry import dsa_indexer",
        "from dsa_async.integrations.loop_thread import ServiceThread",
        "config = ServiceConfig(geometries=(dsa_indexer(num_layers=2),),"
        " host_pool=PoolSize(pages=16), backend='cpu',"
        f" ledger_directory={str(tmp_path / 'ledger')!r})",
        "owner = ServiceThread.start(config, make_buffers(dsa_indexer(num_layers=2), 8))",
        "owner.service.evict_threadsafe(tokens([1])).wait(10)",
        "print('started', flush=True)",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "started" in done.stdout
    assert done.stderr == "", done.stderr  # nothing failed while closing at exit
    assert HostLedger(str(tmp_path / "ledger")).peek() == ()
