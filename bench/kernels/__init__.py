"""Benchmarks of the kernels on one GPU: ours against cuDNN in the same run (``python -m bench.kernels.<name>``)."""
