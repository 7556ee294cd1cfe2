"""The wire codec: round trips, interop with numpy and the safetensors package, zero copies, and refusals."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from deconv_client.codec import (
    NPY_MEDIA_TYPE,
    SAFETENSORS_MEDIA_TYPE,
    RawTensor,
    decode_npy,
    decode_safetensors,
    encode_npy,
    encode_safetensors,
    encode_safetensors_array,
    media_type_of,
)
from deconv_client.errors import CodecError

from .conftest import npy_bytes

DTYPES = ["float16", "float32", "float64", "int64", "uint8", "bool", "complex64"]
SHAPES = [(2, 3, 4, 5), (3, 1, 7), (0, 3, 4, 4), ()]


def _random(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(shape) * 10).astype(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_npy_round_trip_and_numpy_reads_it(dtype: str, shape: tuple[int, ...]) -> None:
    x = _random(shape, dtype)
    payload = encode_npy(x)
    body = payload.tobytes()
    assert payload.media_type == NPY_MEDIA_TYPE
    assert payload.nbytes == len(body)
    assert len(payload.chunks[0]) % 64 == 0  # data starts 64-byte aligned, as numpy writes it
    loaded = np.load(io.BytesIO(body), allow_pickle=False)
    decoded = decode_npy(body)
    for y in (loaded, decoded):
        assert y.dtype == x.dtype
        assert y.shape == x.shape
        np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("fortran", [False, True])
def test_decode_reads_what_numpy_writes(version: tuple[int, int], fortran: bool) -> None:
    x = _random((2, 3, 5, 7), "float32")
    if fortran:
        x = np.asfortranarray(x)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, x, version=version, allow_pickle=False)
    y = decode_npy(buf.getvalue())
    assert y.shape == x.shape
    np.testing.assert_array_equal(y, x)


def test_encode_converts_big_endian_and_strided_inputs() -> None:
    x = _random((2, 3, 8, 8), "float32")
    big = x.astype(">f4")
    strided = x[:, :, ::2, 1::3]
    for source, expected in ((big, x), (strided, np.ascontiguousarray(strided))):
        y = decode_npy(encode_npy(source).tobytes())
        assert y.dtype == np.dtype("<f4")
        np.testing.assert_array_equal(y, expected)


def test_encode_does_not_copy_the_data() -> None:
    x = _random((4, 8, 64, 64), "float32")  # 512 KiB
    payload = encode_npy(x)
    views = payload.chunks[1:]
    assert all(isinstance(v, memoryview) for v in views)
    assert all(np.shares_memory(np.frombuffer(v, np.uint8), x) for v in views)
    x[0, 0, 0, 0] = 12345.0  # a view sees the change: nothing was copied
    assert decode_npy(payload.tobytes())[0, 0, 0, 0] == 12345.0


def test_large_payloads_go_out_in_bounded_slices() -> None:
    x = np.zeros((3, 1024, 1024), np.float32)  # 12 MiB
    payload = encode_npy(x)
    assert len(payload.chunks) == 1 + 12
    assert max(len(c) for c in payload.chunks[1:]) == 1 << 20
    assert payload.nbytes == len(payload.chunks[0]) + x.nbytes


def test_decode_views_the_buffer_writable_from_bytearray() -> None:
    x = _random((2, 3, 4, 4), "float64")
    body = bytearray(npy_bytes(x))
    y = decode_npy(body)
    assert y.flags.writeable
    assert np.shares_memory(y, np.frombuffer(body, np.uint8))
    y_ro = decode_npy(bytes(body))
    assert not y_ro.flags.writeable


class _Boom:
    """Unpickling this sets a flag: a decoder that unpickles would trip it."""

    tripped = False

    def __reduce__(self) -> tuple[object, ...]:
        return (_trip, ())


def _trip() -> None:
    _Boom.tripped = True


def test_object_arrays_are_refused_not_unpickled() -> None:
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = _Boom(), 1
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=True)
    with pytest.raises(CodecError, match="never unpickled"):
        decode_npy(buf.getvalue())
    assert not _Boom.tripped
    with pytest.raises(CodecError):
        encode_npy(arr)


def _npy_with_header(header: str, data: bytes = b"") -> bytes:
    head = header.encode("latin1") + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head + data


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"not an npy", "bad magic"),
        (b"\x93NUMPY\x09\x00\x10\x00", "version"),
        (b"\x93NUMPY\x01\x00\xff\x00{'descr'", "truncated"),
        (_npy_with_header("__import__('os').system('true')"), "unreadable"),
        (_npy_with_header("[1, 2]"), "must be a dict"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}"), "exactly"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}"), "bad .npy shape"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2.5,)}"), "bad .npy shape"),
        (_npy_with_header("{'descr': '<U4', 'fortran_order': False, 'shape': (1,)}", b"x" * 16), "not allowed"),
        (_npy_with_header("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}"), "structured"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,)}", b"x" * 4), "fortran_order"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", b"\0" * 23), "23 bytes"),
        (_npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", b"\0" * 25), "25 bytes"),
    ],
)
def test_decode_npy_refuses_bad_payloads(body: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_npy(body)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "bool"])
def test_safetensors_round_trip_and_interop(dtype: str, shape: tuple[int, ...]) -> None:
    x = _random(shape, dtype)
    payload = encode_safetensors_array(x, "input")
    body = payload.tobytes()
    assert payload.media_type == SAFETENSORS_MEDIA_TYPE
    assert payload.nbytes == len(body)
    assert (8 + struct.unpack("<Q", body[:8])[0]) % 8 == 0  # data 8-byte aligned
    loaded = safetensors.numpy.load(body)
    assert list(loaded) == ["input"]
    np.testing.assert_array_equal(loaded["input"], x)
    tensor = decode_safetensors(safetensors.numpy.save({"output": x}))
    assert tensor.name == "output"
    assert tensor.shape == x.shape
    np.testing.assert_array_equal(tensor.to_numpy(), x)


def test_safetensors_bfloat16_through_torch() -> None:
    x = torch.randn(2, 3, 4, 5).to(torch.bfloat16)
    tensor = decode_safetensors(safetensors.torch.save({"output": x}))
    assert tensor.dtype == "BF16"
    y = torch.frombuffer(bytearray(tensor.data), dtype=torch.bfloat16).reshape(tensor.shape)
    assert torch.equal(y, x)
    with pytest.raises(CodecError, match="no numpy equivalent"):
        tensor.to_numpy()
    raw = memoryview(x.reshape(-1).view(torch.uint8).numpy())
    ours = encode_safetensors(RawTensor("BF16", tuple(x.shape), raw, "input")).tobytes()
    assert torch.equal(safetensors.torch.load(ours)["input"], x)


def test_decode_safetensors_is_a_view() -> None:
    x = _random((2, 3, 4), "float32")
    body = bytearray(safetensors.numpy.save({"t": x}))
    y = decode_safetensors(body).to_numpy()
    assert y.flags.writeable
    assert np.shares_memory(y, np.frombuffer(body, np.uint8))


def _st(header: dict[str, object], data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\x01\x02", "shorter"),
        (struct.pack("<Q", 1 << 40) + b"{}", "over the"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (struct.pack("<Q", 3) + b"{{{", "unreadable"),
        (_st([], b""), "JSON object"),  # type: ignore[arg-type]
        (_st({}, b""), "exactly one tensor"),
        (_st({"__metadata__": {"a": "b"}}, b""), "found 0"),
        (
            _st(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                b"\0" * 8,
            ),
            "found 2",
        ),
        (_st({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unsupported"),
        (_st({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "bad safetensors shape"),
        (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, b"\0" * 8), "data_offsets"),
        (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "exactly"),
        (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8"),
        (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12), "exactly"),
    ],
)
def test_decode_safetensors_refuses_bad_payloads(body: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        decode_safetensors(body)


def test_media_type_from_header_or_magic() -> None:
    npy = npy_bytes(np.zeros(2, np.float32))
    st = safetensors.numpy.save({"t": np.zeros(2, np.float32)})
    assert media_type_of("application/x-npy; charset=binary", st) == NPY_MEDIA_TYPE  # the header wins
    assert media_type_of("Application/Vnd.Safetensors", npy) == SAFETENSORS_MEDIA_TYPE
    assert media_type_of(None, npy) == NPY_MEDIA_TYPE
    assert media_type_of("application/octet-stream", st) == SAFETENSORS_MEDIA_TYPE
    with pytest.raises(CodecError, match="text/html"):
        media_type_of("text/html", b"<html>")
