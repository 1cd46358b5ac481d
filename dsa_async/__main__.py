"""``python -m dsa_async``: the same command line as ``dsa-async``."""

from .cli import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
