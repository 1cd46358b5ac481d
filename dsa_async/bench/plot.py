"""``--plot``: throughput against batch size as a PNG (needs the optional ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from ..errors import ConfigError
from ..workload.output_files import write_output_file

INSTALL_HINT = "pip install 'dsa-async[plot]' (or pip install matplotlib)"


class PlotUnavailable(ConfigError):
    """matplotlib is not installed."""


def require_pyplot() -> ModuleType:
    """matplotlib's pyplot on the non-interactive Agg backend, or ``PlotUnavailable``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from exc
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


_LINES = (
    ("engine_gbps", "engine (page batches)", "o-"),
    ("token_gbps", "token-granular (index_select + index_copy_, int32 rows)", "s--"),
    ("contiguous_gbps", "contiguous copy (reference)", "^:"),
)


def plot_throughput(series: Mapping[str, list[float]], path: Path, title: str) -> None:
    """Write GB/s vs batch size (pages, log scale) for the engine and both references, as a
    PNG whatever ``path``'s suffix (``OutputWriteError`` when it cannot be written)."""
    pyplot = require_pyplot()
    fig, ax = pyplot.subplots(figsize=(8, 5))
    try:
        x = series["batch_pages"]
        for key, label, style in _LINES:
            if key in series:
                ax.plot(x, series[key], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (pages of all layers)")
        ax.set_ylabel("throughput, D2H + H2D (GB/s)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        write_output_file(path, "--plot",
                          lambda p: fig.savefig(p, dpi=120, format="png"))
    finally:
        pyplot.close(fig)
