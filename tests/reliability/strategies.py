"""Hypothesis strategies for near-valid request bodies: .npy, safetensors and KServe v2 (JSON and binary).

Bodies are built from real structure with odd fields, wrong lengths, truncations and flipped bytes, so that a
fuzzer gets past the magic numbers into the code that trusts the header.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from hypothesis import strategies as st

from service import codec

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
dims = st.one_of(st.integers(0, 5), st.integers(0, 2**40), st.integers(-3, -1), st.just(2**63), st.booleans(),
                 st.floats(allow_nan=True), st.text(max_size=2), st.none())
good_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=5)
shapes = st.one_of(good_shapes, good_shapes.map(tuple), st.lists(dims, max_size=9), st.lists(st.integers(0, 3),
                   min_size=9, max_size=12), json_values)


@st.composite
def mutate(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` as is, truncated, extended, or with some bytes flipped."""
    how = draw(st.sampled_from(["keep", "keep", "truncate", "extend", "flip"]))
    if how == "truncate" and body:
        return body[: draw(st.integers(0, len(body) - 1))]
    if how == "extend":
        return body + draw(st.binary(min_size=1, max_size=16))
    if how == "flip" and body:
        out = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    return body


def _data_for(draw: st.DrawFn, shape: Any, itemsize: int) -> bytes:
    # The exact byte count when the shape is small and sensible, else something near it or random.
    if isinstance(shape, list | tuple) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in shape):
        n = math.prod(shape) * itemsize
        if n <= 4096:
            n += draw(st.sampled_from([0, 0, 0, -1, 1, itemsize, -itemsize]))
            return draw(st.binary(min_size=max(0, n), max_size=max(0, n)))
    return draw(st.binary(max_size=64))


@st.composite
def npy_bodies(draw: st.DrawFn) -> bytes:
    """.npy files: real dtypes and odd ones, shapes of every kind, header lengths right and wrong."""
    descr = draw(st.sampled_from(["<f4", "<f2", "<f8", "=f4", ">f4", "|u1", "<i4", "O", "|O", "<c8", "<f16", "<U3",
                                  "V4", "<M8[s]"]) | st.text(max_size=6) | json_values)
    header: dict[str, Any] = {"descr": descr, "fortran_order": draw(st.booleans() | json_scalars),
                              "shape": draw(shapes)}
    for key in draw(st.lists(st.sampled_from(["descr", "fortran_order", "shape"]), max_size=1)):
        del header[key]
    if draw(st.booleans()):
        header[draw(st.text(max_size=4))] = draw(json_scalars)
    text = draw(st.sampled_from(["repr", "repr", "repr", "raw"]))
    htext = draw(st.text(max_size=80)) if text == "raw" else repr(header)
    raw = htext.encode("utf-8", "surrogatepass") + b" " * draw(st.integers(0, 70)) + b"\n"
    major = draw(st.sampled_from([1, 1, 2, 3, 0, 4, 255]))
    minor = draw(st.sampled_from([0, 0, 1, 255]))
    hlen = len(raw) + draw(st.sampled_from([0, 0, 0, -1, 1, 1 << 15, 1 << 17]))
    length = struct.pack("<H", hlen % (1 << 16)) if major == 1 else struct.pack("<I", max(0, hlen) % (1 << 32))
    itemsize = {"<f2": 2, "<f8": 8}.get(descr if isinstance(descr, str) else "", 4)
    data = _data_for(draw, header.get("shape"), itemsize)
    return draw(mutate(codec.NPY_MAGIC + bytes([major, minor]) + length + raw + data))


@st.composite
def safetensors_bodies(draw: st.DrawFn) -> bytes:
    """safetensors files: zero to three tensors, odd dtypes, shapes and offsets, header lengths right and wrong."""
    header: dict[str, Any] = {}
    size = 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "F8_E4M3", "BOOL"]) | json_values)
        shape = draw(shapes)
        itemsize = {"F16": 2, "BF16": 2, "F64": 8}.get(dtype if isinstance(dtype, str) else "", 4)
        n = (math.prod(shape) * itemsize if isinstance(shape, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) else 8)
        offsets = draw(st.sampled_from(["right", "right", "odd"]))
        begin = size if offsets == "right" else draw(st.integers(-2, 2**64))
        end = begin + n if offsets == "right" else draw(st.integers(-2, 2**64) | st.just(begin))
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        if draw(st.integers(0, 5)) == 0:
            entry = draw(st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), json_values))
        header[f"t{i}"] = entry
        size = max(size, n if offsets == "right" else size)
    if draw(st.booleans()):
        header["__metadata__"] = draw(json_values)
    raw = (json.dumps(header) if draw(st.integers(0, 9)) else draw(st.text(max_size=40))).encode("utf-8",
                                                                                                  "surrogatepass")
    raw += b" " * draw(st.integers(0, 7))
    hlen = len(raw) + draw(st.sampled_from([0, 0, 0, -1, 1, 1 << 16, 1 << 63]))
    data = draw(st.binary(min_size=size, max_size=size)) if size <= 4096 else draw(st.binary(max_size=64))
    return draw(mutate(struct.pack("<Q", hlen % (1 << 64)) + raw + data))


@st.composite
def kserve_bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """KServe v2 requests (JSON, or JSON + binary tensor) and their Inference-Header-Content-Length."""
    shape = draw(shapes)
    datatype = draw(st.sampled_from(["FP32", "FP16", "BF16", "FP64", "INT8", "BYTES", "fp32"]) | json_values)
    spec: dict[str, Any] = {"name": draw(st.sampled_from(["input", "input", "x"]) | json_values),
                            "shape": shape, "datatype": datatype}
    itemsize = {"FP16": 2, "BF16": 2, "FP64": 8}.get(datatype if isinstance(datatype, str) else "", 4)
    binary = b""
    mode = draw(st.sampled_from(["json", "binary", "odd"]))
    if mode == "binary":
        binary = _data_for(draw, shape, itemsize)
        spec["parameters"] = {"binary_data_size": draw(st.sampled_from([len(binary), len(binary)])
                                                       | st.integers(-1, 2**40) | json_values)}
    elif mode == "json":
        if isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 5
                                           for d in shape) and math.prod(shape) <= 256:
            flat = draw(st.lists(st.floats() | st.integers(-(2**1100), 2**1100), min_size=math.prod(shape),
                                 max_size=math.prod(shape)))
            spec["data"] = flat if draw(st.booleans()) else [flat]
        else:
            spec["data"] = draw(json_values)
    else:
        spec.update(draw(st.dictionaries(st.sampled_from(["data", "parameters", "shape", "name"]), json_values)))
    request: dict[str, Any] = {"inputs": [spec] if draw(st.integers(0, 9)) else draw(json_values)}
    if draw(st.booleans()):
        request["outputs"] = draw(st.sampled_from([[{"name": "output", "parameters": {"binary_data": True}}],
                                                   [{"name": "y"}]]) | json_values)
    if draw(st.booleans()):
        request["parameters"] = draw(st.fixed_dictionaries({"timeout": json_scalars,
                                                            "binary_data_output": json_scalars}) | json_values)
    if draw(st.booleans()):
        request["id"] = draw(json_scalars)
    text = json.dumps(request).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=40))
    body = draw(mutate(text + binary))
    how = draw(st.sampled_from(["right", "right", "none", "odd"]))
    length = {"right": str(len(text)), "none": None}.get(how) if how != "odd" else draw(
        st.sampled_from(["", "-1", "0", "x", "1e3", " 12 ", str(len(body) + 1), str(2**70)]))
    return body, length
