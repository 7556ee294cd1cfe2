"""Export a layer of bench/kernels/layer_zoo.py as a service layer (``<name>.json`` + ``<name>.safetensors``), for
serving benchmarks on real layers whose weights are too large to keep in git:

    python -m bench.serving.zoo_layer pix2pix-u5 /tmp/repo --precision fp32
    # -> /tmp/repo/pix2pix_u5.json, /tmp/repo/pix2pix_u5.safetensors (PyTorch's default initialisation, seeded)

The layer's warm shape is the zoo entry's input size, so that the server has its kernels ready for the first request
of that size; ``--max-batch-size`` caps the samples a kernel call holds (default: the server's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from bench.kernels import layer_zoo
from service.export import export_model


def zoo_module(name: str) -> tuple[nn.ConvTranspose2d, dict[str, int | str]]:
    """The zoo entry ``name`` as a module (seeded weights) and the entry's problem (bench/kernels/layer_zoo.py)."""
    for entry in layer_zoo.ZOO:
        if entry[0] == name:
            q = layer_zoo.problem(entry)
            torch.manual_seed(0)
            module = nn.ConvTranspose2d(q["in_channels"], q["out_channels"], q["kernel_size"], q["stride"],
                                        q["padding"], q["output_padding"], q["groups"], q["bias"], q["dilation"])
            return module, q
    raise SystemExit(f"no layer {name!r} in bench/kernels/layer_zoo.py; there are: "
                     f"{', '.join(e[0] for e in layer_zoo.ZOO)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layer", help="a name of bench/kernels/layer_zoo.py, such as pix2pix-u5")
    parser.add_argument("repository", type=Path, help="the layer repository to write into (created if needed)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--precision", choices=["tf32", "fp32"], help="float32 only (default: tf32)")
    parser.add_argument("--max-batch-size", type=int, help="most samples in one kernel call (default: the server's)")
    args = parser.parse_args(argv)
    module, q = zoo_module(args.layer)
    if args.dtype != "float32" and args.precision:
        parser.error("--precision is for float32 layers")
    precision = (args.precision or "tf32") if args.dtype == "float32" else None
    limits = {"max_batch_size": args.max_batch_size} if args.max_batch_size else None
    paths = export_model(module, args.repository, dtype=args.dtype, precision=precision,
                         names={"": args.layer.replace("-", "_")}, limits=limits, description=str(q["source"]),
                         warm_shapes=[(int(q["height"]), int(q["width"]))], overwrite=True)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
