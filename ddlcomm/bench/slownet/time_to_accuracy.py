"""The old name of :mod:`ddlcomm.bench.slownet.run_time_to_accuracy` (renamed: the driver had the name of
the worker it runs, ``ddlcomm.bench.time_to_accuracy``). Kept for one release; running or importing it warns."""

from .driver import renamed

renamed(globals(), "run_time_to_accuracy")
