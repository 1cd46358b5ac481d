"""``dsa-async bench``: measure every performance figure as a ratio on this machine.

Prints a table (figure, value, target, met/missed) to stdout and progress to stderr. Exits 0
whenever the bench ran, whether or not the targets were met; 1 when a scenario failed (e.g. a
copy moved the wrong bytes, so its speed is not reported); 2 on bad arguments, a backend that
cannot run here, or --plot without matplotlib.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..kinds import Backend, parse_enum
from .exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE


#: Interleaved pairs per figure (odd, so the median is one pair's ratio). More pairs make the
#: median robust to other load on a shared machine; --quick keeps well above the minimum of 5.
QUICK_PAIRS = 15
FULL_PAIRS = 41
QUICK_SWEEP_PAGES = (4, 16, 64, 256)
FULL_SWEEP_PAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand."""
    parser = subparsers.add_parser(
        "bench",
        help="measure the copy and pool figures against their targets on this machine",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_PAIRS} pairs per figure and a short sweep "
                             "(under two minutes)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.AUTO.value,
                        help="auto (default): cuda when a device is available, else cpu")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="also measure throughput by batch size and plot it to a PNG "
                             "(needs matplotlib)")
    parser.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"dsa-async bench: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _figure_bytes(quick: bool) -> int:
    """Bytes per copy figure: 128 MiB, and in a full run at least the last-level cache too
    (large server caches hold 128 MiB, which flatters the contiguous reference)."""
    from ..bench.device import last_level_cache_bytes
    from ..bench.runner import MIN_FIGURE_BYTES

    if quick:
        return MIN_FIGURE_BYTES
    return max(MIN_FIGURE_BYTES, last_level_cache_bytes() or 0)


def run(args: argparse.Namespace) -> int:
    from ..bench import TARGETS
    from ..bench.device import EngineUnavailable, load_engine_class, resolve_device
    from ..bench.plot import PlotUnavailable, plot_throughput, require_pyplot
    from ..bench.report import format_table, json_text
    from ..bench.runner import BenchConfig, run_bench_blocking
    from ..errors import ConfigError
    from ..workload.output_files import (
        check_distinct_files,
        check_writable_file,
        write_text_file,
    )

    try:  # refused now, not after minutes of measuring
        for path, flag in ((args.json, "--json"), (args.plot, "--plot")):
            if path is not None:
                check_writable_file(path, flag)
        if args.plot is not None and args.plot.suffix.lower() != ".png":
            raise ConfigError(f"--plot {str(args.plot)!r}: the plot is a PNG image; give a "
                              f"path ending in .png (e.g. {str(args.plot.with_suffix('.png'))!r})")
        check_distinct_files({"--json": args.json, "--plot": args.plot})
    except ConfigError as exc:
        return _usage_error(str(exc))
    try:
        if args.plot is not None:
            require_pyplot()
        backend = parse_enum(Backend, args.backend, "--backend")
        device = resolve_device(backend)
        load_engine_class(device.backend)
    except (PlotUnavailable, EngineUnavailable) as exc:
        return _usage_error(str(exc))

    sweep = () if args.plot is None else (QUICK_SWEEP_PAGES if args.quick else FULL_SWEEP_PAGES)
    config = BenchConfig(backend=device.backend, pairs=QUICK_PAIRS if args.quick else FULL_PAIRS,
                         figure_bytes=_figure_bytes(args.quick), sweep_batch_pages=sweep)
    started = time.perf_counter()
    try:
        bench = run_bench_blocking(config)
    except KeyboardInterrupt:
        print("bench: interrupted; no figures reported, nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_table(bench, TARGETS))
    if args.json is not None:
        write_text_file(args.json, "--json", json_text(bench, TARGETS))
        print(f"bench: wrote {args.json}", file=sys.stderr)
    if args.plot is not None and bench.series:
        m = bench.machine
        plot_throughput(bench.series, args.plot,
                        f"dsa-async bench: DSA indexer pages, {m['backend']} ({m['device_name']}), "
                        f"{m['threads']} threads")
        print(f"bench: wrote {args.plot}", file=sys.stderr)
    print(f"bench: finished in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return EXIT_FAILED if bench.errors else EXIT_OK
