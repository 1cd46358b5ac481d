"""The README's promises: the embedding example runs as written, and CI runs the README's
test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_embedding_example_runs_as_written(tmp_path):
    block = next(b for b in _python_blocks() if "OffloadService" in b)
    code = block.replace("/tmp/dsa-async-example-ledger", str(tmp_path / "ledger"))
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "loaded 3 pages, 101,376 B" in done.stdout


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = next(b.strip() for b in bash_blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()


def test_the_bench_table_has_a_row_for_every_figure_the_bench_reports():
    from dsa_async.bench import TARGETS

    section = README.split("## Benchmarks: `dsa-async bench`", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([a-z0-9_.]+)`", section, flags=re.M))
    assert rows == set(TARGETS), (set(TARGETS) - rows, rows - set(TARGETS))
