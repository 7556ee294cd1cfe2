"""Wire formats: .npy and safetensors, zero-copy, never unpickled, sizes checked before allocation."""

from __future__ import annotations

import ast
import io
import json
import struct

import numpy as np
import pytest
import torch
from deconv_client import wire
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service import codec
from service.errors import InvalidInputError, MalformedBodyError, PayloadTooLargeError, UnsupportedMediaTypeError

from .conftest import load_npy, npy_bytes


def _npy_version(arr: np.ndarray, version: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_decode_matches_numpy(dtype, version):
    arr = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(dtype)
    t = codec.decode_npy(bytearray(_npy_version(arr, version)))
    assert t.dtype == torch.from_numpy(arr).dtype
    assert t.shape == arr.shape
    np.testing.assert_array_equal(t.numpy(), arr)


def test_npy_decode_is_zero_copy():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    body = bytearray(npy_bytes(arr))
    t = codec.decode_npy(body)
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data
    assert start <= t.data_ptr() < start + len(body)
    body[-4:] = struct.pack("<f", 123.0)  # the tensor sees a write into the body: same memory
    assert float(t[-1, -1, -1]) == 123.0


def test_npy_fortran_order_is_read_correctly():
    arr = np.asfortranarray(np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32))
    t = codec.decode_npy(bytearray(npy_bytes(arr)))
    np.testing.assert_array_equal(t.numpy(), arr)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_npy_encode_is_read_by_numpy(dtype):
    t = torch.randn(3, 4, 5).to(dtype)
    data = codec.encode_npy(t)
    arr = load_npy(data)
    np.testing.assert_array_equal(arr, t.numpy())
    assert (len(data) - t.numel() * t.element_size()) % 64 == 0  # header padded like numpy's


@pytest.mark.parametrize("shape", [(), (0,), (5,), (1, 16, 16, 16), (0, 3), (2, 1, 10**6), (3, 4, 5, 6, 7)])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_header_fast_path_agrees_with_literal_eval(shape, fortran):
    # Headers as numpy writes them take the fast path and give exactly what ast.literal_eval gives.
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": fortran, "shape": shape})
    text = buf.getvalue()[10:].decode("latin1")
    fast = wire._npy_canonical_header(text)
    assert fast is not None
    assert fast == ast.literal_eval(text)
    assert type(fast["shape"]) is tuple
    assert all(type(d) is int for d in fast["shape"])


@pytest.mark.parametrize("text", [
    "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",  # another key order
    '{"descr": "<f4", "fortran_order": False, "shape": (2, 3)}',  # double quotes, no trailing comma
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2,3), }",  # no space after the comma
])
def test_npy_other_header_spellings_still_decode(text):
    assert wire._npy_canonical_header(text) is None  # not numpy's layout: ast.literal_eval reads it
    header = text.encode() + b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    body = codec.NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header
    body += np.arange(6, dtype="<f4").tobytes()
    np.testing.assert_array_equal(codec.decode_npy(bytearray(body)).numpy(), np.arange(6).reshape(2, 3))


@pytest.mark.parametrize("shape", ["(3)", "(01, 2)", "(2, 3,)", "(-1, 2)"])
def test_npy_near_canonical_shapes_are_judged_like_python(shape):
    # "(3)" is the int 3 and "(01, 2)" a syntax error in Python: neither may sneak through the fast path.
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    assert wire._npy_canonical_header(text) is None
    header = text.encode() + b"\n"
    body = codec.NPY_MAGIC + b"\x01\x00" + struct.pack("<H", len(header)) + header + b"\0" * 24
    if shape == "(2, 3,)":
        assert codec.decode_npy(bytearray(body)).shape == (2, 3)
    else:
        with pytest.raises(MalformedBodyError):
            codec.decode_npy(bytearray(body))


def test_npy_encode_refuses_bfloat16():
    with pytest.raises(UnsupportedMediaTypeError):
        codec.encode_npy(torch.zeros(2, dtype=torch.bfloat16))


def test_npy_object_array_is_refused_without_unpickling():
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInputError, match="object"):
        codec.decode_npy(buf.getvalue())


@pytest.mark.parametrize("arr", [np.zeros(3, dtype=">f4"), np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.uint8)])
def test_npy_other_dtypes_are_invalid_input(arr):
    with pytest.raises(InvalidInputError):
        codec.decode_npy(npy_bytes(arr))


def _handmade_npy(header: str, data: bytes = b"") -> bytes:
    text = header.encode()
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


@pytest.mark.parametrize("body", [
    b"not a npy file",
    b"\x93NUMPY\x01\x00",
    _handmade_npy("__import__('os').system('true')"),
    _handmade_npy("{'descr': '<f4', 'fortran_order': False}"),
    _handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -1), }"),
    _handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 7),  # truncated
    _handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 12),  # trailing bytes
    b"\x93NUMPY\x09\x00" + b"\0" * 20,  # unknown version
    b"\x93NUMPY\x01\x00\xff\xff" + b"{}",  # header longer than the body
])
def test_npy_malformed(body):
    with pytest.raises(MalformedBodyError):
        codec.decode_npy(body)


def test_npy_huge_shape_is_refused_before_allocation():
    body = _handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576, 1024), }",
                         b"\0" * 16)
    with pytest.raises(PayloadTooLargeError, match="larger than any tensor"):
        codec.decode_npy(body)
    claim = _handmade_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1024, 1024), }", b"\0" * 16)
    with pytest.raises(PayloadTooLargeError, match="over the limit of 65536 bytes"):
        codec.decode_npy(claim, max_bytes=65536)


def test_npy_headers_read_before_are_remembered_and_every_body_still_checked():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = npy_bytes(x)
    wire._NPY_HEADERS.clear()
    assert wire.read_npy(body)[:4] == ("<f4", False, (2, 3), 4)
    assert len(wire._NPY_HEADERS) == 1
    again = wire.read_npy(bytearray(body))  # the same header, now remembered
    assert again[:4] == ("<f4", False, (2, 3), 4)
    assert bytes(again[4]) == x.tobytes()
    with pytest.raises(wire.WireError, match="over the limit of 16 bytes"):
        wire.read_npy(body, max_bytes=16)  # a remembered header is held to each call's limit
    with pytest.raises(wire.WireError, match="data is 20 bytes"):
        wire.read_npy(body[:-4])
    for n in range(1, wire._NPY_HEADERS_MAX + 10):  # bounded
        wire.read_npy(npy_bytes(np.zeros(n, dtype=np.float32)))
        assert len(wire._NPY_HEADERS) <= wire._NPY_HEADERS_MAX
    assert wire.npy_header("<f4", [2, 3]) == wire.npy_header("<f4", (2, 3)) == body[:len(body) - 24]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_safetensors_roundtrip(dtype):
    t = torch.randn(2, 3, 4, 5).to(dtype)
    body = bytearray(st_save({"x": t}))
    got = codec.decode_safetensors(body)
    assert got.dtype == dtype
    assert torch.equal(got, t)
    start = np.frombuffer(body, dtype=np.uint8).ctypes.data
    assert start <= got.data_ptr() < start + len(body)  # zero-copy
    out = st_load(codec.encode_safetensors(t))
    assert list(out) == ["output"]
    assert torch.equal(out["output"], t)


def _handmade_st(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("body", [
    b"short",
    struct.pack("<Q", 1 << 40) + b"{}",
    _handmade_st([1, 2], b""),
    st_save({"a": torch.zeros(2), "b": torch.zeros(2)}),  # two tensors
    _handmade_st({}, b""),  # none
    _handmade_st({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    _handmade_st({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12),
    _handmade_st({"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, b"\0" * 8),
    _handmade_st({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
    _handmade_st({"x": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 8]}}, b"\0" * 8),
])
def test_safetensors_malformed(body):
    with pytest.raises(MalformedBodyError):
        codec.decode_safetensors(body)


def test_safetensors_metadata_is_ignored_and_int_dtype_refused():
    t = torch.randn(2, 3)
    assert torch.equal(codec.decode_safetensors(st_save({"x": t}, metadata={"k": "v"})), t)
    with pytest.raises(InvalidInputError):
        codec.decode_safetensors(st_save({"x": torch.zeros(2, dtype=torch.int32)}))


@pytest.mark.parametrize(("accept", "request_type", "expected"), [
    (None, codec.NPY, codec.NPY),
    ("", codec.SAFETENSORS, codec.SAFETENSORS),
    ("*/*", codec.SAFETENSORS, codec.SAFETENSORS),
    ("application/vnd.safetensors", codec.NPY, codec.SAFETENSORS),
    ("application/x-npy;q=0.5, application/vnd.safetensors", codec.NPY, codec.SAFETENSORS),
    ("text/html, application/*;q=0.1", codec.NPY, codec.NPY),
])
def test_negotiate(accept, request_type, expected):
    assert codec.negotiate(accept, request_type) == expected


def test_negotiate_refuses_other_formats():
    with pytest.raises(UnsupportedMediaTypeError):
        codec.negotiate("text/html", codec.NPY)
    with pytest.raises(UnsupportedMediaTypeError):
        codec.negotiate("application/x-npy;q=0", codec.NPY)


def test_media_type_of():
    assert codec.media_type_of("Application/X-NPY; charset=binary") == codec.NPY
    for value in (None, "application/json", "application/octet-stream"):
        with pytest.raises(UnsupportedMediaTypeError):
            codec.media_type_of(value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_raw_decoding_keeps_the_bytes_and_encodes_the_same(dtype: torch.dtype):
    t = torch.randn(2, 3, 4, 5, dtype=torch.float64).to(dtype)
    bodies = [(codec.SAFETENSORS, bytearray(st_save({"x": t})))]
    if dtype != torch.bfloat16:
        bodies.append((codec.NPY, bytearray(npy_bytes(t.numpy()))))
    for media, body in bodies:
        raw = codec.decode_raw(body, media)
        assert isinstance(raw, codec.RawTensor)
        assert (raw.shape, raw.dtype) == ((2, 3, 4, 5), dtype)
        assert raw.data.obj is body  # a view of the request's bytes, not a copy
        assert torch.equal(raw.tensor(), t)
        assert torch.equal(codec.decode(body, media), t)
        assert codec.encode(raw, media) == codec.encode(t, media)
        flat = raw.reshape((6, 4, 5))
        assert codec.encode(flat, media) == codec.encode(t.reshape(6, 4, 5), media)
    with pytest.raises(ValueError, match="cannot hold"):
        raw.reshape((7, 4, 5))


def test_raw_decoding_of_a_fortran_order_npy_is_a_torch_view():
    arr = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    got = codec.decode_raw(bytearray(npy_bytes(arr)), codec.NPY)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), arr)
