"""The benchmark drivers of the emulated network (``ddlcomm.slownet``): ``run_X`` builds the
emulated hosts and runs the ``bench.X`` worker on each, e.g.
``sudo .venv/bin/python -m bench.slownet.run_fsdp_step --rates 1gbit,10gbit --out docs/results``
from the repository root; ``driver`` holds what they share."""
