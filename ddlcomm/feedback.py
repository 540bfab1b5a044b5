"""The old name of :mod:`ddlcomm.ddp_memory` (renamed: it holds the DDP hooks' error-feedback
memory only; FSDP keeps its own residuals). Kept for one release; importing it warns."""

import warnings
from typing import Any

from . import ddp_memory
from .ddp_memory import *  # noqa: F401,F403

__all__ = ddp_memory.__all__

warnings.warn("ddlcomm.feedback is now ddlcomm.ddp_memory; the old name goes in the next release",
              FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    # Everything else the old module had.
    return getattr(ddp_memory, name)
