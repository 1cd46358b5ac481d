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

import importlib
import signal

from ..errors import ConfigError, DsaAsyncError, HostBudgetExceeded
from .exit_codes import EXIT_DOES_NOT_FIT, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE

PROG = "dsa-async"

#: The subcommand modules (under this package), in help order. They import torch, which takes
#: seconds, so they are imported by :func:`build_parser`, not with this package.
_COMMANDS = ("plan", "bench", "serve")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser; imports every subcommand (blocks for seconds)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Host-memory offload service for DeepSeek-V3.2 sparse-attention serving."
    )
    subparsers = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )
    for command in _COMMANDS:
        importlib.import_module(f"{__name__}.{command}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, *, as_program: bool = False) -> int:
    """Run the command line; return the exit code. ``as_program``: this is the process's
    program (:func:`console_main`), so a command may leave SIGINT/SIGTERM ignored once its
    exit code is decided; called in-process, nothing outlives the command."""
    try:
        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C while torch loads: before anything ran
        print(f"{PROG}: interrupted while starting", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.as_program = as_program
    try:
        return int(args.func(args))
    except DsaAsyncError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(exc, ConfigError):
            return EXIT_USAGE
        return EXIT_DOES_NOT_FIT if isinstance(exc, HostBudgetExceeded) else EXIT_FAILED


def console_main() -> int:
    """The ``dsa-async`` program (and ``python -m dsa_async``): :func:`main`, then SIGINT and
    SIGTERM ignored while the interpreter ends, so one that lands after the exit code was
    decided (a second Ctrl-C) cannot turn it into a kill or a traceback."""
    code = main(as_program=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return code
