"""``dsa-async``: the command line. Each subcommand lives in its own module.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (parsed args -> exit code). To add one, import it and append it to ``_COMMANDS``.

Exit codes (``exit_codes.py``): 0 success, 1 a runtime failure, 2 bad arguments or
configuration, 3 the host pool does not fit the host memory budget (``plan``'s verdict,
or ``serve`` refused at start), 130 interrupted before there was
anything to report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import ConfigError, DsaAsyncError, HostBudgetExceeded
from . import bench, plan, serve
from .exit_codes import EXIT_DOES_NOT_FIT, EXIT_FAILED, EXIT_USAGE

PROG = "dsa-async"

_COMMANDS = (plan, bench, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Host-memory offload service for DeepSeek-V3.2 sparse-attention serving."
    )
    subparsers = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )
    for command in _COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (console scripts pass it to ``sys.exit``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return int(args.func(args))
    except DsaAsyncError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(exc, ConfigError):
            return EXIT_USAGE
        return EXIT_DOES_NOT_FIT if isinstance(exc, HostBudgetExceeded) else EXIT_FAILED
