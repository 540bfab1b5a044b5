"""The old name of :mod:`ddlcomm.bench.slownet.run_compressed` (renamed: the driver had the name of
the worker it runs, ``ddlcomm.bench.compressed``). Kept for one release; running or importing it warns."""

from .driver import renamed

renamed(globals(), "run_compressed")
