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
import torch

from dsa_async.cli import build_parser, main
from dsa_async.cli.serve import options_from
from dsa_async.errors import ConfigError
from dsa_async.host_memory.ledger import LEDGER_ENV
from dsa_async.kinds import Backend
from dsa_async.workload.consumer import MAX_COMPUTE_DIM
from dsa_async.workload.pagedata import MAX_SEED
from dsa_async.workload.runner import STARTED, ServeOptions, _check_device_buffers_fit, serve
from dsa_async.workload.output_files import check_writable_file

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
         "--duration-s", "60", "--quiet", "--json-summary", str(out), "--seed", str(MAX_SEED)])
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


async def test_a_run_in_which_no_forward_step_ran_fails_its_verdict(tmp_path, monkeypatch):
    """A run that verified nothing (its only turn arrives after the run ends) must not read
    OK: the verdict says every step ran and every page verified."""
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    trace = tmp_path / "late.jsonl"
    trace.write_text(json.dumps({"arrival_s": 3600, "conversation": "c", "prompt_tokens": 60,
                                 "output_tokens": 20}) + "\n")
    args = build_parser().parse_args(
        ["serve", *SMALL, "--device-pages", "16", "--workload", f"trace:{trace}",
         "--duration-s", "0.5", "--quiet"])
    printed = io.StringIO()
    async with asyncio.timeout(DEADLINE_S):
        summary = await serve(options_from(args), stdout=printed)
    assert summary.forward_steps == 0 and not summary.ok
    assert "verdict: FAILED: no forward step ran, so nothing was verified" in printed.getvalue()


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


def test_a_host_pool_past_the_budget_exits_3_as_plan_does(capsys):
    """The pool asked for cannot fit: the same exit code and refusal as ``plan``'s "does not
    fit", not the runtime-failure code, and nothing runs."""
    assert main(["serve", "--backend", "cpu", "--duration-s", "5", "--quiet",
                 "--layers", "2", "--host-pool-gb", "1e9"]) == 3
    out, err = capsys.readouterr()
    for fragment in ("requested:", "largest that fits", "to fix:", "--host-pool-gb"):
        assert fragment in err
    assert "verdict" not in out


@pytest.mark.parametrize("case", ["summary-is-a-directory", "buffers-larger-than-memory",
                                  "buffers-beyond-any-memory"])
def test_arguments_that_cannot_work_exit_2_before_any_work(case, tmp_path, capsys):
    """Checked before anything is allocated or run: a JSON summary path that is a directory,
    and device buffers (host memory on the CPU backend) larger than the memory available."""
    args = {"summary-is-a-directory": ["--json-summary", str(tmp_path), "--layers", "2",
                                       "--device-pages", "8"],
            "buffers-larger-than-memory": ["--layers", "1000000"],
            "buffers-beyond-any-memory": ["--layers", str(2**63 - 1),
                                          "--device-pages", str(2**63 - 1)]}[case]
    assert main(["serve", "--backend", "cpu", "--duration-s", "1", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert {"summary-is-a-directory": "is a directory",
            "buffers-larger-than-memory": "TB of device buffers",
            "buffers-beyond-any-memory": "of device buffers"}[case] in err


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
    assert summary.failed_steps == summary.forward_steps > 0 and not summary.ok


def test_failed_forward_steps_fail_the_verdict_and_the_exit_code(tmp_path, env):
    """A run whose forward steps all failed (a [D, D] matrix whose byte size overflows, so the
    setup fails at once on any machine) moved nothing and verified nothing: its verdict is
    FAILED naming the failed steps and their error, in the text and in the JSON, exit 1."""
    path = tmp_path / "summary.json"
    run = Serve(env, "--backend", "cpu", "--layers", "2", "--device-pages", "16",
                "--compute-dim", "3000000000", "--duration-s", "1", "--quiet",
                "--json-summary", str(path))
    code, stdout, stderr = run.finish()
    assert code == 1, stderr
    data = _summary(path)
    assert data["ok"] is False and data["failed_steps"] == data["forward_steps"] > 0
    (failure,) = data["failures"]
    assert failure.startswith(f"{data['failed_steps']:,} of {data['forward_steps']:,} forward "
                              f"steps failed (first: RuntimeError: the forward pass could not "
                              f"set up its compute (--compute-dim 3000000000)")
    assert stdout.splitlines()[-1] == f"  verdict: FAILED: {failure}"


# Integers too large for what the run does with them: torch takes 64-bit seeds, a [D, D]
# matrix needs D * D to fit 64 bits, every count is an int64 size; int() refuses 4,301+ digits.
TOO_LARGE = [("--seed", v) for v in (str(MAX_SEED + 1), str(2**64 + 12345), str(10**30))] + [
    ("--compute-dim", v) for v in (str(MAX_COMPUTE_DIM + 1), str(10**20))] + [
    ("--metrics-port", "65536")] + [
    (option, str(2**63)) for option in ("--compute-dim", "--layers", "--device-pages")] + [
    (option, v) for option in ("--seed", "--compute-dim", "--layers", "--device-pages",
                               "--metrics-port")
    for v in ("1" + "0" * 400, "9" * 5000)]


@pytest.mark.parametrize(("option", "value"), TOO_LARGE,
                         ids=[f"{o}={v[:12]}({len(v)})" for o, v in TOO_LARGE])
def test_integer_options_too_large_to_use_exit_2_naming_the_range(option, value, capsys):
    """Refused by the argument parser, before anything runs, like any other bad argument."""
    rest = ["--backend", "cpu", "--duration-s", "1", "--quiet"]
    if option not in ("--layers", "--device-pages"):
        rest += ["--layers", "2", "--device-pages", "8"]
    assert main(["serve", *rest, option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {option}: " in err and "is out of range: use " in err, err
    assert len(err) < 300  # a 5,000-digit value is shortened


def test_cuda_device_buffers_larger_than_free_device_memory_are_refused(monkeypatch):
    """On CUDA the device buffers are device memory: checked against what the device has
    free before anything is allocated, so a size no device holds is a ConfigError."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (8 * 10**9, 16 * 10**9))
    _check_device_buffers_fit(ServeOptions(), Backend.CUDA)  # 246 MB fits in 8 GB
    for options in (ServeOptions(num_layers=10**6), ServeOptions(num_layers=2**63 - 1,
                                                                 device_pages=2**63 - 1)):
        with pytest.raises(ConfigError, match=r"of device buffers, and the CUDA device has "
                                              r"8\.00 GB available"):
            _check_device_buffers_fit(options, Backend.CUDA)


def test_the_largest_usable_integers_are_accepted():
    args = build_parser().parse_args(
        ["serve", "--seed", str(MAX_SEED), "--compute-dim", str(MAX_COMPUTE_DIM),
         "--layers", str(2**63 - 1), "--device-pages", str(2**63 - 1), "--metrics-port", "65535"])
    assert (args.seed, args.compute_dim, args.layers) == (MAX_SEED, MAX_COMPUTE_DIM, 2**63 - 1)
    options_from(args)  # ServeOptions takes them too


@pytest.mark.parametrize(("field", "bad"), [
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 10**400), ("seed", True), ("seed", 1.0),
    ("seed", "1"), ("compute_dim", 0), ("compute_dim", MAX_COMPUTE_DIM + 1),
    ("compute_dim", 2.0), ("quiet", "no"), ("quiet", 1), ("quiet", None),
], ids=repr)
def test_serve_options_refuse_values_the_run_cannot_use(field, bad):
    with pytest.raises(ConfigError, match=f"ServeOptions.{field} must be"):
        ServeOptions(**{field: bad})


def _unwritable_summary(case: str, tmp_path: Path) -> Path:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {"missing-directory": tmp_path / "absent" / "s.json",
            "a-directory": tmp_path,
            "under-a-file": a_file / "s.json",
            "in-proc": Path("/proc/dsa-async-summary.json"),
            "in-sys": Path("/sys/dsa-async-summary.json")}[case]


@pytest.mark.parametrize("case", ["missing-directory", "a-directory", "under-a-file", "in-proc",
                                  "in-sys"])
def test_a_summary_path_that_cannot_be_written_exits_2_before_the_run(
        case, tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "ledger"))
    path = _unwritable_summary(case, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    caplog.set_level("INFO")
    assert main(["serve", "--backend", "cpu", "--duration-s", "1", "--quiet", "--layers", "2",
                 "--device-pages", "8", "--json-summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--json-summary {str(path)!r}" in err, err
    assert STARTED not in caplog.text  # refused before the run, not after it
    assert sorted(tmp_path.rglob("*")) == before


def test_the_summary_path_check_leaves_nothing_behind(tmp_path):
    fresh = tmp_path / "fresh.json"
    check_writable_file(fresh, "--json-summary")
    assert not fresh.exists()
    kept = tmp_path / "kept.json"
    kept.write_text("keep me")
    check_writable_file(kept, "--json-summary")
    assert kept.read_text() == "keep me"
    check_writable_file("/dev/null", "--json-summary")  # a device: written as given
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]


def test_a_summary_path_through_a_link_is_checked_where_it_will_be_written(tmp_path):
    """A symlink to a file not written yet is a path the run can write (it creates the
    target): accepted, leaving the link dangling as it was; a link into a missing directory is
    refused, as that directory would be."""
    (tmp_path / "out").mkdir()
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "out" / "summary.json")
    check_writable_file(link, "--json-summary")
    assert link.is_symlink() and not link.exists()
    broken = tmp_path / "broken.json"
    broken.symlink_to(tmp_path / "missing" / "summary.json")
    with pytest.raises(ConfigError, match="does not exist"):
        check_writable_file(broken, "--json-summary")
