"""``python -m dsa_async``: the same command line as ``dsa-async``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
