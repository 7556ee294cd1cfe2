"""NVIDIA CUTLASS's dgrad kernels as a ConvTranspose2d peer for the zoo benchmark (``peer``)."""
