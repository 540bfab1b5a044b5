"""The benchmarks' optional plots: matplotlib is not a dependency of ddlcomm (the ``plots``
extra installs it). A benchmark writes its tables and files first and then asks ``pyplot``
for matplotlib; without it the figure is skipped with one line on stderr, and the run still
succeeds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["pyplot", "say_written"]


def pyplot(path: Path | str) -> Optional[Any]:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or None after one
    line on stderr saying that the figure ``path`` is skipped and how to get it, where
    matplotlib cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        program = f"{spec.name}: " if spec else ""
        print(f"{program}skipped the plot {path}: matplotlib is not available ({e}); "
              f"pip install matplotlib (or pip install 'ddlcomm[plots]') makes it", file=sys.stderr, flush=True)
        return None
    return plt


def say_written(files: list[Path], figure: Path, plotted: bool) -> None:
    """One line naming what a benchmark wrote: ``files``, and ``figure`` where it was plotted."""
    names = [str(f) for f in files] + ([str(figure)] if plotted else [])
    print("wrote " + (", ".join(names[:-1]) + " and " if len(names) > 1 else "") + names[-1], flush=True)
