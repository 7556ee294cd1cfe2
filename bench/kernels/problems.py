"""The problems of the kernel benchmarks, as dicts of named sizes in kernelbench.py's form (pairs as lists): the layer
zoo's 25 (layer_zoo.py) and KernelBench's seven (kernelbench_conv_transpose2d.json, named kb<id>); the precisions and
input layouts they run in, their convolution arguments, output shapes and roofline."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from bench.kernels import layer_zoo
from bench.kernels.kernelbench import (
    PROBLEMS,
    TOL,
    floor_ms,
    min_bytes,
    useful_flops,
)

PRECISIONS = ("tf32", "bf16", "fp16", "fp32")
LAYOUTS = ("nchw", "cl")
SUITES = ("zoo", "kernelbench")
DTYPES = {"tf32": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# kernels.conv_transpose2d's precision argument per row precision (16-bit dtypes ignore it).
OURS_PRECISION: dict[str, str | None] = {"tf32": "tf32", "fp32": "fp32", "bf16": None, "fp16": None}
ZOO_TOL = {**TOL, "fp16": 2e-2}


def spec(name: str, suite: str, batch: int, c_in: int, c_out: int, kernel: Sequence[int], stride: Sequence[int],
         padding: Sequence[int], output_padding: Sequence[int], groups: int, dilation: Sequence[int], height: int,
         width: int, bias: bool) -> dict:
    """A problem in kernelbench.py's form (pairs as lists), which its useful_flops and min_bytes read."""
    return {"name": name, "suite": suite, "batch": batch, "in_channels": c_in, "out_channels": c_out,
            "kernel_size": list(kernel), "stride": list(stride), "padding": list(padding),
            "output_padding": list(output_padding), "groups": groups, "dilation": list(dilation), "height": height,
            "width": width, "bias": bias}


def zoo_problems() -> list[dict]:
    """layer_zoo.py's layers as problems."""
    out = []
    for entry in layer_zoo.ZOO:
        q = layer_zoo.problem(entry)
        out.append(spec(q["name"], "zoo", q["batch"], q["in_channels"], q["out_channels"], [q["kernel_size"]] * 2,
                        [q["stride"]] * 2, [q["padding"]] * 2, [q["output_padding"]] * 2, q["groups"],
                        [q["dilation"]] * 2, q["height"], q["width"], q["bias"]))
    return out


def kernelbench_problems() -> list[dict]:
    """KernelBench's seven problems (kernelbench_conv_transpose2d.json), named kb<id>, with their raw entry
    under "kb" (for the correctness check's Model)."""
    out = []
    for p in json.loads(PROBLEMS.read_text())["problems"]:
        q = spec(f"kb{p['id']}", "kernelbench", p["batch"], p["in_channels"], p["out_channels"], p["kernel_size"],
                 p["stride"], p["padding"], p["output_padding"], p["groups"], p["dilation"], p["height"],
                 p["width"], p["bias"])
        q["kb"] = p
        out.append(q)
    return out


def select(problems: Iterable[dict], suite: str, only: Sequence[str] | None) -> list[dict]:
    """The problems of ``suite`` ("zoo", "kernelbench" or "all"), restricted to the names in ``only``."""
    return [p for p in problems if suite in ("all", p["suite"]) and (not only or p["name"] in only)]


def conv_kwargs(p: dict) -> dict[str, Any]:
    """F.conv_transpose2d's keyword arguments of a problem."""
    return {"stride": tuple(p["stride"]), "padding": tuple(p["padding"]),
            "output_padding": tuple(p["output_padding"]), "groups": p["groups"], "dilation": tuple(p["dilation"])}


def out_shape(p: dict) -> tuple[int, int, int, int]:
    kh, kw = p["kernel_size"]
    ho = layer_zoo.out_size(p["height"], kh, p["stride"][0], p["padding"][0], p["output_padding"][0],
                            p["dilation"][0])
    wo = layer_zoo.out_size(p["width"], kw, p["stride"][1], p["padding"][1], p["output_padding"][1],
                            p["dilation"][1])
    return p["batch"], p["out_channels"], ho, wo


def roofline(p: dict, precision: str, ceilings: dict[str, float]) -> tuple[float, float]:
    """(GFLOP of useful work, floor in ms) of a problem in a precision, for the measured ceilings."""
    flops = useful_flops(p)
    nbytes = min_bytes(p, DTYPES[precision].itemsize)
    return flops / 1e9, floor_ms(flops, nbytes, precision, ceilings)
