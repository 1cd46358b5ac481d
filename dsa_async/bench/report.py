"""The bench's outputs: a table for people (stdout) and one JSON object for machines.

JSON schema::

    {"results": {figure: number, ...},
     "targets": {figure: {"comparison": ">=" | "<=", "target": number | null, "unit": str,
                          "better": "higher" | "lower" | null (null: reported, no target),
                          "met": bool | null, "definition": str}, ...},
     "machine": {"cpu_count", "usable_cpus", "torch_version", "threads", "backend",
                 "device_name", "python", "platform", "llc_bytes", "load_average_1m_start",
                 "load_average_1m_end", "pairs", "figure_bytes", "elapsed_s"},
     "verified": [case whose moved bytes were compared with their source, ...],
     "errors": {scenario: message}            (only when a scenario failed)
     "throughput": {"batch_pages": [...], "engine_gbps": [...], ...}   (only with --plot)}
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .registry import Target
from .runner import BenchRun

MET, MISSED, INFO, NOT_MEASURED = "met", "missed", "reported", "not measured"


def status(target: Target | None, value: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    verdict = target.met(value) if target is not None else None
    if verdict is None:
        return INFO
    return MET if verdict else MISSED


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.1f} ms"
    if unit in ("", "x"):
        return f"{value:.3f}"
    return f"{value:.1f} {unit}"


def _target_text(target: Target | None) -> str:
    if target is None or target.target is None:
        return "-"
    return f"{target.comparison.value} {target.target:g}"


def _better(target: Target | None) -> str:
    if target is None or target.target is None:
        return ""
    return f"{target.better} is better"


def figure_names(run: BenchRun, targets: Mapping[str, Target]) -> list[str]:
    """Every figure with a target, in registration order, then any extra measured ones."""
    return list(targets) + [name for name in run.results if name not in targets]


def load_warning(machine: Mapping[str, Any]) -> str | None:
    """A note when other work shared the CPUs: ratios then drift low (or high) by tens of %."""
    cpus = machine.get("usable_cpus") or 1
    loads = [machine.get(k) for k in ("load_average_1m_start", "load_average_1m_end")]
    known = [x for x in loads if isinstance(x, (int, float))]
    if not known or known[0] < 0.5 * cpus and max(known) <= 1.5 * cpus:
        return None
    return (f"note: 1-minute load average {' -> '.join(f'{x:g}' for x in known)} on {cpus} CPUs: "
            f"other processes shared the machine, so these ratios are noisier than usual; "
            f"rerun on an idle machine before trusting a miss")


def format_table(run: BenchRun, targets: Mapping[str, Target]) -> str:
    rows = [("figure", "value", "target", "status", "")]
    for name in figure_names(run, targets):
        target = targets.get(name)
        value = run.results.get(name)
        rows.append((name, _number(value, target.unit if target else ""), _target_text(target),
                     status(target, value), _better(target)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1]), row[2].ljust(widths[2]),
                 row[3].ljust(widths[3]), row[4]]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths[:4]))
    m = run.machine
    lines += [
        "",
        (f"ratios: median of {m.get('pairs')} interleaved pairs unless the definition says "
         f"otherwise, >= {m.get('figure_bytes', 0):,} B per copy figure; backend "
         f"{m.get('backend')} "
         f"({m.get('device_name')}), {m.get('threads')} torch threads, {m.get('usable_cpus')} "
         f"CPUs, torch {m.get('torch_version')}; {run.elapsed_s:.1f} s"),
    ]
    if (warning := load_warning(m)) is not None:
        lines.append(warning)
    for scenario, message in run.errors.items():
        lines.append(f"FAILED {scenario}: {message}")
    if run.verified:
        lines.append("bytes checked after measuring: " + "; ".join(run.verified))
    lines.append("")
    lines.append("definitions:")
    for name in figure_names(run, targets):
        if name in targets:
            lines.append(f"  {name}: {targets[name].definition}")
    return "\n".join(lines)


def _json_number(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def to_json(run: BenchRun, targets: Mapping[str, Target]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "results": {k: _json_number(v) for k, v in run.results.items()},
        "targets": {
            name: {
                "comparison": t.comparison.value,
                "target": t.target,
                "unit": t.unit,
                "better": None if t.target is None else t.better,
                "met": t.met(run.results[name]) if name in run.results else None,
                "definition": t.definition,
            }
            for name, t in targets.items()
        },
        "machine": {**run.machine, "elapsed_s": round(run.elapsed_s, 3)},
    }
    out["verified"] = list(run.verified)  # cases whose moved bytes were compared
    if run.errors:
        out["errors"] = dict(run.errors)
    if run.series:
        out["throughput"] = {k: list(v) for k, v in run.series.items()}
    return out


def json_text(run: BenchRun, targets: Mapping[str, Target]) -> str:
    """The run as ``--json`` writes it (strict JSON: no NaN or infinity)."""
    return json.dumps(to_json(run, targets), indent=2, allow_nan=False) + "\n"
