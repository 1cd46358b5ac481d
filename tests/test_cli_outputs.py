"""The commands' output files and interruptions: refused up front when they cannot work, a
one-line error when a write fails at the end, and Ctrl-C / SIGTERM handled in every window of
a run (set-up, the end, between a bench's measurements) without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dsa_async.bench import pool_scenarios
from dsa_async.bench import runner as bench_runner
from dsa_async.cli import bench as cli_bench
from dsa_async.cli import main
from dsa_async.errors import ConfigError
from dsa_async.geometry import dsa_indexer
from dsa_async.host_memory.ledger import LEDGER_ENV
from dsa_async.workload.output_files import check_distinct_files, check_writable_file

DEADLINE_S = 90  # generous: only proves nothing hangs
SERVE_SMALL = ["serve", "--backend", "cpu", "--layers", "2", "--compute-dim", "32",
               "--device-pages", "16", "--quiet"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))


def _trace(path: Path) -> Path:
    path.write_text(json.dumps({"arrival_s": 0, "conversation": "c", "prompt_tokens": 60,
                                "output_tokens": 4}) + "\n")
    return path


@pytest.mark.parametrize("through_link", [False, True])
def test_a_summary_that_would_overwrite_the_trace_is_refused_before_the_run(
        tmp_path, capsys, through_link):
    trace = _trace(tmp_path / "trace.jsonl")
    before = trace.read_text()
    out = trace
    if through_link:
        out = tmp_path / "summary.json"
        out.symlink_to(trace)
    code = main([*SERVE_SMALL, "--workload", f"trace:{trace}", "--json-summary", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--json-summary" in err and "overwrite" in err and "Traceback" not in err
    assert trace.read_text() == before


def test_a_summary_write_that_fails_at_the_end_is_one_line_and_exit_1(capsys):
    code = main([*SERVE_SMALL, "--duration-s", "2", "--arrival-rate", "20",
                 "--json-summary", "/dev/full"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "verdict: OK" in out  # the run's result is shown all the same
    assert "--json-summary '/dev/full' could not be written" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("window, signals", [
    ("setup", ["SIGINT"]),  # while the device buffers are allocated
    ("end", ["SIGINT", "SIGTERM"]),  # while the summary is written, after the drain
    ("exit", ["SIGTERM", "SIGINT"]),  # after the command returned, while the process ends
])
def test_signals_in_any_window_of_serve_end_in_a_summary_not_a_traceback(
        tmp_path, window, signals):
    """A signal before the service is up stops the run as soon as it is (nothing ran: the
    verdict fails, exit 1); signals after the drain only log, and once the summary decided
    the exit code they are ignored; none loses the summary or changes the exit code."""
    out = tmp_path / "s.json"
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from dsa_async.cli import console_main, main
        from dsa_async.workload import runner, summary

        def send():
            for name in {signals!r}:
                os.kill(os.getpid(), getattr(signal, name))

        if {window!r} == "setup":
            allocate = runner.allocate_device_buffers
            def allocate_after_a_signal(*args):
                send()
                return allocate(*args)
            runner.allocate_device_buffers = allocate_after_a_signal
        else:
            write = summary.ServeSummary.write_json
            def write_after_signals(self, *args):
                send()
                return write(self, *args)
            summary.ServeSummary.write_json = write_after_signals
        argv = {[*SERVE_SMALL, "--duration-s", "1", "--json-summary", str(out)]!r}
        if {window!r} == "exit":  # the program's entry, as dsa-async runs it
            sys.argv = ["dsa-async", *argv]
            code = console_main()
            send()
        else:
            code = main(argv)
        sys.exit(code)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=DEADLINE_S, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "dsa-async serve summary" in proc.stdout, proc.stderr
    summary = json.loads(out.read_text())
    if window == "setup":
        assert proc.returncode == 1, proc.stderr
        assert summary["stop_reason"] == "SIGINT" and summary["forward_steps"] == 0
        assert summary["leaked_pages"] == 0
        assert summary["failures"] == ["no forward step ran, so nothing was verified: SIGINT "
                                       "stopped the run before the first step; let it run "
                                       "longer before stopping it"]
    else:
        assert proc.returncode == 0, proc.stderr
        assert summary["stop_reason"] == "duration reached" and summary["ok"] is True


@pytest.mark.parametrize("command", [["serve", "--duration-s", "1"], ["plan"], ["--help"]])
def test_ctrl_c_while_the_command_line_loads_torch_is_exit_130_not_a_traceback(tmp_path, command):
    """The first seconds of every command go to importing torch: a Ctrl-C then (sent here the
    moment torch is asked for) ends the command with one line and 130."""
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import importlib.abc, os, signal, sys

        class CtrlCAtTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, CtrlCAtTorch())
        from dsa_async.cli import main
        sys.exit(main({command!r}))
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=DEADLINE_S, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "dsa-async: interrupted while starting\n"
    assert proc.stdout == ""


def test_the_output_path_check_refuses_pseudo_files_and_accepts_standard_streams():
    with pytest.raises(ConfigError, match="pseudo file system /proc"):
        check_writable_file("/proc/version", "--json")
    check_writable_file("/dev/stdout", "--json")  # leads into /proc/self/fd: still fine


def test_two_settings_naming_one_file_are_refused_whichever_way_they_name_it(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match="--json and --plot both name"):
        check_distinct_files({"--json": tmp_path / "a.png",
                              "--plot": tmp_path / "sub" / ".." / "a.png"})
    check_distinct_files({"--json": tmp_path / "a.json", "--plot": tmp_path / "a.png",
                          "--other": None})


@pytest.mark.parametrize("args, problem", [
    (["--json", "{d}/same.png", "--plot", "{d}/same.png"], "both name"),
    (["--plot", "{d}/plot.txt"], "ending in .png"),
])
def test_bench_outputs_that_cannot_both_be_right_are_refused_before_measuring(
        tmp_path, capsys, args, problem):
    started = time.monotonic()
    code = main(["bench", "--backend", "cpu", *[a.format(d=tmp_path) for a in args]])
    assert code == 2
    assert problem in capsys.readouterr().err
    assert time.monotonic() - started < 30  # nothing measured
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def tiny_bench(monkeypatch):
    """The bench CLI on a tiny geometry with only the scenarios a test sets."""
    import functools

    monkeypatch.setattr(bench_runner, "BenchConfig",
                        functools.partial(bench_runner.BenchConfig,
                                          geometry=dsa_indexer(num_layers=2)))
    monkeypatch.setattr(cli_bench, "_figure_bytes", lambda quick: 1 << 20)

    def use(scenarios):
        monkeypatch.setattr(bench_runner, "SCENARIOS", list(scenarios))
    return use


def test_a_bench_json_that_fails_at_the_end_is_one_line_and_exit_1(tiny_bench, capsys):
    tiny_bench([pool_scenarios.pool_startup])
    code = main(["bench", "--quick", "--backend", "cpu", "--json", "/dev/full"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "pool.startup_ratio_to_first_touch" in out  # the table is shown all the same
    assert "--json '/dev/full' could not be written" in err and "Traceback" not in err


def test_ctrl_c_stops_the_bench_at_the_next_measurement_without_a_traceback(
        tiny_bench, tmp_path, capsys):
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by something else in this process")
    ran = []
    main_thread = threading.main_thread().ident

    def interrupted(ctx):
        ran.append("interrupted")
        signal.pthread_kill(main_thread, signal.SIGINT)  # what Ctrl-C does
        assert ctx.stopping.wait(DEADLINE_S), "the bench never asked this scenario to stop"
        ctx.check_stop()  # raises: the scenario stops here
        ran.append("went on after the stop")
        return {}

    def later(ctx):
        ran.append("later")
        return {}

    tiny_bench([interrupted, later])
    out_path = tmp_path / "b.json"
    started = time.monotonic()
    code = main(["bench", "--quick", "--backend", "cpu", "--json", str(out_path)])
    err = capsys.readouterr().err
    assert code == 130
    assert ran == ["interrupted"]
    assert "interrupted" in err and "Traceback" not in err
    assert not out_path.exists()
    assert time.monotonic() - started < DEADLINE_S
