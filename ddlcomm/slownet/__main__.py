"""``python -m ddlcomm.slownet [options] -- COMMAND [ARGS...]``: see cli.py."""

import sys

from .cli import main

sys.exit(main())
