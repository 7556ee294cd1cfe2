"""Benchmarks of the kernels and of the service, run from the repository root as modules.

- ``bench.kernels``: our ConvTranspose2d kernels against cuDNN on one GPU (KernelBench's problems, the layer zoo, a
  call's cost, whole models under torch.compile, and the probes behind the dispatcher's rules);
- ``bench.serving``: the service under load (requests/s, latency, CPU a request, gRPC against HTTP), a batch's cost
  in the engine, and its reliability under overload, faults, signals and attacks;
- ``bench/device``: the shell scripts that run one measurement on the GPU machine, each one call there;
- ``bench.harness``: what the kernel benchmarks share: GPU timing with a cold L2 (flushed before each call) or a warm
  one, the relative error against float64, the device's name in file names, the JSON result files.

    python -m bench.kernels.zoo --estimate
    python -m bench.serving.service_load --help

bench/NOTES.md keeps every measured version; docs/benchmarks/README.md the current figures and their commands.
"""
