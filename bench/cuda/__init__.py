"""GPU benchmarks: ``torch_ops`` (the compressors in plain torch ops, beside the CUDA kernels'
numbers) and ``kernels.cc`` (the CUDA kernels' throughput; built by csrc/cuda/CMakeLists.txt as
``bench_cuda_kernels``, not part of the wheel)."""
