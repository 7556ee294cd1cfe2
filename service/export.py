"""Export a layer repository from a PyTorch model: one layer per ``nn.ConvTranspose2d``.

Each layer's configuration (channels, kernel_size, stride, padding, output_padding, dilation, groups, bias) and
weights are copied exactly; the weights are cast only when a ``dtype`` is asked for.

Python::

    from service.export import export_model
    export_model(generator, "my_layers", dtype="float32")

Command line (``deconv-export``, or ``python -m service.export``)::

    deconv-export mypkg.models:Generator --kwargs '{"nz": 100}' --checkpoint gen.pt --out my_layers

The model comes from ``module.path:factory`` (a callable returning an ``nn.Module``, or a module attribute that
is one), imported from the current directory, ``--import-path`` directories, ``PYTHONPATH`` or the installed
packages; ``--checkpoint`` loads a state dict into it with ``torch.load(weights_only=True)`` (never unpickling
code) or from a ``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from service.engine.registry import DTYPES, NAME_PATTERN, BatchLimits, load_layer

log = logging.getLogger("deconv.export")

LIMIT_KEYS = ("max_batch_size", "max_batch_bytes", "max_queue_delay_ms", "max_queue_size", "max_height",
              "max_width")
# The limit flags' help: each is written into every layer's config under its name (docs/operations.md).
LIMIT_HELP = {
    "max_batch_size": "most samples in one kernel call (default: the server's DECONV_MAX_BATCH_SIZE)",
    "max_batch_bytes": "most output bytes in one kernel call (default: the server's DECONV_MAX_BATCH_BYTES)",
    "max_queue_delay_ms": "longest wait in ms for more requests before a batch runs when a worker is free "
                          "(default: the server's DECONV_MAX_QUEUE_DELAY_MS)",
    "max_queue_size": "most requests waiting for the layer, then 429 (default: the server's DECONV_MAX_QUEUE_SIZE)",
    "max_height": "largest input height accepted (default: 1024)",
    "max_width": "largest input width accepted (default: 1024)",
}


class ExportError(ValueError):
    """The model cannot be exported as asked."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                   "fp64": "float64", "double": "float64"}
        name = aliases.get(name, name)
        if name in DTYPES:
            return name
    else:
        for name, dt in DTYPES.items():
            if dt == dtype:
                return name
    raise ExportError(f"dtype {dtype!r} is not servable; use float32, float16, bfloat16 or float64")


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, tuple | list) else [int(value), int(value)]


def _check_warm_shapes(warm_shapes: Sequence[Sequence[int]]) -> None:
    if not all(isinstance(hw, Sequence) and len(hw) == 2 and all(type(v) is int and v > 0 for v in hw)
               for hw in warm_shapes):
        raise ExportError(f"warm_shapes must be (height, width) pairs of positive ints, got {list(warm_shapes)}")


def layer_config(module: nn.ConvTranspose2d, name: str, dtype: str, precision: str | None,
                 limits: Mapping[str, Any] | None = None, description: str = "",
                 warm_shapes: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
    """The repository config of one ``nn.ConvTranspose2d``, its hyper-parameters copied exactly."""
    cfg: dict[str, Any] = {
        "name": name,
        "in_channels": module.in_channels,
        "out_channels": module.out_channels,
        "kernel_size": _pair(module.kernel_size),
        "stride": _pair(module.stride),
        "padding": _pair(module.padding),
        "output_padding": _pair(module.output_padding),
        "dilation": _pair(module.dilation),
        "groups": module.groups,
        "bias": module.bias is not None,
        "dtype": dtype,
    }
    if precision is not None:  # float32 only; other dtypes compute natively
        cfg["precision"] = precision
    for key, value in (limits or {}).items():
        if key not in LIMIT_KEYS:
            raise ExportError(f"unknown limit {key!r}; known: {', '.join(LIMIT_KEYS)}")
        if value is not None:
            cfg[key] = value
    if warm_shapes:
        _check_warm_shapes(warm_shapes)
        cfg["warm_shapes"] = [[h, w] for h, w in warm_shapes]
    if description:
        cfg["description"] = description
    return cfg


def dump_config(cfg: Mapping[str, Any]) -> str:
    """A config as JSON, one key per line (lists stay on their line)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in cfg.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _default_name(path: str, prefix: str) -> str:
    return (prefix + path.replace(".", "_")) if path else (prefix.rstrip("_-") or "layer")


def export_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    precision: str | None = None,
    prefix: str = "",
    names: Mapping[str, str] | None = None,
    limits: Mapping[str, Any] | None = None,
    description: str | None = None,
    warm_shapes: Sequence[Sequence[int]] = (),
    overwrite: bool = False,
) -> list[Path]:
    """Write ``<name>.json`` + ``<name>.safetensors`` for every ``nn.ConvTranspose2d`` in ``model``.

    Args:
        model: any module; its ``nn.ConvTranspose2d`` submodules (and subclasses such as
            ``kernels.ConvTranspose2d``) are exported, the model itself too if it is one.
        out_dir: the repository directory (created if needed).
        dtype: io dtype of the layers (weights cast to it); default: each layer's weight dtype.
        precision: ``"tf32"`` or ``"fp32"`` for float32 layers; default: the module's own ``precision``
            (``kernels.ConvTranspose2d``), else what PyTorch would use (``torch.backends.cudnn.allow_tf32``).
            Other dtypes compute natively and take none.
        description: a label for the model in each layer's description (default: its class name).
        prefix: prepended to the default names (the module path with dots turned into underscores).
        names: module path -> layer name; when given, only those modules are exported.
        limits: batching/size limits written into every config (``max_batch_size`` ...); omitted ones use
            the server's defaults.
        warm_shapes: input sizes ``(H, W)`` the server runs at startup (kernels loaded and measured before the
            first request of that size), written into every config.
        overwrite: replace existing files of the same names.

    Returns:
        The config files written, in module order.

    Raises:
        ExportError: no transposed convolution found, an invalid or duplicate name, an unknown module path,
            a dtype that is not servable, or files that exist already.
    """
    _check_warm_shapes(warm_shapes)
    out = Path(out_dir)
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ConvTranspose2d)]
    if names is not None:
        by_path = dict(found)
        missing = [p for p in names if p not in by_path]
        if missing:
            raise ExportError(f"no nn.ConvTranspose2d at module path(s) {missing}; found {list(by_path)}")
        found = [(p, by_path[p]) for p in names]
    if not found:
        raise ExportError(f"{type(model).__name__} holds no nn.ConvTranspose2d")
    plan: list[tuple[str, str, nn.ConvTranspose2d]] = []
    for path, module in found:
        name = names[path] if names is not None else _default_name(path, prefix)
        if not NAME_PATTERN.fullmatch(name):
            raise ExportError(f"layer name {name!r} (module {path or '<model>'}) is invalid: use A-Z a-z 0-9 _ -")
        if module.padding_mode != "zeros":
            raise ExportError(f"module {path!r} has padding_mode={module.padding_mode!r}; only 'zeros' exists "
                              "for transposed convolutions")
        plan.append((path, name, module))
    dup = {n for _, n, _ in plan if [x for _, x, _ in plan].count(n) > 1}
    if dup:
        raise ExportError(f"layer names {sorted(dup)} would be written twice; pass names=")
    out.mkdir(parents=True, exist_ok=True)
    if not overwrite:
        existing = [str(out / f"{n}{s}") for _, n, _ in plan for s in (".json", ".safetensors")
                    if (out / f"{n}{s}").exists()]
        if existing:
            raise ExportError(f"files exist already: {existing}; pass overwrite=True (--overwrite)")

    written = []
    for path, name, module in plan:
        dt = _dtype_name(dtype if dtype is not None else module.weight.dtype)
        prec: str | None = None
        if dt == "float32":
            prec = precision or getattr(module, "precision", None) or (
                "tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
            if prec not in ("tf32", "fp32"):
                raise ExportError(f"precision must be 'tf32' or 'fp32', got {prec!r}")
        label = description or type(model).__name__
        desc = f"{label}[{path}]: {module!r}" if path else f"{label}: {module!r}"
        cfg = layer_config(module, name, dt, prec, limits, desc, warm_shapes)
        tensors = {"weight": module.weight.detach().to("cpu", DTYPES[dt]).contiguous()}
        if module.bias is not None:
            tensors["bias"] = module.bias.detach().to("cpu", DTYPES[dt]).contiguous()
        weights_path = out / f"{name}.safetensors"
        save_file(tensors, str(weights_path))
        weights_path.chmod(0o644)
        config_path = out / f"{name}.json"
        config_path.write_text(dump_config(cfg), encoding="utf-8")
        _, problems = load_layer(config_path, BatchLimits(1, 1, 0.0, 1), out)  # check what was written
        if problems:
            raise ExportError("exported layer is invalid: " + "; ".join(problems))
        log.info("exported %s -> %s (%s, %s)", path or "<model>", config_path, dt, list(tensors["weight"].shape))
        written.append(config_path)
    return written


def load_model(spec: str, kwargs: Mapping[str, Any] | None = None, checkpoint: str | Path | None = None) -> nn.Module:
    """Build ``module.path:factory(**kwargs)`` and load ``checkpoint`` (a state dict) into it.

    The checkpoint is read with ``torch.load(weights_only=True)`` (tensors and containers only, no code) or,
    for ``*.safetensors``, with safetensors. A dict holding a ``state_dict`` entry is unwrapped.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ExportError(f"model must be given as 'module.path:factory', got {spec!r}")
    obj: Any = import_model_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExportError(f"{module_name} ({getattr(obj, '__file__', None) or obj!r}) has no attribute "
                              f"{part!r} (model {spec!r})")
        obj = getattr(obj, part)
    model = obj if isinstance(obj, nn.Module) else obj(**dict(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise ExportError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    if checkpoint is not None:
        path = Path(checkpoint)
        if path.suffix == ".safetensors":
            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise ExportError(f"{path} does not hold a state dict")
        model.load_state_dict(state)
    return model.eval()


def import_model_module(name: str) -> Any:
    """Import the model's module ``name``.

    Raises:
        ExportError: it cannot be found (the message says how to point at it), or importing it failed.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            raise ExportError(
                f"cannot import the model's module {name!r} ({exc}); searched the current directory "
                f"{os.getcwd()}, PYTHONPATH and the installed packages. Point at the directory that holds "
                f"{missing.replace('.', '/')}.py (or its package): --import-path DIR, or PYTHONPATH=DIR, or run "
                "from that directory") from None
        raise ExportError(f"importing the model's module {name!r} failed: {exc} (a module it imports is missing: "
                          "install it)") from None
    except ImportError as exc:
        raise ExportError(f"importing the model's module {name!r} failed: {exc}") from None


def program_name(argv0: str | None = None) -> str:
    """How the exporter was started: ``deconv-export`` (the script) or ``python -m service.export``."""
    name = Path(argv0 if argv0 is not None else sys.argv[0]).name
    return name if name.startswith("deconv-export") else "python -m service.export"


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of ``deconv-export`` / ``python -m service.export``."""
    p = argparse.ArgumentParser(prog=prog or program_name(),
                                description="Export every nn.ConvTranspose2d of a model as a layer repository.")
    p.add_argument("model", help="module.path:factory returning an nn.Module (or a module attribute that is one)")
    p.add_argument("--out", required=True, help="repository directory to write")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for the factory")
    p.add_argument("--checkpoint", help="state dict to load: torch.save file (weights only) or .safetensors")
    p.add_argument("--dtype", help="io dtype: float32, float16, bfloat16, float64 (default: the weights')")
    p.add_argument("--precision", choices=["tf32", "fp32"], help="float32 multiply precision (default: PyTorch's)")
    p.add_argument("--prefix", default="", help="prefix for the generated layer names")
    p.add_argument("--name", action="append", default=[], metavar="PATH=NAME",
                   help="export only this module path under this name (repeatable)")
    for key in LIMIT_KEYS:
        p.add_argument(f"--{key.replace('_', '-')}", type=float if key.endswith("_ms") else int, default=None,
                       metavar="MS" if key.endswith("_ms") else "N", help=LIMIT_HELP[key])
    p.add_argument("--warm-shape", action="append", nargs=2, type=int, default=[], metavar=("H", "W"),
                   help="input size the server runs at startup, for every layer (repeatable)")
    p.add_argument("--import-path", action="append", default=[], metavar="DIR",
                   help="directory to import the model's module from, before the current directory, PYTHONPATH and "
                        "the installed packages (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    return p


def main(argv: list[str] | None = None) -> None:
    """``deconv-export MODEL --out DIR [options]``."""
    args = parser().parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # the model's module may live in the current directory, as with python -m
    for directory in reversed(args.import_path):
        sys.path.insert(0, str(Path(directory).expanduser().absolute()))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ExportError("--kwargs must be a JSON object")
        names = dict(item.split("=", 1) for item in args.name) if args.name else None
        if names is not None and any(not k or not v for k, v in names.items()):
            raise ExportError("--name takes PATH=NAME")
        model = load_model(args.model, kwargs, args.checkpoint)
        limits = {k: getattr(args, k) for k in LIMIT_KEYS}
        written = export_model(model, args.out, dtype=args.dtype, precision=args.precision, prefix=args.prefix,
                               names=names, limits=limits, warm_shapes=args.warm_shape, overwrite=args.overwrite)
    except (ExportError, json.JSONDecodeError, ImportError, AttributeError, OSError, RuntimeError) as exc:
        sys.exit(f"export failed: {exc}")
    log.info("wrote %d layer(s) to %s", len(written), args.out)


if __name__ == "__main__":
    main()
