"""``dsa-async serve``: run the offload service under a serving-like workload, verify every page.

Conversations with shared system prompts arrive over time (``--workload multiturn``, seeded)
or are replayed from a JSON-lines trace (``--workload trace:PATH``); their pages move between
the device cache and the host pool through the service, and every prefetched page is checked
against the checksum recorded when it was written. SIGINT/SIGTERM or ``--duration-s`` drain the
service and print a summary. Exit 0 when every forward step ran, no page mismatched and
nothing leaked, 1 otherwise (the verdict names why), 2 on bad arguments, 3 when the host pool
does not fit the host memory budget (the refusal names the largest that fits), 130 when
interrupted before the service started.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import uvloop

from ..errors import ConfigError
from ..kinds import Backend
from ..workload.consumer import MAX_COMPUTE_DIM
from ..workload.conversations import WorkloadSpec
from ..workload.pagedata import MAX_SEED
from ..workload.runner import DEFAULT_DEVICE_PAGES, ServeOptions, serve
from .exit_codes import EXIT_INTERRUPTED
from .numbers import (
    bounded_int,
    host_pool_bytes,
    positive_float,
    positive_int,
    positive_seconds,
)

MIN_DEVICE_PAGES = 8


def seed(text: str) -> int:
    return bounded_int(text, low=0, high=MAX_SEED,
                       why="a 64-bit seed, what torch's generator takes")


def compute_dim(text: str) -> int:
    return bounded_int(text, low=1, high=MAX_COMPUTE_DIM,
                       why="a [D, D] matrix: D x D elements must fit 64 bits")


def port(text: str) -> int:
    return bounded_int(text, low=0, what="a port number", high=65535,
                       why="a TCP port; 0 picks a free one")


def device_pages(text: str) -> int:
    return bounded_int(text, low=MIN_DEVICE_PAGES)


def workload(text: str) -> WorkloadSpec:
    try:
        return WorkloadSpec.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    parser = subparsers.add_parser(
        "serve", help="run the service under a serving-like workload and verify every page",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.AUTO.value,
                        help="transfer backend (default %(default)s: CUDA when a GPU is present)")
    parser.add_argument("--duration-s", type=positive_seconds, default=None, metavar="N",
                        help="stop after N seconds (default: run until SIGINT/SIGTERM)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="H",
                        help="address of the metrics server (default %(default)s)")
    parser.add_argument("--metrics-port", type=port, default=None, metavar="P",
                        help="serve Prometheus metrics on this port (0: a free port, logged); "
                             "default: no metrics server")
    parser.add_argument("--host-pool-gb", dest="host_pool_bytes", type=host_pool_bytes,
                        default=None, metavar="G|auto",
                        help="host pool in GB (10^9 B), or auto (default): the smaller of 4x the "
                             "device cache and the largest pool that fits the memory budget")
    parser.add_argument("--layers", type=positive_int, default=61, metavar="L",
                        help="layers of each pool (default %(default)s, DeepSeek-V3.2)")
    parser.add_argument("--device-pages", type=device_pages, default=DEFAULT_DEVICE_PAGES,
                        metavar="N",
                        help=f"device cache pages of 64 tokens (default %(default)s: about 246 MB "
                             f"of indexer + MLA KV buffers at 61 layers; at least "
                             f"{MIN_DEVICE_PAGES})")
    parser.add_argument("--workload", type=workload, default=WorkloadSpec(),
                        metavar="multiturn|trace:PATH",
                        help="seeded multi-turn conversations (default), or replay a JSON-lines "
                             "trace of {arrival_s, conversation, prompt_tokens, output_tokens}")
    parser.add_argument("--seed", type=seed, default=0, metavar="S",
                        help=f"seed of the arrivals and the page contents, 0 to {MAX_SEED} "
                             f"(default %(default)s)")
    parser.add_argument("--json-summary", type=Path, default=None, metavar="PATH",
                        help="also write the summary as JSON to PATH")
    parser.add_argument("--quiet", action="store_true",
                        help="no live status line or periodic status log")
    parser.add_argument("--arrival-rate", type=positive_float, default=4.0, metavar="R",
                        help="multiturn: new conversations per second (default %(default)s)")
    parser.add_argument("--compute-dim", type=compute_dim, default=256, metavar="D",
                        help="forward pass: a [D, D] matmul per layer (default %(default)s)")
    parser.set_defaults(func=run)


def options_from(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        backend=Backend(args.backend), duration_s=args.duration_s, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port, host_pool_bytes=args.host_pool_bytes,
        num_layers=args.layers, device_pages=args.device_pages, workload=args.workload,
        seed=args.seed, json_summary=args.json_summary, quiet=args.quiet,
        arrival_rate_per_s=args.arrival_rate, compute_dim=args.compute_dim)


def run(args: argparse.Namespace) -> int:
    """Run the workload on a fresh uvloop; 0 when the summary's verdict is OK, else 1."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(message)s")
    summaries = []

    async def main() -> None:
        summaries.append(await serve(options_from(args),
                                     ignore_signals_after=getattr(args, "as_program", False)))

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        # serve() handles SIGINT from its first step to its last; one that lands while the
        # loop itself starts or closes must not turn a finished run's verdict into a traceback
        if not summaries:
            print("dsa-async serve: interrupted before the service started", file=sys.stderr)
            return EXIT_INTERRUPTED
    return 0 if summaries[0].ok else 1
