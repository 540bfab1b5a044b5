"""Runnable examples: ``torchrun --nproc-per-node 4 -m ddlcomm.examples.ddp_demo``."""
