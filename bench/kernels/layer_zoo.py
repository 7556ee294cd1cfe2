"""The layer zoo: 25 ConvTranspose2d layers as published decoder and upsampling architectures use them.

These are the speed suite of bench/kernels/zoo.py, kept apart from the problems our kernels were tuned on (KernelBench's
seven and the service's bundled layers). Each entry is (name, where the layer comes from, problem), the problem
being F.conv_transpose2d's arguments as one tuple: (N, C_in, C_out, kernel, stride, padding, output_padding,
groups, dilation, H_in, W_in, bias); kernel, stride, padding, output_padding and dilation are square. Channel
counts, kernels and strides are the cited models'; the batch is a typical serving or training batch.

    python -m bench.kernels.layer_zoo     # the table: input -> output shape, GFLOP, source
"""

from __future__ import annotations

Problem = tuple[int, int, int, int, int, int, int, int, int, int, int, bool]

ZOO: list[tuple[str, str, Problem]] = [
    # name, source, (N, C_in, C_out, k, s, p, op, groups, dilation, H, W, bias)
    ("dcgan64-z", "DCGAN 64px generator, first layer (Radford 2016)", (128, 100, 512, 4, 1, 0, 0, 1, 1, 1, 1, False)),
    ("dcgan64-up1", "DCGAN 64px generator", (128, 512, 256, 4, 2, 1, 0, 1, 1, 4, 4, False)),
    ("dcgan64-up2", "DCGAN 64px generator", (128, 256, 128, 4, 2, 1, 0, 1, 1, 8, 8, False)),
    ("dcgan64-up3", "DCGAN 64px generator", (128, 128, 64, 4, 2, 1, 0, 1, 1, 16, 16, False)),
    ("dcgan64-rgb", "DCGAN 64px generator, output layer", (128, 64, 3, 4, 2, 1, 0, 1, 1, 32, 32, False)),
    ("cyclegan-up1", "CycleGAN ResNet generator (Zhu 2017), output_padding=1",
     (4, 256, 128, 3, 2, 1, 1, 1, 1, 64, 64, True)),
    ("cyclegan-up2", "CycleGAN ResNet generator", (4, 128, 64, 3, 2, 1, 1, 1, 1, 128, 128, True)),
    ("pix2pix-u2", "pix2pix U-Net 256 decoder (Isola 2017)", (16, 1024, 512, 4, 2, 1, 0, 1, 1, 4, 4, False)),
    ("pix2pix-u5", "pix2pix U-Net 256 decoder", (16, 1024, 256, 4, 2, 1, 0, 1, 1, 16, 16, False)),
    ("pix2pix-u7", "pix2pix U-Net 256 decoder", (16, 256, 64, 4, 2, 1, 0, 1, 1, 64, 64, False)),
    ("pix2pix-rgb", "pix2pix U-Net 256 output layer", (16, 128, 3, 4, 2, 1, 0, 1, 1, 128, 128, True)),
    ("unet-up1", "U-Net (Ronneberger 2015), 2x2 up-convolution", (4, 1024, 512, 2, 2, 0, 0, 1, 1, 32, 32, True)),
    ("unet-up3", "U-Net, 2x2 up-convolution", (4, 256, 128, 2, 2, 0, 0, 1, 1, 128, 128, True)),
    ("pose-up1", "SimpleBaselines pose (Xiao 2018), ResNet-50 head", (32, 2048, 256, 4, 2, 1, 0, 1, 1, 8, 6, False)),
    ("pose-up3", "SimpleBaselines pose head", (32, 256, 256, 4, 2, 1, 0, 1, 1, 32, 24, False)),
    ("yolo-proto", "YOLOv8-seg mask prototypes (Proto), 640px input", (8, 256, 256, 2, 2, 0, 0, 1, 1, 80, 80, True)),
    ("maskhead", "Mask R-CNN mask head (He 2017), RoIs as batch", (512, 256, 256, 2, 2, 0, 0, 1, 1, 14, 14, True)),
    ("fsrcnn-x3", "FSRCNN super-resolution (Dong 2016), x3, 1 channel out",
     (16, 56, 1, 9, 3, 4, 2, 1, 1, 64, 64, True)),
    ("enet-out", "ENet (Paszke 2016) full-resolution output", (4, 16, 20, 3, 2, 1, 1, 1, 1, 256, 512, False)),
    ("fcn8s-up2", "FCN-8s (Long 2015) upscore2, 21 classes", (4, 21, 21, 4, 2, 0, 0, 1, 1, 17, 17, False)),
    ("fcn8s-up8", "FCN-8s upscore8", (4, 21, 21, 16, 8, 0, 0, 1, 1, 68, 68, False)),
    ("dla-idaup", "CenterNet DLA-34 IDAUp, depthwise bilinear up (groups=C)",
     (16, 64, 64, 4, 2, 1, 0, 64, 1, 128, 128, False)),
    ("dla-idaup4", "CenterNet DLA-34 IDAUp, x4 depthwise", (16, 128, 128, 8, 4, 2, 0, 128, 1, 32, 32, False)),
    ("stylegan2-up32", "StyleGAN2 modulated up-conv, batch folded into groups",
     (1, 2048, 2048, 3, 2, 0, 0, 4, 1, 32, 32, False)),
    ("deconvnet-s1", "DeconvNet (Noh 2015), stride-1 deconvolution", (8, 512, 512, 3, 1, 1, 0, 1, 1, 14, 14, True)),
]


def out_size(h: int, k: int, s: int, p: int, op: int, d: int) -> int:
    """Output length of one axis: (h - 1) * s - 2 * p + d * (k - 1) + op + 1."""
    return (h - 1) * s - 2 * p + d * (k - 1) + op + 1


def problem(entry: tuple[str, str, Problem]) -> dict:
    """One zoo entry as a dict of named sizes, with its output size, its GFLOP (2 x every tap of every input
    pixel: a small overcount where taps fall on the padding) and its tensors' element count (input, weight,
    output)."""
    n, ci, co, k, s, p, op, g, d, h, w, bias = entry[2]
    ho, wo = out_size(h, k, s, p, op, d), out_size(w, k, s, p, op, d)
    flops = 2 * n * h * w * k * k * ci * (co // g)
    elems = n * ci * h * w + n * co * ho * wo + ci * (co // g) * k * k
    return {"name": entry[0], "source": entry[1], "batch": n, "in_channels": ci, "out_channels": co,
            "kernel_size": k, "stride": s, "padding": p, "output_padding": op, "groups": g, "dilation": d,
            "height": h, "width": w, "bias": bias, "out_height": ho, "out_width": wo, "gflop": flops / 1e9,
            "elements": elems}


if __name__ == "__main__":
    for e in ZOO:
        q = problem(e)
        print(f"{q['name']:15s} [{q['batch']},{q['in_channels']},{q['height']},{q['width']}] -> "
              f"[{q['batch']},{q['out_channels']},{q['out_height']},{q['out_width']}]  {q['gflop']:8.2f} GFLOP  "
              f"{q['source']}")
