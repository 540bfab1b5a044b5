"""Benchmarks, each ``python -m ddlcomm.bench.NAME``: collectives and convergence under torchrun;
compressed, fsdp_step and time_to_accuracy one process per rank, normally on the emulated
network of ``ddlcomm.bench.slownet``; compress_kernels (compressor throughput, one process);
soak (random collectives, every result checked); ``cuda`` for the GPU kernels."""
