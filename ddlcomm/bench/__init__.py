"""Benchmarks: ``python -m ddlcomm.bench.collectives`` (run under torchrun)."""
