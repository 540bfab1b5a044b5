"""The old name of :mod:`ddlcomm.compressors` (renamed: ``compress`` and ``compressed``
differed by two letters). Kept for one release; importing it warns."""

import warnings
from typing import Any

from . import compressors
from .compressors import *  # noqa: F401,F403

__all__ = compressors.__all__

warnings.warn("ddlcomm.compress is now ddlcomm.compressors; the old name goes in the next release",
              FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    # Everything else the old module had, such as the function that pickles name.
    return getattr(compressors, name)
