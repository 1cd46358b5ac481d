"""``dsa-async serve`` as users run it: a real process, real signals, the JSON summary; the
trace replay runs the same coroutine in this process.

Each run is small (4 layers, a few dozen device pages) so it takes a few seconds, most of it
importing torch. Waits are bounded by deadlines; nothing sleeps to wait for the process.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from dsa_async.cli import build_parser, main
from dsa_async.cli.serve import options_from
from dsa_async.host_memory.ledger import LEDGER_ENV
from dsa_async.workload.runner import STARTED, serve

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 90  # generous: only proves nothing hangs
SMALL = ["--layers", "4", "--compute-dim", "32"]


@pytest.fixture
def env(tmp_path):
    return {**os.environ, LEDGER_ENV: str(tmp_path / "ledger"), "PYTHONUNBUFFERED": "1"}


class Serve:
    """``python -m dsa_async serve ARGS`` with both output streams read by threads, so the test
    can wait for a line without blocking on a full pipe."""

    def __init__(self, env, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "dsa_async", "serve", *args], cwd=REPO,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._stderr_lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._threads = [threading.Thread(target=self._pump, args=(name,), daemon=True)
                         for name in self._out]
        for thread in self._threads:
            thread.start()

    def _pump(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self._out[name].append(line)
            if name == "stderr":
                self._stderr_lines.put(line)
        if name == "stderr":
            self._stderr_lines.put(None)

    def wait_for(self, marker: str, deadline_s: float = DEADLINE_S) -> str:
        """The first new stderr line holding ``marker``; fails after ``deadline_s``."""
        end = time.monotonic() + deadline_s
        while (left := end - time.monotonic()) > 0:
            try:
                line = self._stderr_lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break  # the process ended
            if marker in line:
                return line
        pytest.fail(f"no stderr line with {marker!r} within {deadline_s} s; "
                    f"stderr so far: {''.join(self._out['stderr'])}")

    def finish(self, deadline_s: float = DEADLINE_S) -> tuple[int, str, str]:
        """Wait for the exit; (exit code, stdout, stderr). Kills it after ``deadline_s``."""
        try:
            code = self.proc.wait(timeout=deadline_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code, "".join(self._out["stdout"]), "".join(self._out["stderr"])


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


def _assert_clean(summary: dict) -> None:
    assert summary["mismatches"] == 0
    assert summary["leaked_pages"] == 0 and summary["statistics_match"] is True
    assert summary["prefetched_pages"] == summary["verified_pages"]
    assert summary["device_pages_in_use"] == 0
    assert summary["ok"] is True


def test_serve_moves_pages_both_ways_and_verifies_every_prefetched_page(tmp_path, env):
    out = tmp_path / "s.json"
    run = Serve(env, "--duration-s", "4", *SMALL, "--device-pages", "64", "--arrival-rate", "20",
                "--metrics-port", "0", "--json-summary", str(out), "--quiet")
    url = run.wait_for("metrics at http://127.0.0.1:").split("metrics at ", 1)[1].strip()
    run.wait_for(STARTED)
    with urllib.request.urlopen(url, timeout=10) as response:  # served while it runs
        assert b"dsa_async_transfer_bytes_total" in response.read()
    code, stdout, stderr = run.finish()
    assert code == 0, stderr
    summary = _summary(out)
    assert summary["stop_reason"] == "duration reached"
    assert summary["bytes_d2h"] > 0 and summary["bytes_h2d"] > 0
    assert summary["requests_d2h"] > 0 and summary["requests_h2d"] > 0
    assert summary["gbps_d2h"] > 0 and summary["gbps_h2d"] > 0
    assert summary["prefetched_pages"] > 0
    assert summary["padding_bytes"] > 0  # evictions end inside pages
    assert summary["prefetch_layers_on_time"] + summary["prefetch_layers_late"] > 0
    assert summary["prefetch_layers_wasted"] == 0
    _assert_clean(summary)
    assert "MISMATCHES 0, leaked 0" in stdout and "verdict: OK" in stdout
    assert "GB/s" in stdout and "d2h" not in stderr  # --quiet: no status lines


def test_sigterm_mid_run_drains_and_writes_the_summary(tmp_path, env):
    out = tmp_path / "s.json"
    run = Serve(env, *SMALL, "--device-pages", "48", "--arrival-rate", "20",
                "--json-summary", str(out))
    try:
        run.wait_for(STARTED)
        run.wait_for("d2h")  # the first status line: work is under way
        run.proc.send_signal(signal.SIGTERM)
    finally:
        code, stdout, stderr = run.finish()
    assert code == 0, stderr
    assert "SIGTERM: stopping arrivals and draining" in stderr
    summary = _summary(out)
    assert summary["stop_reason"] == "SIGTERM" and summary["turns"] > 0
    _assert_clean(summary)
    assert "verdict: OK" in stdout


async def test_trace_workload_replays_every_turn(tmp_path, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    trace = tmp_path / "trace.jsonl"
    rows = ["# 8 conversations, 3 turns each: more than the device holds"]
    for turn in range(3):
        for c in range(8):
            rows.append(json.dumps({"arrival_s": turn * 0.4 + c * 0.02, "conversation": f"c{c}",
                                    "prompt_tokens": 60 + c, "output_tokens": 20}))
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "s.json"
    args = build_parser().parse_args(
        ["serve", *SMALL, "--device-pages", "16", "--workload", f"trace:{trace}",
         "--duration-s", "60", "--quiet", "--json-summary", str(out)])
    printed = io.StringIO()
    async with asyncio.timeout(DEADLINE_S):
        summary = await serve(options_from(args), stdout=printed)
    assert summary.ok and "verdict: OK" in printed.getvalue()
    data = _summary(out)
    assert data == json.loads(json.dumps(summary.as_dict()))
    assert data["stop_reason"] == "workload played out"
    assert data["workload"] == f"trace:{trace}"
    assert data["turns"] == 24 and data["conversations_finished"] == 8
    assert data["prefetched_pages"] > 0 and data["requests_d2h"] > 0
    _assert_clean(data)


def test_bad_trace_line_exits_2_naming_the_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_s": 0, "conversation": 1, "prompt_tokens": 5, "output_tokens": 1}\n'
                     '\n{"arrival_s": 0, "conversation": 1, "prompt_tokens": "5"}\n')
    assert main(["serve", "--workload", f"trace:{trace}", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{trace} line 3: missing ['output_tokens']" in err


@pytest.mark.parametrize("args", [
    ["--duration-s", "-1"], ["--duration-s", "soon"], ["--duration-s", "0"],
    ["--layers", "0"], ["--layers", "x"], ["--device-pages", "4"], ["--device-pages", "-8"],
    ["--metrics-port", "-1"], ["--metrics-port", "70000"], ["--host-pool-gb", "-2"],
    ["--host-pool-gb", "lots"], ["--seed", "-3"], ["--workload", "random"],
    ["--backend", "tpu"], ["--arrival-rate", "0"],
])
def test_bad_arguments_exit_2(args, capsys):
    assert main(["serve", *args]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["summary-is-a-directory", "buffers-larger-than-memory"])
def test_arguments_that_cannot_work_exit_2_before_any_work(case, tmp_path, capsys):
    """Checked before anything is allocated or run: a JSON summary path that is a directory,
    and device buffers (host memory on the CPU backend) larger than the memory available."""
    args = {"summary-is-a-directory": ["--json-summary", str(tmp_path), "--layers", "2",
                                       "--device-pages", "8"],
            "buffers-larger-than-memory": ["--layers", "1000000"]}[case]
    assert main(["serve", "--backend", "cpu", "--duration-s", "1", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert {"summary-is-a-directory": "is a directory",
            "buffers-larger-than-memory": "GB of device buffers"}[case] in err


async def test_an_arrival_rate_beyond_what_the_loop_keeps_up_with_still_stops_on_time(
        tmp_path, monkeypatch):
    """Conversations arrive faster than the loop can start them (every arrival is already
    due): the driver still gives the loop a turn between arrivals, so conversations run,
    the surplus is turned away and the run stops at its duration."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    args = build_parser().parse_args(
        ["serve", *SMALL, "--device-pages", "16", "--arrival-rate", "1e300",
         "--duration-s", "1", "--quiet"])
    async with asyncio.timeout(DEADLINE_S):
        summary = await serve(options_from(args), stdout=io.StringIO())
    data = summary.as_dict()
    assert data["stop_reason"] != "workload played out", data["stop_reason"]
    assert data["conversations_rejected"] > 0 and data["turns"] > 0, data
    _assert_clean(data)


async def test_a_forward_pass_that_cannot_allocate_its_compute_fails_the_run_on_time(
        tmp_path, monkeypatch):
    """--compute-dim too large to allocate (4 TB of weights): the forward-pass thread
    reports the failure with every step instead of dying, so the run stops at its duration
    and counts the failed steps, instead of waiting for ever on a dead thread."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    args = build_parser().parse_args(
        ["serve", "--layers", "2", "--compute-dim", "1000000", "--device-pages", "16",
         "--duration-s", "1", "--quiet"])
    async with asyncio.timeout(DEADLINE_S):
        summary = await serve(options_from(args), stdout=io.StringIO())
    assert summary.errors > 0 and summary.turns == 0
