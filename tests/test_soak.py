"""Soak: ``dsa-async serve`` for ``DSA_ASYNC_SOAK_S`` seconds (default 600), sampled from outside.

Run with ``python -m pytest -q tests/test_soak.py --soak`` (not part of the default run).
Samples RSS minus the host arena (first-touched at start), open files and threads every few
seconds; after a warm-up (the first fifth of the run) each may grow by less than 5 %. The run
must end with zero mismatches and zero leaked pages.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.soak

SOAK_S = float(os.environ.get("DSA_ASYNC_SOAK_S", "600"))
SAMPLE_PERIOD_S = 5.0
GROWTH_LIMIT = 0.05


def _arena_bytes(line: str) -> int:
    match = re.search(r"host pool \d+ pages \(([\d.]+) GB\)", line)
    assert match, f"no host pool size in {line!r}"
    return int(float(match.group(1)) * 1e9)


def test_long_run_holds_memory_files_and_threads_flat(tmp_path):
    summary_path = tmp_path / "soak.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsa_async", "serve", "--duration-s", str(SOAK_S), "--quiet",
         "--json-summary", str(summary_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DSA_ASYNC_LEDGER": str(tmp_path / "ledger")})
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "dsa-async serve: started" not in line:
            assert time.monotonic() < deadline, "serve did not start"
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve exited before starting"
        arena_bytes = _arena_bytes(line)
        process = psutil.Process(proc.pid)
        samples: list[tuple[float, int, int, int]] = []
        started = time.monotonic()
        while proc.poll() is None:
            try:
                with process.oneshot():
                    samples.append((time.monotonic() - started,
                                    process.memory_info().rss - arena_bytes,
                                    process.num_fds(), process.num_threads()))
            except psutil.NoSuchProcess:
                break
            time.sleep(SAMPLE_PERIOD_S)  # the sampling period of an external observer
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads(summary_path.read_text())
    assert summary["mismatches"] == 0 and summary["leaked_pages"] == 0
    assert summary["prefetched_pages"] == summary["verified_pages"] > 0
    running = [s for s in samples if s[0] <= SOAK_S]
    warm = [s for s in running if s[0] >= SOAK_S / 5]
    assert len(warm) >= 3, f"too few samples after warm-up: {samples}"
    for index, name in ((1, "rss_minus_arena_bytes"), (2, "open_files"), (3, "threads")):
        base = warm[0][index]
        peak = max(s[index] for s in warm)
        print(f"soak {name}: after warm-up {base}, peak {peak}, last {warm[-1][index]}")
        assert peak <= base * (1 + GROWTH_LIMIT), f"{name} grew from {base} to {peak}"
    print(f"soak: {SOAK_S:.0f} s, {len(samples)} samples, summary {json.dumps(summary)}")
