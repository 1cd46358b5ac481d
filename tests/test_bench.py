"""The bench: pair-ratio arithmetic, report schema, real scenarios at a tiny size, CLI refusals."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_async.bench import TARGETS, copy_scenarios, pool_scenarios
from dsa_async.bench import runner as bench_runner
from dsa_async.bench.copy_rig import CopyVerificationError, pages_for_bytes
from dsa_async.bench.device import BenchDevice
from dsa_async.bench.measure import (
    MIN_PAIRS,
    PairTimings,
    interleaved_pairs,
    median_pair_ratio,
)
from dsa_async.bench.registry import (
    SCENARIOS,
    BenchContext,
    Comparison,
    Target,
    register_scenario,
)
from dsa_async.bench.report import format_table, to_json
from dsa_async.bench.runner import BenchConfig, BenchRun, run_bench
from dsa_async.cli import bench as cli_bench
from dsa_async.cli import main
from dsa_async.cli.bench import QUICK_PAIRS
from dsa_async.geometry import dsa_indexer
from dsa_async.kinds import Backend, Direction
from dsa_async.transfer.batch import BatchHandle, CopyBatch
from dsa_async.transfer.cpu import CpuEngine

#: 4 layers of 8,448 B pages: a figure of 1 MiB is 32 pages, fast enough for unit tests.
TINY_GEOMETRY = dsa_indexer(num_layers=4)
TINY_BYTES = 1 << 20
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


# --- interleaved pairs ----------------------------------------------------------------------


def test_median_pair_ratio_is_the_median_of_per_pair_ratios():
    assert median_pair_ratio([1.0, 1.0, 2.0], [2.0, 4.0, 2.0]) == 0.5
    # One wild pair (a stall during the subject) does not move the median.
    assert median_pair_ratio([1.0] * 5, [0.5, 0.5, 0.5, 0.5, 50.0]) == 2.0


def test_speedup_and_cost_are_reciprocal_views_of_the_same_pairs():
    t = PairTimings((2.0, 4.0, 6.0), (1.0, 2.0, 2.0))
    assert t.speedup() == 2.0
    assert t.cost() == 0.5
    assert t.median_reference_s() == 4.0 and t.median_subject_s() == 2.0


def test_pair_timings_refuse_unequal_or_nonpositive_times():
    with pytest.raises(ValueError):
        PairTimings((1.0, 1.0), (1.0,))
    with pytest.raises(ValueError):
        PairTimings((1.0,), (0.0,))


class FakeClock:
    """Advances only when a timed callable 'runs' (it adds its duration)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaved_pairs_alternate_after_one_warmup_and_recover_a_known_ratio():
    clock = FakeClock()
    calls: list[str] = []

    def reference() -> None:
        calls.append("ref")
        clock.now += 3.0

    def subject() -> None:
        calls.append("sub")
        clock.now += 1.5 if len(calls) % 4 else 1.0  # alternating 1.5 / 1.0 s subject runs

    timings = interleaved_pairs(reference, subject, 5, clock=clock)
    assert calls == ["ref", "sub"] * 6  # warm-up pair, then 5 measured pairs
    assert timings.num_pairs == 5
    assert timings.reference_s == (3.0,) * 5
    assert sorted(set(timings.subject_s)) == [1.0, 1.5]
    assert timings.speedup() == median_pair_ratio(timings.reference_s, timings.subject_s)
    assert timings.speedup() in (2.0, 3.0)


def test_interleaved_pairs_need_at_least_the_minimum_pairs():
    with pytest.raises(ValueError, match="at least"):
        interleaved_pairs(lambda: None, lambda: None, MIN_PAIRS - 1)


def test_what_a_timed_call_returns_is_freed_after_the_clock_stops():
    clock = FakeClock()

    class Held:
        def __del__(self) -> None:
            clock.now += 100.0  # freeing inside the timed region would show up here

    def make() -> Held:
        clock.now += 1.0
        return Held()

    timings = interleaved_pairs(make, make, MIN_PAIRS, clock=clock)
    assert timings.reference_s == (1.0,) * MIN_PAIRS == timings.subject_s


# --- registry and report --------------------------------------------------------------------


def test_every_copy_and_pool_figure_has_a_target_with_its_direction():
    expected = {
        "copy.extents.ratio_to_contiguous": (Comparison.AT_LEAST, 0.7),
        "copy.random.ratio_to_contiguous": (Comparison.AT_LEAST, 0.35),
        "copy.extents3d.ratio_to_contiguous": (Comparison.AT_LEAST, 0.85),
        "copy.random3d.ratio_to_contiguous": (Comparison.AT_LEAST, 0.5),
        "copy.random.speedup_vs_token_baseline": (Comparison.AT_LEAST, 1.5),
        "pool.startup_ratio_to_first_touch": (Comparison.AT_MOST, 1.3),
    }
    for name, (comparison, target) in expected.items():
        assert (TARGETS[name].comparison, TARGETS[name].target) == (comparison, target)
    assert TARGETS["pool.startup_ratio_to_first_touch"].met(1.3)
    assert not TARGETS["pool.startup_ratio_to_first_touch"].met(1.31)
    assert TARGETS["copy.random.ratio_to_contiguous"].met(0.35)
    assert TARGETS["pool.startup_s"].met(123.0) is None  # reported, not judged


def test_registering_a_scenario_twice_keeps_one_entry(monkeypatch):
    monkeypatch.setattr("dsa_async.bench.registry.SCENARIOS", list(SCENARIOS))
    from dsa_async.bench import registry

    def extra(ctx):
        return {}

    register_scenario(extra)
    register_scenario(extra)
    assert registry.SCENARIOS.count(extra) == 1
    assert copy_scenarios.copy_extents in registry.SCENARIOS
    assert pool_scenarios.pool_startup in registry.SCENARIOS


def _run(results: dict[str, float], errors: dict[str, str] | None = None) -> BenchRun:
    machine = {"cpu_count": 2, "usable_cpus": 2, "torch_version": "x", "threads": 2,
               "backend": "cpu", "device_name": "test cpu", "pairs": 5, "figure_bytes": 1}
    return BenchRun(results, errors or {}, machine, [], {}, 1.5)


def test_json_report_has_results_targets_and_machine():
    targets = dict(TARGETS)
    targets["scheduler.test_us"] = Target("scheduler.test_us", Comparison.AT_MOST, 20.0, "us",
                                          "a figure another module adds")
    run = _run({"copy.extents.ratio_to_contiguous": 0.9, "pool.startup_ratio_to_first_touch": 1.5,
                "pool.startup_s": 0.05, "scheduler.test_us": 7.0})
    data = json.loads(json.dumps(to_json(run, targets), allow_nan=False))
    assert set(data) == {"results", "targets", "machine", "verified"}
    assert data["verified"] == list(run.verified)
    assert data["results"]["copy.extents.ratio_to_contiguous"] == 0.9
    for key in ("cpu_count", "torch_version", "threads", "backend", "device_name"):
        assert key in data["machine"]
    extents = data["targets"]["copy.extents.ratio_to_contiguous"]
    assert (extents["comparison"], extents["target"], extents["met"], extents["better"]) == (
        ">=", 0.7, True, "higher")
    startup = data["targets"]["pool.startup_ratio_to_first_touch"]
    assert (startup["comparison"], startup["met"], startup["better"]) == ("<=", False, "lower")
    assert data["targets"]["scheduler.test_us"]["met"] is True
    assert data["targets"]["copy.random.ratio_to_contiguous"]["met"] is None  # not measured
    assert data["targets"]["pool.startup_s"]["target"] is None


def test_table_shows_each_figure_beside_its_target_and_verdict():
    run = _run({"copy.extents.ratio_to_contiguous": 0.9, "copy.random.ratio_to_contiguous": 0.2,
                "pool.startup_ratio_to_first_touch": 1.1}, {"copy_random3d": "boom"})
    lines = format_table(run, TARGETS).splitlines()
    row = {line.split()[0]: line for line in lines if line.startswith(("copy.", "pool."))}
    assert "0.900" in row["copy.extents.ratio_to_contiguous"]
    assert ">= 0.7" in row["copy.extents.ratio_to_contiguous"]
    assert " met " in row["copy.extents.ratio_to_contiguous"]
    assert "missed" in row["copy.random.ratio_to_contiguous"]
    assert "lower is better" in row["pool.startup_ratio_to_first_touch"]
    assert "not measured" in row["copy.random3d.ratio_to_contiguous"]
    assert any(line.startswith("FAILED copy_random3d: boom") for line in lines)


# --- real scenarios at a tiny size ------------------------------------------------------------


def _config(**kwargs) -> BenchConfig:
    return BenchConfig(backend=Backend.CPU, pairs=MIN_PAIRS, figure_bytes=TINY_BYTES,
                       geometry=TINY_GEOMETRY, **kwargs)


@pytest.mark.parametrize("scenario", [copy_scenarios.copy_extents, copy_scenarios.copy_random,
                                      copy_scenarios.copy_random3d, pool_scenarios.pool_startup])
async def test_tiny_real_scenario_reports_positive_figures_and_verifies_bytes(scenario):
    run = await run_bench(_config(), [scenario], progress=lambda line: None)
    assert run.errors == {}
    assert run.results
    for name, value in run.results.items():
        assert isinstance(value, float) and value > 0, name
    copy_figures = [n for n in run.results if n.startswith("copy.")]
    for name in copy_figures:
        assert any(label.startswith(name) for label in run.verified), name
    assert run.machine["backend"] == "cpu" and run.machine["pairs"] == MIN_PAIRS


class PageShiftingEngine(CpuEngine):
    """Copies the neighbour of every device page: fast, and wrong."""

    def submit(self, batch: CopyBatch):
        shifted = (batch.device_pages + 1) % self.bindings["indexer"].device_pages
        return super().submit(CopyBatch(batch.direction, batch.host_pages, shifted, batch.deps))


async def test_a_copy_that_moves_the_wrong_bytes_is_never_reported():
    ctx = BenchContext(device=BenchDevice(Backend.CPU), engine_class=PageShiftingEngine,
                       loop=asyncio.get_running_loop(), geometry=TINY_GEOMETRY, pairs=MIN_PAIRS,
                       figure_bytes=TINY_BYTES)
    with pytest.raises(CopyVerificationError, match="differ"):
        await asyncio.to_thread(copy_scenarios.copy_extents, ctx)
    assert ctx.verified == []


class SkipsDependentLoads(CpuEngine):
    """Reports a load that waits for a backup as done without copying: half the round trip."""

    def submit(self, batch: CopyBatch):
        if batch.direction is Direction.H2D and batch.deps:
            handle = BatchHandle(batch, self.num_layers)
            self._report(handle, handle.finish(None, 0.0))
            return handle
        return super().submit(batch)


@pytest.mark.parametrize("scenario", [copy_scenarios.copy_extents, copy_scenarios.copy_random3d,
                                      copy_scenarios.copy_random3d_over_random])
async def test_a_round_trip_that_skips_its_load_is_never_reported(scenario):
    """The check runs the call the figures time (a load after its backup), on every page."""
    ctx = BenchContext(device=BenchDevice(Backend.CPU), engine_class=SkipsDependentLoads,
                       loop=asyncio.get_running_loop(), geometry=TINY_GEOMETRY, pairs=MIN_PAIRS,
                       figure_bytes=TINY_BYTES)
    with pytest.raises(CopyVerificationError, match="H2D"):
        await asyncio.to_thread(scenario, ctx)
    assert ctx.verified == []


async def test_a_failing_scenario_is_recorded_and_the_others_still_run():
    def broken(ctx):
        raise CopyVerificationError("host pages [0] differ")

    run = await run_bench(_config(), [broken, pool_scenarios.pool_startup],
                          progress=lambda line: None)
    assert "broken" in run.errors and "differ" in run.errors["broken"]
    assert run.results["pool.startup_ratio_to_first_touch"] > 0


def test_a_figure_is_at_least_the_requested_bytes_in_whole_runs_of_16_pages():
    g = dsa_indexer()
    pages = pages_for_bytes(g, 128 << 20)
    assert pages == 272 and pages * g.bytes_per_page >= 128 << 20
    assert bench_runner.MIN_FIGURE_BYTES == 128 << 20
    assert cli_bench._figure_bytes(quick=True) == 128 << 20
    assert cli_bench._figure_bytes(quick=False) >= 128 << 20


# --- command line ------------------------------------------------------------------------------


@pytest.fixture
def tiny_cli(monkeypatch):
    """The CLI with every scenario shrunk to the tiny geometry (the 128 MiB rule is the CLI's)."""
    monkeypatch.setattr(bench_runner, "BenchConfig",
                        functools.partial(BenchConfig, geometry=TINY_GEOMETRY))
    monkeypatch.setattr(cli_bench, "_figure_bytes", lambda quick: TINY_BYTES)


def test_cli_prints_the_table_and_writes_json(tiny_cli, tmp_path, capsys):
    out_path = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--backend", "cpu", "--json", str(out_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out_path.read_text())
    assert set(data) >= {"results", "targets", "machine"}
    assert data["machine"]["backend"] == "cpu"
    assert data["machine"]["pairs"] == QUICK_PAIRS >= MIN_PAIRS
    assert data["machine"]["figure_bytes"] == TINY_BYTES
    for name in TARGETS:
        assert name in out
        assert name in data["results"]
    assert "bench: [1/" in err  # progress goes to stderr


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed: the PNG test covers --plot")
def test_plot_without_matplotlib_exits_2_with_the_install_hint(tmp_path, capsys):
    code = main(["bench", "--quick", "--plot", str(tmp_path / "t.png")])
    _, err = capsys.readouterr()
    assert code == 2
    assert "matplotlib" in err and "pip install" in err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_writes_a_png_of_throughput_by_batch_size(tiny_cli, tmp_path, capsys):
    png = tmp_path / "t.png"
    code = main(["bench", "--quick", "--backend", "cpu", "--plot", str(png),
                 "--json", str(tmp_path / "b.json")])
    assert code == 0, capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = json.loads((tmp_path / "b.json").read_text())["throughput"]
    assert series["batch_pages"] and all(v > 0 for v in series["engine_gbps"])


def test_cuda_backend_without_a_device_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code = main(["bench", "--backend", "cuda"])
    assert code == 2
    assert "--backend cuda" in capsys.readouterr().err


def test_json_into_a_missing_directory_exits_2_before_measuring(tmp_path, capsys):
    code = main(["bench", "--json", str(tmp_path / "nope" / "b.json")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["a-directory", "under-a-file", "in-proc"])
def test_an_output_that_cannot_be_written_exits_2_before_measuring(tmp_path, capsys, flag, where):
    (tmp_path / "a-file").write_text("x")
    path = {"a-directory": tmp_path, "under-a-file": tmp_path / "a-file" / "out",
            "in-proc": Path("/proc/dsa-async-bench-out")}[where]
    started = time.monotonic()
    assert main(["bench", "--backend", "cpu", flag, str(path)]) == 2
    assert f"{flag} {str(path)!r}" in capsys.readouterr().err
    assert time.monotonic() - started < 30  # nothing measured
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_token_baseline_moves_132_byte_rows_as_int32():
    from dsa_async.bench.baselines import _token_rows

    layer = torch.zeros((3, 8448), dtype=torch.uint8)
    rows = _token_rows(layer, 132)
    assert rows.dtype == torch.int32 and tuple(rows.shape) == (3 * 64, 33)
    assert np.shares_memory(rows.numpy(), layer.numpy())


def test_table_warns_when_other_processes_shared_the_cpus():
    from dsa_async.bench.report import load_warning

    quiet = {"usable_cpus": 2, "load_average_1m_start": 0.1, "load_average_1m_end": 2.0}
    busy = {"usable_cpus": 2, "load_average_1m_start": 3.5, "load_average_1m_end": 4.0}
    assert load_warning(quiet) is None  # the bench's own threads at the end are expected
    assert "3.5 -> 4" in load_warning(busy)
    run = _run({})
    run.machine.update(busy)
    lines = format_table(run, TARGETS).splitlines()
    assert any(line.startswith("note: 1-minute load") for line in lines)


async def test_front_door_at_scale_reports_its_figures_and_fragments_as_defined():
    from dsa_async.bench import scale_scenarios

    run = await run_bench(_config(), [scale_scenarios.scheduler_at_scale],
                          progress=lambda line: None)
    assert run.errors == {}  # the scenario raises when fragmenting leaves other holes
    names = {"scheduler.scattered_us_per_page", "scheduler.fragmented_us_per_request",
             "scheduler.fragmented_overhead_ratio", "scheduler.one_page_holes_overhead_ratio"}
    assert set(run.results) == names
    for tokens in scale_scenarios._one_page_requests(200, seed=1):  # one page each, any offset
        assert len(tokens) >= 1 and int(tokens[0]) // 64 == int(tokens[-1]) // 64
    for name in names:
        assert run.results[name] > 0 and TARGETS[name].target is not None
    # The command line never runs below the minimum figure size, so it always measures at the
    # sizes the figures are defined at.
    assert bench_runner.MIN_FIGURE_BYTES > TINY_BYTES
    assert scale_scenarios.SIZES == scale_scenarios.ScaleSizes(
        scattered_host_pages=32_768, scattered_device_pages=4_096,
        scattered_request_pages=1_024, scattered_requests_per_round=20,
        fragmented_pool_pages=262_144, fragmented_run_pages=4)


def test_the_overlap_pass_spreads_its_matmuls_evenly_over_the_layers():
    from dsa_async.bench.overlap_scenario import spread

    for total, parts in [(0, 3), (1, 61), (60, 61), (61, 61), (100, 61), (1_000, 7)]:
        counts = spread(total, parts)
        assert len(counts) == parts and sum(counts) == total
        assert max(counts) - min(counts) <= 1


async def test_overlap_reports_the_waits_and_the_pass_it_measured():
    from dsa_async.bench import overlap_scenario

    run = await run_bench(_config(), [overlap_scenario.overlap], progress=lambda line: None)
    assert run.errors == {}
    assert set(run.results) == {"overlap.exposed_fraction", "overlap.forward_pass_over_copy"}
    # (at this tiny size one matmul may outlast the copy: the aim is only met at full size)
    assert run.results["overlap.exposed_fraction"] >= 0
    assert run.results["overlap.forward_pass_over_copy"] > 0
