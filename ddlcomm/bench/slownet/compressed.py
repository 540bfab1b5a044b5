"""The old name of :mod:`ddlcomm.bench.slownet.run_compressed` (renamed: the driver
had the name of the worker it runs, ``ddlcomm.bench.compressed``). Kept for one release;
running or importing it warns."""

import warnings
from typing import Any

from . import run_compressed

warnings.warn("ddlcomm.bench.slownet.compressed is now ddlcomm.bench.slownet.run_compressed; "
              "the old name goes in the next release",
              FutureWarning, stacklevel=1 if __name__ == "__main__" else 2)


def __getattr__(name: str) -> Any:
    # Everything the driver has (report, main, ...).
    return getattr(run_compressed, name)


if __name__ == "__main__":
    run_compressed.main()
