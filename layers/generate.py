"""Regenerate the bundled layer repository (this directory): ``python layers/generate.py``.

Realistic decoder layers with PyTorch's default initialisation, seeded, exported with ``service.export``:

- ``dcgan_up1``..``dcgan_up3``, ``dcgan_rgb``: the 4x4 stride-2 layers of a DCGAN generator (ngf=16, no bias);
- ``dcgan_up2_bf16``: ``dcgan_up2`` in bfloat16;
- ``unet_up``: a U-Net 2x2 stride-2 up-convolution (bias, exact fp32);
- ``grouped_dilated``: groups 4, dilation (1, 2), asymmetric 3x5 kernel, stride (2, 1), output_padding (1, 0);
- ``demo``: a small fp32 layer for trying the service and for load tests; ``demo_fp16``: the same in float16.

The weights stay under 1 MB so that they live in git.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
# Input sizes the server runs at startup (service: warm_shapes): bench/kernels/kernelbench.py's bundled-layer size, and
# for the demo layers also bench/serving/service_load.py's default request size.
WARM = [(32, 32)]
DEMO_WARM = [(16, 16), (32, 32)]
sys.path.insert(0, str(HERE.parent))

from service.export import export_model  # noqa: E402


def dcgan_generator(nz: int = 100, ngf: int = 16, nc: int = 3) -> nn.Sequential:
    """The DCGAN generator of the PyTorch tutorial: 1x1 -> 64x64 images."""
    return nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
        nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh(),
    )


def main() -> None:
    """Write every bundled layer into this directory."""
    torch.manual_seed(0)
    gen = dcgan_generator()
    dcgan = "DCGAN generator (ngf=16)"
    export_model(gen, HERE, precision="tf32", description=dcgan, overwrite=True,
                 names={"3": "dcgan_up1", "6": "dcgan_up2", "9": "dcgan_up3", "12": "dcgan_rgb"},
                 limits={"max_height": 256, "max_width": 256}, warm_shapes=WARM)
    export_model(gen, HERE, dtype="bfloat16", description=dcgan, overwrite=True, names={"6": "dcgan_up2_bf16"},
                 limits={"max_height": 256, "max_width": 256}, warm_shapes=WARM)

    torch.manual_seed(1)
    export_model(nn.ConvTranspose2d(128, 64, kernel_size=2, stride=2), HERE, precision="fp32", overwrite=True,
                 description="U-Net up-convolution", names={"": "unet_up"}, warm_shapes=WARM)

    torch.manual_seed(2)
    odd = nn.ConvTranspose2d(48, 24, kernel_size=(3, 5), stride=(2, 1), padding=(1, 2), output_padding=(1, 0),
                             groups=4, dilation=(1, 2))
    export_model(odd, HERE, precision="fp32", overwrite=True, description="grouped, dilated, asymmetric",
                 names={"": "grouped_dilated"}, warm_shapes=WARM)

    torch.manual_seed(3)
    demo = nn.ConvTranspose2d(16, 8, kernel_size=4, stride=2, padding=1)
    export_model(demo, HERE, precision="tf32", description="demo", overwrite=True, names={"": "demo"},
                 limits={"max_height": 512, "max_width": 512}, warm_shapes=DEMO_WARM)
    export_model(demo, HERE, dtype="float16", description="demo", overwrite=True, names={"": "demo_fp16"},
                 limits={"max_height": 512, "max_width": 512}, warm_shapes=DEMO_WARM)


if __name__ == "__main__":
    main()
