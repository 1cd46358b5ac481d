"""The package version, in one place (read by the package root and by the metrics)."""

__version__ = "0.1.0"
