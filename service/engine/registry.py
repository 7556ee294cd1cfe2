"""The layer repository: one ``<name>.json`` config and one ``<name>.safetensors`` weights file per layer.

Config (JSON object; unknown keys are errors)::

    {"name": "up1", "in_channels": 64, "out_channels": 32, "kernel_size": [4, 4], "stride": 2, "padding": 1,
     "output_padding": 0, "dilation": 1, "groups": 1, "bias": true, "dtype": "float32", "precision": "tf32",
     "max_batch_size": 64, "max_batch_bytes": 268435456, "max_queue_delay_ms": 2.0, "max_queue_size": 256,
     "max_height": 1024, "max_width": 1024, "description": "..."}

Pairs (``kernel_size``, ``stride``, ``padding``, ``output_padding``, ``dilation``) take an int or
``[height, width]``. The batching limits are optional: a layer without them gets the server's defaults
(``DECONV_MAX_BATCH_SIZE`` ...). ``precision`` is ``"tf32"`` (the default) or ``"fp32"`` (exact) for float32
layers; other dtypes compute natively (``"bf16"``, ``"fp16"``, ``"fp64"``, implied).

Weights: ``weight`` ``[C_in, C_out/groups, kH, kW]`` and, when ``bias`` is true, ``bias`` ``[C_out]``, both in the
layer's dtype, nothing else.

``load_repository`` checks everything and raises one ``RepositoryError`` that lists every problem, each naming
the file and the field; the server does not start with a half-configured repository.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from kernels.functional import ConvArgs, ConvTranspose2dArgumentError, normalize_args, output_size
from service.config import Settings

log = logging.getLogger("deconv.service")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")

# The arithmetic each io dtype allows: float32 layers choose TF32 tensor cores or exact fp32; the others compute
# natively (bf16/fp16 operands, fp32 accumulation; fp64). The first entry is the default.
PRECISIONS = {"float32": ("tf32", "fp32"), "bfloat16": ("bf16",), "float16": ("fp16",), "float64": ("fp64",)}

# Norm-wise relative error vs float64 that the self-test allows, by precision.
TOLERANCES = {"fp32": 1e-5, "tf32": 2e-3, "bf16": 2e-2, "fp16": 2e-2, "fp64": 1e-10}


class RepositoryError(ValueError):
    """The layer repository is invalid; ``problems`` holds one line per problem, each naming file and field."""

    def __init__(self, root: Path, problems: list[str]) -> None:
        self.root = root
        self.problems = problems
        lines = "\n  ".join(problems)
        super().__init__(f"layer repository {root} is invalid ({len(problems)} problem(s)):\n  {lines}")


# Most warm_shapes entries of one layer: each costs startup time on every worker at every batch-size bucket.
MAX_WARM_SHAPES = 8


def _pair_field(value: Any) -> tuple[int, int]:
    if isinstance(value, bool):
        raise ValueError("must be an int or a pair of ints [height, width]")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (int(value[0]), int(value[1]))
    raise ValueError(f"must be an int or a pair of ints [height, width], got {value!r}")


class LayerConfig(BaseModel):
    """One layer's config file, validated. Pairs are normalised to ``(height, width)`` tuples."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    name: str
    in_channels: int = Field(ge=1)
    out_channels: int = Field(ge=1)
    kernel_size: tuple[int, int]
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    output_padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = Field(1, ge=1)
    bias: bool
    dtype: Literal["float32", "float16", "bfloat16", "float64"]
    precision: Literal["tf32", "fp32", "bf16", "fp16", "fp64"] = None  # type: ignore[assignment]
    max_batch_size: int | None = Field(None, ge=1)
    max_batch_bytes: int | None = Field(None, ge=1)
    max_queue_delay_ms: float | None = Field(None, ge=0.0)
    max_queue_size: int | None = Field(None, ge=1)
    max_height: int = Field(1024, ge=1)
    max_width: int = Field(1024, ge=1)
    # Input sizes [H, W] run at startup on every worker at each batch-size bucket (powers of two up to the max
    # batch), so that kernels are loaded and, with Settings.tune, measured before the first request of that size.
    warm_shapes: tuple[tuple[int, int], ...] = ()
    description: str = ""

    @field_validator("kernel_size", "stride", "padding", "output_padding", "dilation", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> tuple[int, int]:
        return _pair_field(value)

    @field_validator("warm_shapes", mode="before")
    @classmethod
    def _warm_shapes(cls, value: Any) -> tuple[tuple[int, int], ...]:
        if not isinstance(value, list | tuple) or len(value) > MAX_WARM_SHAPES or not all(
            isinstance(v, list | tuple) and len(v) == 2 for v in value
        ):
            raise ValueError(f"must be a list of at most {MAX_WARM_SHAPES} [height, width] pairs, got {value!r}")
        return tuple(_pair_field(v) for v in value)

    @field_validator("kernel_size", "stride", "dilation")
    @classmethod
    def _positive(cls, value: tuple[int, int]) -> tuple[int, int]:
        if min(value) < 1:
            raise ValueError(f"must be positive, got {list(value)}")
        return value

    @field_validator("padding", "output_padding")
    @classmethod
    def _non_negative(cls, value: tuple[int, int]) -> tuple[int, int]:
        if min(value) < 0:
            raise ValueError(f"must be non-negative, got {list(value)}")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.fullmatch(value):
            raise ValueError("must be 1-128 characters from A-Z a-z 0-9 _ - (starting with a letter or digit)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_precision(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("precision") is None and data.get("dtype") in PRECISIONS:
            data = {**data, "precision": PRECISIONS[data["dtype"]][0]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> LayerConfig:
        allowed = PRECISIONS[self.dtype]
        if self.precision not in allowed:
            raise ValueError(f"precision {self.precision!r} does not fit dtype {self.dtype}; "
                             f"use {' or '.join(repr(p) for p in allowed)}")
        if self.in_channels % self.groups:
            raise ValueError(f"in_channels ({self.in_channels}) must be a multiple of groups ({self.groups})")
        if self.out_channels % self.groups:
            raise ValueError(f"out_channels ({self.out_channels}) must be a multiple of groups ({self.groups})")
        for axis in range(2):
            op, s, d = self.output_padding[axis], self.stride[axis], self.dilation[axis]
            if op >= max(s, d):
                raise ValueError(
                    f"output_padding {list(self.output_padding)} must be smaller than max(stride, dilation) "
                    f"in each axis (stride {list(self.stride)}, dilation {list(self.dilation)})"
                )
        try:
            normalize_args(self.stride, self.padding, self.output_padding, self.groups, self.dilation)
        except ConvTranspose2dArgumentError as exc:
            raise ValueError(str(exc)) from None
        for h, w in self.warm_shapes:
            if not (1 <= h <= self.max_height and 1 <= w <= self.max_width):
                raise ValueError(f"warm_shapes entry {[h, w]} must lie within 1..max_height ({self.max_height}) and "
                                 f"1..max_width ({self.max_width})")
        return self


@dataclass(frozen=True)
class BatchLimits:
    """Batching limits of one layer (the config's own, else the server's defaults)."""

    max_batch_size: int
    max_batch_bytes: int
    max_queue_delay_ms: float
    max_queue_size: int


@dataclass(frozen=True)
class Layer:
    """A validated layer: its config, its CPU weights and its effective batching limits."""

    config: LayerConfig
    weight: torch.Tensor  # [C_in, C_out/groups, kH, kW], layer dtype, CPU
    bias: torch.Tensor | None  # [C_out], layer dtype, CPU
    limits: BatchLimits

    @property
    def name(self) -> str:
        """The layer's name (URL and KServe model name)."""
        return self.config.name

    @property
    def dtype(self) -> torch.dtype:
        """The layer's io dtype as a torch dtype."""
        return DTYPES[self.config.dtype]

    @property
    def tolerance(self) -> float:
        """Norm-wise relative error vs float64 that the self-test allows."""
        return TOLERANCES[self.config.precision]

    @property
    def kernel_precision(self) -> str | None:
        """The ``precision`` argument of ``kernels.conv_transpose2d`` (float32 layers only)."""
        return self.config.precision if self.config.dtype == "float32" else None

    @functools.cached_property
    def args(self) -> ConvArgs:
        """The layer's convolution arguments, normalized once."""
        c = self.config
        return normalize_args(c.stride, c.padding, c.output_padding, c.groups, c.dilation)

    @functools.cached_property
    def _sample_bytes(self) -> dict[tuple[int, int], int]:
        return {}  # (H, W) -> output bytes of one sample; filled by output_bytes

    def output_bytes(self, n: int, h: int, w: int) -> int:
        """Bytes of the output of ``n`` samples of ``h`` x ``w`` in the layer's dtype (per-request hot path: the
        size of one sample is computed once per input size)."""
        cache = self._sample_bytes
        per = cache.get((h, w))
        if per is None:
            h_out, w_out = self.output_hw(h, w)
            per = self.config.out_channels * h_out * w_out * self.dtype.itemsize
            if len(cache) >= 4096:  # bounded: clients choose the sizes
                cache.clear()
            cache[(h, w)] = per
        return n * per

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        """Output height and width for an ``h`` x ``w`` input."""
        c = self.config
        return (
            output_size(h, c.kernel_size[0], c.stride[0], c.padding[0], c.output_padding[0], c.dilation[0]),
            output_size(w, c.kernel_size[1], c.stride[1], c.padding[1], c.output_padding[1], c.dilation[1]),
        )

    def output_formula(self) -> str:
        """The output-size formula with this layer's numbers, for both axes."""
        c = self.config
        parts = []
        for axis, (big, small) in enumerate((("H_out", "H"), ("W_out", "W"))):
            parts.append(
                f"{big} = ({small} - 1) * {c.stride[axis]} - 2 * {c.padding[axis]} + {c.dilation[axis]} * "
                f"({c.kernel_size[axis]} - 1) + {c.output_padding[axis]} + 1"
            )
        return "; ".join(parts)

    def describe(self) -> dict[str, Any]:
        """The ``GET /v1/layers/{name}`` object (docs/protocol.md)."""
        c = self.config
        return {
            "name": c.name,
            "in_channels": c.in_channels,
            "out_channels": c.out_channels,
            "kernel_size": list(c.kernel_size),
            "stride": list(c.stride),
            "padding": list(c.padding),
            "output_padding": list(c.output_padding),
            "dilation": list(c.dilation),
            "groups": c.groups,
            "bias": c.bias,
            "dtype": c.dtype,
            "precision": c.precision,
            "max_batch_size": self.limits.max_batch_size,
            "max_batch_bytes": self.limits.max_batch_bytes,
            "max_queue_delay_ms": self.limits.max_queue_delay_ms,
            "max_queue_size": self.limits.max_queue_size,
            "max_height": c.max_height,
            "max_width": c.max_width,
            "warm_shapes": [list(hw) for hw in c.warm_shapes],
            "input_shape": [-1, c.in_channels, -1, -1],
            "output_shape": [-1, c.out_channels, -1, -1],
            "output_size": self.output_formula(),
            "description": c.description,
        }


class Registry:
    """Every layer of the repository, by name (sorted)."""

    def __init__(self, root: Path, layers: dict[str, Layer]) -> None:
        self.root = root
        self._layers = dict(sorted(layers.items()))

    def get(self, name: str) -> Layer | None:
        """The layer called ``name``, or None."""
        return self._layers.get(name)

    def names(self) -> list[str]:
        """Layer names, sorted."""
        return list(self._layers)

    def __iter__(self) -> Iterator[Layer]:
        return iter(self._layers.values())

    def __len__(self) -> int:
        return len(self._layers)


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root.parent))
    except ValueError:
        return str(path)


def _outside(path: Path, root: Path) -> str | None:
    # Every file a layer reads lies inside the repository: a symbolic link out of it is refused.
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a link loop
        inside = False
    return None if inside else "resolves to outside the layer repository (symbolic link); refused"


def _config_problems(exc: ValidationError, where: str) -> list[str]:
    problems = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{where}: field '{loc}': {msg}" if loc else f"{where}: {msg}")
    return problems


def _check_weights(cfg: LayerConfig, tensors: dict[str, torch.Tensor], where: str) -> list[str]:
    problems = []
    dtype = DTYPES[cfg.dtype]
    expected = {"weight": [cfg.in_channels, cfg.out_channels // cfg.groups, *cfg.kernel_size]}
    if cfg.bias:
        expected["bias"] = [cfg.out_channels]
    for key in sorted(set(tensors) - set(expected)):
        hint = " (the config says bias: false)" if key == "bias" else ""
        problems.append(f"{where}: tensor '{key}': not expected{hint}; the file holds 'weight' and 'bias' only")
    for key, shape in expected.items():
        t = tensors.get(key)
        if t is None:
            hint = " (the config says bias: true)" if key == "bias" else ""
            problems.append(f"{where}: tensor '{key}': missing{hint}")
            continue
        if list(t.shape) != shape:
            layout = "[C_in, C_out/groups, kH, kW]" if key == "weight" else "[C_out]"
            problems.append(f"{where}: tensor '{key}': shape {list(t.shape)}, the config needs {shape} {layout}")
        if t.dtype != dtype:
            problems.append(f"{where}: tensor '{key}': dtype {t.dtype}, the config's dtype is {cfg.dtype}")
        elif t.numel() and not t.is_meta and not bool(torch.isfinite(t).all()):
            problems.append(f"{where}: tensor '{key}': holds NaN or infinity")
    return problems


# safetensors dtype codes of the dtypes a layer may have (anything else fails the dtype check by name).
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _read_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors as meta tensors (shape and dtype from its header; no data read or allocated)."""
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
            sl = f.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8)
            tensors[key] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    return tensors


def load_layer(config_path: Path, defaults: BatchLimits, root: Path | None = None,
               weights: bool = True) -> tuple[Layer | None, list[str]]:
    """Read and check one layer (config + weights). Returns the layer, or None and the problems found.

    With ``weights=False`` only the weights file's header is read: the layer's tensors are meta tensors (shape and
    dtype checked, values neither read nor checked), for processes that validate requests but never compute.
    """
    root = root or config_path.parent
    where = _rel(config_path, root)
    outside = _outside(config_path, root)
    if outside:
        return None, [f"{where}: {outside}"]
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"{where}: cannot read: {exc}"]
    except json.JSONDecodeError as exc:
        return None, [f"{where}: not valid JSON: {exc}"]
    if not isinstance(raw, dict):
        return None, [f"{where}: must hold a JSON object"]
    try:
        cfg = LayerConfig.model_validate(raw)
    except ValidationError as exc:
        return None, _config_problems(exc, where)
    if cfg.name != config_path.stem:
        return None, [f"{where}: field 'name': {cfg.name!r} must equal the file name's stem {config_path.stem!r}"]

    weights_path = config_path.with_suffix(".safetensors")
    wwhere = _rel(weights_path, root)
    if not weights_path.is_file():
        return None, [f"{wwhere}: missing (weights of layer {cfg.name!r})"]
    outside = _outside(weights_path, root)
    if outside:
        return None, [f"{wwhere}: {outside}"]
    try:
        # safetensors: no pickle, no code
        tensors = load_file(str(weights_path), device="cpu") if weights else _read_shapes(weights_path)
    except (SafetensorError, OSError, ValueError) as exc:
        return None, [f"{wwhere}: cannot read as safetensors: {exc}"]
    problems = _check_weights(cfg, tensors, wwhere)
    if problems:
        return None, problems
    limits = BatchLimits(
        max_batch_size=cfg.max_batch_size if cfg.max_batch_size is not None else defaults.max_batch_size,
        max_batch_bytes=cfg.max_batch_bytes if cfg.max_batch_bytes is not None else defaults.max_batch_bytes,
        max_queue_delay_ms=(cfg.max_queue_delay_ms if cfg.max_queue_delay_ms is not None
                            else defaults.max_queue_delay_ms),
        max_queue_size=cfg.max_queue_size if cfg.max_queue_size is not None else defaults.max_queue_size,
    )
    weight = tensors["weight"].contiguous()
    bias = tensors["bias"].contiguous() if cfg.bias else None
    return Layer(cfg, weight, bias, limits), []


def load_repository(root: Path, defaults: BatchLimits, weights: bool = True) -> Registry:
    """Load and check every layer under ``root`` (``weights=False``: shapes only, see ``load_layer``).

    Files other than ``*.json`` and ``*.safetensors`` (a README, the script that made the weights) are ignored.

    Raises:
        RepositoryError: the directory is missing or empty, or any layer is invalid; lists every problem.
    """
    root = Path(root)
    if not root.is_dir():
        raise RepositoryError(root, [f"{root}: not a directory (set DECONV_LAYER_REPOSITORY)"])
    layers: dict[str, Layer] = {}
    problems: list[str] = []
    configs = sorted(root.glob("*.json"))
    for path in configs:
        layer, found = load_layer(path, defaults, root, weights)
        problems.extend(found)
        if layer is not None:
            layers[layer.name] = layer
    config_stems = {p.stem for p in configs}
    for path in sorted(root.glob("*.safetensors")):
        if path.stem not in config_stems:
            problems.append(f"{_rel(path, root)}: weights without a config (expected {path.stem}.json)")
    if not configs:
        problems.append(f"{root}: holds no layer configs (*.json)")
    if problems:
        raise RepositoryError(root, problems)
    return Registry(root, layers)


def batch_limits(settings: Settings) -> BatchLimits:
    """The batching limits of a layer that sets none (``DECONV_MAX_BATCH_SIZE`` ...)."""
    return BatchLimits(settings.max_batch_size, settings.max_batch_bytes, settings.max_queue_delay_ms,
                       settings.max_queue_size)


def load_registry(settings: Settings, weights: bool = True) -> Registry:
    """``load_repository`` of the settings' layer repository, a problem logged before it is raised; ``weights=False``
    reads only the weights' shapes and dtypes (meta tensors).

    Raises:
        RepositoryError: the repository is invalid.
    """
    try:
        return load_repository(settings.layer_repository, batch_limits(settings), weights)
    except RepositoryError as exc:
        log.error("%s", exc)
        raise
