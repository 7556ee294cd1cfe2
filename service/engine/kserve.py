"""The layers as KServe v2 / Triton models: what every front end (``service.http``, a gRPC one) answers about them.

Each layer is a model of one version (``MODEL_VERSION``), one input named ``input`` and one output named ``output``.
The functions below build the answers as plain dicts in the JSON shapes of KServe v2 and of Triton's HTTP
extensions; a front end only encodes them (JSON as they are, or the matching protobuf messages). Every count and
time comes from the server's own Prometheus metrics (``service.metrics``), as ``GET /metrics`` reports them: in a
multi-process server the sum over every process (the engine process's batch series and each HTTP process's request
series), so that any process gives the same totals.

Public functions (``UnknownLayerError``, 404, for a model or version that does not exist):

* ``model_metadata(layer) -> dict``: KServe model metadata: ``{"name", "versions": ["1"], "platform": "deconv",
  "inputs": [{"name", "datatype", "shape"}], "outputs": [...], "parameters": {"layer": Layer.describe()}}``; shapes
  ``[-1, C, -1, -1]``, datatype ``"FP32"`` / ``"FP16"`` / ``"BF16"`` / ``"FP64"``.
* ``model_config(engine, layer) -> dict``: Triton's model configuration in its JSON form: ``{"name", "platform",
  "backend", "version_policy", "max_batch_size", "input": [{"name", "data_type", "format", "dims", ...}],
  "output": [{"name", "data_type", "dims", ...}], "dynamic_batching": {"max_queue_delay_microseconds",
  "default_queue_policy": {..., "max_queue_size"}, ...}, "instance_group": [{"name", "kind", "count", "gpus"}],
  "parameters": {key: {"string_value": str}}, ...}``; ``dims`` without the batch dimension (``[C, -1, -1]``: -1
  where a size varies), ``data_type`` ``"TYPE_FP32"`` etc.
* ``repository_index(engine, ready_only=False) -> list[dict]``: ``[{"name", "version": "1", "state", "reason"}]``,
  ``state`` one of ``"READY"``, ``"LOADING"``, ``"UNAVAILABLE"``, ``"UNLOADING"`` (the server's readiness: every
  layer is checked before any is served).
* ``model_statistics(engine, name=None, version=None) -> dict``: ``{"model_stats": [{"name", "version",
  "last_inference" (ms since the epoch, 0 before the first), "inference_count" (samples executed),
  "execution_count" (batches executed), "inference_stats": {"success", "fail", "queue", "compute_input",
  "compute_infer", "compute_output", "cache_hit", "cache_miss"}, "batch_stats": [{"batch_size", "compute_input",
  "compute_infer", "compute_output"}], "response_stats": {}, "memory_usage": []}]}``, each duration ``{"count": int,
  "ns": int}``; every layer when ``name`` is None.
* ``find_model(engine, name, version=None) -> Layer``: the layer, checked.

What the statistics count (docs/protocol.md): ``success``: requests answered 200 and the time from receipt to
response (``deconv_request_latency_seconds``); ``fail``: requests of the layer answered with another status and
their time (``deconv_requests_total``, ``deconv_failed_request_seconds_total``); ``queue``: requests whose batch
started and their time queued (``deconv_queue_time_seconds``); ``compute_infer``: requests in executed batches, each
with its batch's time (a worker stages the inputs, runs the kernels and copies the outputs in one call, so the whole
batch time is here and ``compute_input`` / ``compute_output`` count the same requests with 0 ns);
``batch_stats``: executed batches by samples in the batch, with their time.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from service.engine.local import GPU_WORKERS
from service.engine.registry import Layer
from service.errors import UnknownLayerError

if TYPE_CHECKING:
    from service.engine.interface import Engine

MODEL_VERSION = "1"  # the only version of every model
PLATFORM = "deconv"
KSERVE_INPUT = "input"
KSERVE_OUTPUT = "output"
KSERVE_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16, "FP64": torch.float64}
KSERVE_NAMES = {v: k for k, v in KSERVE_DTYPES.items()}

# The server's readiness as a model state of Triton's repository index.
_STATES = {"ready": "READY", "starting": "LOADING", "failed": "UNAVAILABLE", "draining": "UNLOADING"}


def find_model(engine: Engine, name: str, version: str | None = None) -> Layer:
    """The layer called ``name``, at ``version`` when given.

    Raises:
        UnknownLayerError: no such layer, or a version other than ``MODEL_VERSION`` (404).
    """
    layer = engine.registry.get(name) if engine.registry is not None else None
    if layer is None:
        raise UnknownLayerError(f"no layer named {name!r}; GET /v1/layers lists them")
    check_version(version)
    return layer


def check_version(version: str | None) -> None:
    """Raise ``UnknownLayerError`` (404) unless ``version`` is None or ``MODEL_VERSION``."""
    if version is not None and version != MODEL_VERSION:
        raise UnknownLayerError(f"model version {version!r} does not exist; the only version is {MODEL_VERSION!r}")


def model_metadata(layer: Layer) -> dict[str, Any]:
    """KServe's model metadata of ``layer`` (the module docstring)."""
    c = layer.config
    dt = KSERVE_NAMES[layer.dtype]
    return {
        "name": c.name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [{"name": KSERVE_INPUT, "datatype": dt, "shape": [-1, c.in_channels, -1, -1]}],
        "outputs": [{"name": KSERVE_OUTPUT, "datatype": dt, "shape": [-1, c.out_channels, -1, -1]}],
        "parameters": {"layer": layer.describe()},
    }


def model_config(engine: Engine, layer: Layer) -> dict[str, Any]:
    """Triton's model configuration of ``layer`` in its JSON form (the module docstring)."""
    c, limits = layer.config, layer.limits
    data_type = f"TYPE_{KSERVE_NAMES[layer.dtype]}"
    gpu = engine.backend == "cuda"
    per_device = engine.settings.workers_per_device or (GPU_WORKERS if gpu else 1)
    parameters = {key: {"string_value": value if isinstance(value, str) else json.dumps(value)}
                  for key, value in layer.describe().items() if key not in ("name", "max_batch_size")}
    return {
        "name": c.name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "runtime": "",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": limits.max_batch_size,
        "input": [{"name": KSERVE_INPUT, "data_type": data_type, "format": "FORMAT_NCHW",
                   "dims": [c.in_channels, -1, -1], "is_shape_tensor": False, "allow_ragged_batch": False,
                   "optional": False}],
        "output": [{"name": KSERVE_OUTPUT, "data_type": data_type, "dims": [c.out_channels, -1, -1],
                    "label_filename": "", "is_shape_tensor": False}],
        "batch_input": [],
        "batch_output": [],
        "dynamic_batching": {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": round(limits.max_queue_delay_ms * 1000),
            "preserve_ordering": False,
            "priority_levels": 0,
            "default_priority_level": 0,
            "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 0,
                                     "allow_timeout_override": True, "max_queue_size": limits.max_queue_size},
            "priority_queue_policy": {},
        },
        # One instance a worker thread; no "gpus" list: every GPU the server uses.
        "instance_group": [{"name": c.name, "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": per_device,
                            "gpus": [], "profile": [], "passive": False, "host_policy": ""}],
        "default_model_filename": f"{c.name}.safetensors",
        "cc_model_filenames": {},
        "metric_tags": {},
        "parameters": parameters,
        "model_warmup": [],
    }


def repository_index(engine: Engine, ready_only: bool = False) -> list[dict[str, str]]:
    """Triton's repository index: every layer, its version and state (the module docstring); with ``ready_only``
    only the ones ready."""
    if engine.registry is None:
        return []
    readiness = engine.readiness
    state = _STATES.get(readiness.state, "UNAVAILABLE")
    reason = "" if state == "READY" else readiness.reason
    if ready_only and state != "READY":
        return []
    return [{"name": name, "version": MODEL_VERSION, "state": state, "reason": reason}
            for name in engine.registry.names()]


def model_statistics(engine: Engine, name: str | None = None, version: str | None = None) -> dict[str, Any]:
    """Triton's inference statistics of one layer (``name``) or every one (the module docstring).

    Raises:
        UnknownLayerError: ``name`` or ``version`` does not exist (404).
    """
    if name is not None:
        names = [find_model(engine, name, version).name]
    else:
        check_version(version)
        names = engine.registry.names() if engine.registry is not None else []
    totals = _totals(engine)
    return {"model_stats": [_layer_statistics(totals, layer) for layer in names]}


# --- from the metrics --------------------------------------------------------------------------------------


class _Totals:
    """The metrics' samples the statistics need, summed per layer (and per batch size)."""

    def __init__(self) -> None:
        self.by_layer: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.batches: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))


# Samples summed per layer as they are named in the exposition: sample name -> key.
_LAYER_SAMPLES = {
    "deconv_request_latency_seconds_count": "success_count",
    "deconv_request_latency_seconds_sum": "success_s",
    "deconv_failed_request_seconds_total": "fail_s",
    "deconv_queue_time_seconds_count": "queue_count",
    "deconv_queue_time_seconds_sum": "queue_s",
    "deconv_request_compute_seconds_total": "compute_s",
    "deconv_computed_requests_total": "compute_count",
    "deconv_last_inference_timestamp_seconds": "last_inference",
}


def _totals(engine: Engine) -> _Totals:
    totals = _Totals()
    for family in engine.metrics.collect():
        for sample in family.samples:
            layer = sample.labels.get("layer")
            if layer is None:
                continue
            key = _LAYER_SAMPLES.get(sample.name)
            if key == "last_inference":
                row = totals.by_layer[layer]
                row[key] = max(row[key], sample.value)
            elif key is not None:
                totals.by_layer[layer][key] += sample.value
            elif sample.name == "deconv_requests_total" and sample.labels.get("status") != "200":
                totals.by_layer[layer]["fail_count"] += sample.value
            elif sample.name in ("deconv_batch_compute_seconds_count", "deconv_batch_compute_seconds_sum"):
                cell = totals.batches[layer][int(sample.labels["batch_size"])]
                cell[0 if sample.name.endswith("_count") else 1] += sample.value
    return totals


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": round(count), "ns": round(seconds * 1e9) if math.isfinite(seconds) else 0}


def _layer_statistics(totals: _Totals, name: str) -> dict[str, Any]:
    row = totals.by_layer.get(name, {})
    batches = sorted(totals.batches.get(name, {}).items())
    computed = row.get("compute_count", 0.0)
    batch_stats = [{"batch_size": size, "compute_input": _duration(count, 0.0),
                    "compute_infer": _duration(count, seconds), "compute_output": _duration(count, 0.0)}
                   for size, (count, seconds) in batches]
    return {
        "name": name,
        "version": MODEL_VERSION,
        "last_inference": round(row.get("last_inference", 0.0) * 1000),
        "inference_count": round(sum(size * count for size, (count, _) in batches)),
        "execution_count": round(sum(count for _, (count, _) in batches)),
        "inference_stats": {
            "success": _duration(row.get("success_count", 0.0), row.get("success_s", 0.0)),
            "fail": _duration(row.get("fail_count", 0.0), row.get("fail_s", 0.0)),
            "queue": _duration(row.get("queue_count", 0.0), row.get("queue_s", 0.0)),
            "compute_input": _duration(computed, 0.0),
            "compute_infer": _duration(computed, row.get("compute_s", 0.0)),
            "compute_output": _duration(computed, 0.0),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": batch_stats,
        "response_stats": {},
        "memory_usage": [],
    }
