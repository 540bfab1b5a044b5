"""The old name of :mod:`ddlcomm.bench.slownet.run_time_to_accuracy` (renamed: the driver
had the name of the worker it runs, ``ddlcomm.bench.time_to_accuracy``). Kept for one release;
running or importing it warns."""

import warnings
from typing import Any

from . import run_time_to_accuracy

warnings.warn("ddlcomm.bench.slownet.time_to_accuracy is now ddlcomm.bench.slownet.run_time_to_accuracy; "
              "the old name goes in the next release",
              FutureWarning, stacklevel=1 if __name__ == "__main__" else 2)


def __getattr__(name: str) -> Any:
    # Everything the driver has (report, main, ...).
    return getattr(run_time_to_accuracy, name)


if __name__ == "__main__":
    run_time_to_accuracy.main()
