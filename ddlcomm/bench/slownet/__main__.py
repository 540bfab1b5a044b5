"""``python -m ddlcomm.bench.slownet [options] -- COMMAND [ARGS...]``."""

import sys

from .network import main

sys.exit(main())
