"""Makes ``"ddlcomm"`` known to ``torch.distributed`` without an ``import ddlcomm``.

torch calls ``load()`` at the end of ``import torch`` (the ``torch.backends`` entry-point group;
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). This is a separate top-level package so
that a ddlcomm that fails to import is logged here instead of breaking ``import torch``.
"""

import logging


def load() -> None:
    try:
        import ddlcomm  # noqa: F401  (registers the backend)
    except Exception as error:  # noqa: BLE001  (never break `import torch`)
        logging.getLogger("ddlcomm").warning(
            "ddlcomm could not be loaded, so the \"ddlcomm\" backend is not registered: %s: %s",
            type(error).__name__, error)
