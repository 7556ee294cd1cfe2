"""The caller's tensor (numpy or torch) to a request body, and the response body back to the same kind.

torch is imported only when the caller passes a torch tensor, so the client runs with numpy alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from . import wire
from .codec import (
    NPY_MEDIA_TYPE,
    SAFETENSORS_MEDIA_TYPE,
    Payload,
    RawTensor,
    decode_npy,
    decode_safetensors,
    encode_npy,
    encode_safetensors,
    encode_safetensors_array,
    media_type_of,
)
from .errors import CodecError

WireFormat = Literal["npy", "safetensors"]

_MEDIA_TYPES: dict[str, str] = {"npy": NPY_MEDIA_TYPE, "safetensors": SAFETENSORS_MEDIA_TYPE}
_INPUT_NAME = "input"
# The dtypes the server computes in (a layer's dtype is one of them); numpy has no bfloat16.
SERVED_DTYPES = ("float32", "float16", "bfloat16", "float64")
_SERVED_NUMPY = frozenset(np.dtype(name) for name in SERVED_DTYPES if name != "bfloat16")


def check_served_dtype(x: Any) -> None:
    """Raise :class:`CodecError` naming ``x``'s own dtype when the server takes no tensor of that dtype (before
    anything is encoded or sent: the server's answer would name the wire's dtype code instead)."""
    if isinstance(x, np.ndarray):
        if x.dtype.newbyteorder("=") not in _SERVED_NUMPY:  # any byte order: encoding makes it little-endian
            raise CodecError(f"dtype {x.dtype} cannot be sent: the server takes float32, float16 and float64 arrays "
                             "(and bfloat16 torch tensors); convert it, e.g. x.astype(np.float32)")
    elif str(x.dtype).removeprefix("torch.") not in SERVED_DTYPES:
        raise CodecError(f"dtype {x.dtype} cannot be sent: the server takes float32, float16, bfloat16 and float64 "
                         "tensors; convert it, e.g. x.float()")


@dataclass(frozen=True)
class EncodedInput:
    """A request body and the function that turns the response body into the caller's kind of tensor."""

    payload: Payload
    shape: tuple[int, ...]
    restore: Callable[[bytes | bytearray, str | None], Any]


def is_torch_tensor(x: object) -> bool:
    """True for a ``torch.Tensor``, without importing torch when the caller never did."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _check_format(wire_format: str | None) -> None:
    if wire_format is not None and wire_format not in _MEDIA_TYPES:
        raise ValueError(f"wire_format must be 'npy', 'safetensors' or None, not {wire_format!r}")


def _check_output(out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> None:
    # The server keeps the rank and, for a batch, the batch size; anything else is a broken response.
    if len(out_shape) != len(in_shape) or (len(in_shape) == 4 and out_shape[0] != in_shape[0]):
        raise CodecError(f"the server returned shape {list(out_shape)} for an input of shape {list(in_shape)}")


def encode_input(x: Any, wire_format: str | None = None) -> EncodedInput:
    """Encode a numpy array or torch tensor for ``POST /deconv``.

    ``wire_format=None`` picks safetensors when the dtype needs it (bfloat16) and ``.npy`` otherwise.
    """
    _check_format(wire_format)
    if isinstance(x, np.ndarray):
        if x.dtype.kind in "biufc":  # other kinds (strings, objects, dates): the codec says they are not tensors
            check_served_dtype(x)
        return _encode_numpy(x, wire_format)
    if is_torch_tensor(x):
        check_served_dtype(x)
        return _encode_torch(x, wire_format)
    raise TypeError(f"expected a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")


def _encode_numpy(x: np.ndarray, wire_format: str | None) -> EncodedInput:
    shape = tuple(x.shape)
    payload = encode_safetensors_array(x, _INPUT_NAME) if wire_format == "safetensors" else encode_npy(x)

    def restore(body: bytes | bytearray, content_type: str | None) -> np.ndarray:
        if media_type_of(content_type, body) == NPY_MEDIA_TYPE:
            out = decode_npy(body)
        else:
            out = decode_safetensors(body).to_numpy()
        _check_output(out.shape, shape)
        return out

    return EncodedInput(payload, shape, restore)


def _torch_dtypes() -> dict[str, Any]:
    import torch

    # The wire's dtype table names each dtype as numpy and torch do.
    return {code: getattr(torch, d.name) for code, d in wire.DTYPES.items() if hasattr(torch, d.name)}


def _encode_torch(x: Any, wire_format: str | None) -> EncodedInput:
    import torch

    codes = {dtype: code for code, dtype in _torch_dtypes().items()}
    device, dtype = x.device, x.dtype
    # On the CPU and contiguous already, none of these copies.
    cpu = x.detach().resolve_conj().resolve_neg().cpu().contiguous()
    shape = tuple(cpu.shape)
    fmt = wire_format or ("safetensors" if dtype == torch.bfloat16 else "npy")
    if fmt == "npy":
        if dtype == torch.bfloat16:
            raise CodecError("bfloat16 tensors cannot be sent as .npy; use wire_format='safetensors'")
        payload = encode_npy(cpu.numpy())
    else:
        if dtype not in codes:
            raise CodecError(f"dtype {dtype} cannot be sent as safetensors")
        raw = memoryview(cpu.reshape(-1).view(torch.uint8).numpy())
        payload = encode_safetensors(RawTensor(codes[dtype], shape, raw, _INPUT_NAME))

    def restore(body: bytes | bytearray, content_type: str | None) -> Any:
        if media_type_of(content_type, body) == NPY_MEDIA_TYPE:
            arr = decode_npy(body)
            if not arr.dtype.isnative:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            out = torch.from_numpy(arr)
        else:
            tensor = decode_safetensors(body)
            torch_dtype = _torch_dtypes().get(tensor.dtype)
            if torch_dtype is None:
                raise CodecError(f"safetensors dtype {tensor.dtype} has no torch equivalent here")
            if len(tensor.data) == 0:
                out = torch.empty(tensor.shape, dtype=torch_dtype)
            else:
                out = torch.frombuffer(tensor.data, dtype=torch_dtype).reshape(tensor.shape)
        _check_output(tuple(out.shape), shape)
        return out if device.type == "cpu" else out.to(device)

    return EncodedInput(payload, shape, restore)


def media_type_for(wire_format: str) -> str:
    """The Content-Type of a wire format name (``"npy"`` or ``"safetensors"``)."""
    _check_format(wire_format)
    return _MEDIA_TYPES[wire_format]
