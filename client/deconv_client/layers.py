"""What the server says about a layer (``GET /v1/layers/{name}``), as a typed, read-only object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import CodecError

__all__ = ["LayerInfo"]


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    a, b = value
    return (int(a), int(b))


@dataclass(frozen=True)
class LayerInfo:
    """One served ConvTranspose2d layer: its geometry, io dtype and limits.

    Weights are ``[in_channels, out_channels / groups, kH, kW]``; the input is ``[N, in_channels, H, W]`` or
    ``[in_channels, H, W]`` of dtype :attr:`dtype`. Fields the server leaves out are ``None``;
    :attr:`raw` keeps the whole JSON object, fields this client does not know included.
    """

    name: str
    in_channels: int
    out_channels: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    output_padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    dtype: str
    bias: bool | None = None
    precision: str | None = None
    max_batch_size: int | None = None
    max_batch_bytes: int | None = None
    max_queue_delay_ms: float | None = None
    max_queue_size: int | None = None
    max_height: int | None = None
    max_width: int | None = None
    input_shape: tuple[int, ...] | None = None
    output_size: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayerInfo:
        """Build from the server's JSON object; raises :class:`CodecError` if a required field is missing."""
        try:
            return cls(
                name=str(data["name"]),
                in_channels=int(data["in_channels"]),
                out_channels=int(data["out_channels"]),
                kernel_size=_pair(data["kernel_size"]),
                stride=_pair(data.get("stride", 1)),
                padding=_pair(data.get("padding", 0)),
                output_padding=_pair(data.get("output_padding", 0)),
                dilation=_pair(data.get("dilation", 1)),
                groups=int(data.get("groups", 1)),
                dtype=str(data["dtype"]),
                bias=data.get("bias"),
                precision=data.get("precision"),
                max_batch_size=data.get("max_batch_size"),
                max_batch_bytes=data.get("max_batch_bytes"),
                max_queue_delay_ms=data.get("max_queue_delay_ms"),
                max_queue_size=data.get("max_queue_size"),
                max_height=data.get("max_height"),
                max_width=data.get("max_width"),
                input_shape=tuple(data["input_shape"]) if data.get("input_shape") is not None else None,
                output_size=data.get("output_size"),
                raw=dict(data),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"unexpected layer description from the server ({exc!r}): {dict(data)!r}") from None

    def output_hw(self, height: int, width: int) -> tuple[int, int]:
        """The output's spatial size for an input of ``height`` x ``width``.

        ``H_out = (H - 1) * stride - 2 * padding + dilation * (kH - 1) + output_padding + 1`` (same for W).
        """

        def axis(size: int, i: int) -> int:
            k, s, p, d, op = (
                self.kernel_size[i],
                self.stride[i],
                self.padding[i],
                self.dilation[i],
                self.output_padding[i],
            )
            return (size - 1) * s - 2 * p + d * (k - 1) + op + 1

        return axis(height, 0), axis(width, 1)
