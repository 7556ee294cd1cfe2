"""Service settings: one pydantic-settings class, read from ``DECONV_*`` environment variables.

Built by the app factory (``service.http.app.create_app``), never at import time, so that tests and the command line
can pass their own. Every field is documented in docs/operations.md.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

VERSION = "0.1.0"  # the service's version, as the KServe metadata and OpenAPI report it

MAX_HTTP_PROCESSES = 64
# DECONV_HTTP_PROCESSES=auto: at most this many HTTP processes a GPU, a bound on memory on machines of many cores:
# each process holds DECONV_IPC_SHM_BYTES of shared memory, page-locked on GPUs (on one H100, 8 processes served
# 22.8k tiny requests/s).
AUTO_HTTP_PROCESSES_PER_GPU = 16

# The bundled layer repository: <repo>/layers, next to this package.
DEFAULT_LAYER_REPOSITORY = Path(__file__).resolve().parent.parent / "layers"


class Settings(BaseSettings):
    """Every knob of the service. Environment variables are the field names in upper case, prefixed ``DECONV_``.

    The batching fields are defaults for layers whose config file does not set its own limits.
    """

    model_config = SettingsConfigDict(env_prefix="DECONV_", extra="ignore", validate_default=True)

    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to bind.")
    http_processes: Annotated[int, Field(ge=1, le=MAX_HTTP_PROCESSES)] | Literal["auto"] = Field(
        "auto", description="Processes serving HTTP. 1: one process does everything. N > 1: N processes "
        "parse HTTP and decode tensors, feeding one engine process that batches and runs every layer, so that "
        "HTTP scales over N cores while requests from all of them still share batches. \"auto\": sized from the "
        "usable cores and the GPUs (auto_http_processes: half the cores, at most 16 a GPU; 1 without a GPU or on "
        "2 cores or fewer); the count chosen is logged at start.")
    ipc_shm_bytes: int = Field(
        256 * 2**20, ge=0, description="Multi-process server: bytes of shared memory per HTTP process through which "
        "requests' tensors reach the engine and come back (service/ipc/shm.py); a request that does not fit travels "
        "through the engine socket. 0: always the socket.")
    ipc_shm_pinned: bool = Field(
        True, description="Multi-process server on GPUs: the engine page-locks each HTTP process's shared memory "
        "(cudaHostRegister), so that megabyte tensors go between it and the GPU with no host copy. Locking commits "
        "the whole arena (DECONV_IPC_SHM_BYTES per HTTP process) to memory.")
    layer_repository: Path = Field(
        DEFAULT_LAYER_REPOSITORY, description="Directory with one <name>.json + <name>.safetensors per layer."
    )
    devices: str = Field(
        "auto",
        description='"auto" (every visible GPU, else the CPU), "cpu", "all" (every GPU; fails without one) '
        'or CUDA device indices such as "0,1".',
    )
    workers_per_device: int | None = Field(
        None, ge=1, le=8,
        description="Worker threads per device, each with its own CUDA stream and copy of the weights (default: 2 a "
        "GPU, 1 on the CPU). A layer's batch goes to a second worker of a GPU only when it is full already and its "
        "tensors cross host memory, so that its transfers overlap another batch's kernel while small requests keep "
        "their batches whole.",
    )
    max_batch_size: int = Field(64, ge=1, description="Default most samples in one kernel call.")
    max_batch_bytes: int = Field(256 * 2**20, ge=1, description="Default most output bytes in one kernel call.")
    max_queue_delay_ms: float = Field(
        0.0, ge=0.0, description="Default longest wait for more requests before a batch is executed (0: none; "
        "requests still batch while the workers are busy)."
    )
    max_queue_size: int = Field(256, ge=1, description="Default most requests waiting per layer; then 429.")
    max_body_bytes: int = Field(64 * 2**20, ge=1, description="Largest accepted request body; larger is 413.")
    body_pool_bytes: int = Field(
        64 * 2**20, ge=0, description="Request bodies of 64 KiB or more are read into buffers reused from one "
        "request to the next (service/http/bodies.py); each HTTP process keeps up to this many bytes of them idle. "
        "0: every body is read into a new buffer.")
    max_json_output_bytes: int = Field(
        64 * 2**20, ge=1, description="KServe: largest JSON-encoded output (counted at 25 bytes a value, before any "
        "work); a request whose answer could be larger is 413 and should ask for binary output.")
    max_inflight_bytes: int = Field(
        0, ge=0, description="Most bytes of inference requests in flight over the whole server (bodies being read, "
        "requests queued or executing, answers being written); a request that does not fit is 429 with "
        "Retry-After. 0: a quarter of the memory of the machine (or of the container's limit). A multi-process "
        "server gives each HTTP process an equal share.")
    max_header_bytes: int = Field(
        64 * 2**10, ge=1024, description="Largest request line and headers; larger is 431 and the connection closes.")
    header_timeout_s: float = Field(
        10.0, gt=0.0, description="Longest a client may take to send a request line and headers (from connecting, or "
        "from a request's first byte on a kept-alive connection); then 408 and the connection closes.")
    body_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest a client may take to send a request body once its headers are in; then "
        "408 and the connection closes.")
    request_timeout_s: float = Field(
        30.0, gt=0.0, description="Longest time one request may take from receipt to response; then 504."
    )
    api_key: SecretStr | None = Field(
        None, description="When set, inference routes need 'Authorization: Bearer <key>'."
    )
    grpc_port: int | None = Field(
        None, ge=0, le=65535, description="TCP port of the KServe v2 gRPC API (inference.GRPCInferenceService, "
        "what tritonclient.grpc speaks), on DECONV_HOST; unset: no gRPC (Triton's own port is 8001). With N HTTP "
        "processes each of them serves it on this port (SO_REUSEPORT).")
    system_shm_max_regions: int = Field(
        64, ge=0, description="KServe system shared memory (/v2/systemsharedmemory): most regions registered at "
        "once over the whole server; registering more is 400. 0: the extension is off.")
    system_shm_max_bytes: int = Field(
        16 * 2**30, ge=1, description="KServe system shared memory: most bytes of all registered regions together; "
        "a registration that would exceed it is 400.")
    system_shm_pinned: bool = Field(
        True, description="On GPUs: the engine maps each registered system shared-memory region and page-locks it "
        "(cudaHostRegister), so that tensors in it go between the region and the GPU with no host copy; locking "
        "commits the region's memory (bounded by DECONV_SYSTEM_SHM_MAX_BYTES). false: the HTTP processes copy them.")
    cuda_shm_max_regions: int = Field(
        64, ge=0, description="KServe CUDA shared memory (/v2/cudasharedmemory, GPU servers only): most regions "
        "registered at once over the whole server, each a client's GPU allocation the engine maps; registering "
        "more is 400. 0: the extension is off.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")
    access_log: bool = Field(True, description="Log one line per HTTP request at level info (uvicorn's access log).")
    self_test: bool = Field(True, description="Run every layer against the float64 reference before ready.")
    tune: bool = Field(
        True, description="GPU: measure the fastest kernel for each layer and input size at each batch-size "
        "bucket (powers of two up to the max batch) and use it (kernels.tuning). The layers' warm_shapes are "
        "measured at startup, other sizes on their first batch (milliseconds to a second, once).")
    worker_timeout_s: float = Field(
        120.0, gt=0.0, description="Longest one batch may execute; then its worker thread is declared dead, its "
        "batches fail with 500 and a fresh thread takes over.")
    test_mode: bool = Field(False, description="Allow test-only settings (faults); never in production.")
    faults: str = Field("", description="Faults to inject (service/faults.py); refused unless test_mode is set.")

    # How http_processes was chosen (logged at start): set, or the auto rule's inputs.
    _http_processes_rule: str = PrivateAttr("")

    @field_validator("http_processes", mode="before")
    @classmethod
    def _auto_lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) and value.strip().lower() == "auto" else value

    @model_validator(mode="after")
    def _resolve_http_processes(self) -> Settings:
        if self.http_processes == "auto":
            self.http_processes, why = auto_http_processes(self.devices)
            self._http_processes_rule = f"DECONV_HTTP_PROCESSES=auto: {why}"
        else:
            self._http_processes_rule = "DECONV_HTTP_PROCESSES"
        return self

    @property
    def http_processes_rule(self) -> str:
        """How ``http_processes`` was chosen: ``DECONV_HTTP_PROCESSES`` when set, else the auto rule's inputs."""
        return self._http_processes_rule

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("layer_repository")
    @classmethod
    def _absolute_repository(cls, value: Path) -> Path:
        # Relative to the directory the server was started from, fixed now (the log and errors show where).
        return value.expanduser().absolute()

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str) -> str:
        parse_devices(value)
        return value.strip().lower()

    @field_validator("grpc_port", mode="before")
    @classmethod
    def _empty_port_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("faults")
    @classmethod
    def _check_faults(cls, value: str) -> str:
        from service.faults import parse

        parse(value)
        return value.strip()

    @model_validator(mode="after")
    def _faults_need_test_mode(self) -> Settings:
        if self.faults and not self.test_mode:
            raise ValueError("DECONV_FAULTS injects failures and is for tests only; it is refused unless "
                             "DECONV_TEST_MODE=1")
        return self

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        return None if value == "" else value


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``os.sched_getaffinity``), or a container's CPU quota
    (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) when lower, rounded down (at least 1)."""
    import os

    cores = len(os.sched_getaffinity(0))
    for path, period_path in (("/sys/fs/cgroup/cpu.max", None),
                              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            fields = Path(path).read_text().split()
            if period_path is not None:
                fields.append(Path(period_path).read_text().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0].lstrip("-").isdigit() and fields[1].isdigit() and int(fields[0]) > 0:
            cores = min(cores, max(1, int(fields[0]) // int(fields[1])))
        break
    return cores


def gpu_count(devices: str) -> int:
    """The GPUs a server of ``devices`` (``Settings.devices``) computes on: those listed, every GPU this process
    sees for "auto" and "all" (``torch.cuda.device_count``, which honours CUDA_VISIBLE_DEVICES), 0 for "cpu"."""
    spec = parse_devices(devices)
    if spec == "cpu":
        return 0
    if isinstance(spec, list):
        return len(spec)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def auto_http_processes(devices: str, cores: int | None = None, gpus: int | None = None) -> tuple[int, str]:
    """``DECONV_HTTP_PROCESSES=auto``: the count for this machine, and the inputs (for the start-up log).

    Half the usable cores (``usable_cores``), at most ``AUTO_HTTP_PROCESSES_PER_GPU`` a GPU and
    ``MAX_HTTP_PROCESSES``; 1 on a machine of 2 cores or fewer, and 1 without a GPU (the CPU computes the layers,
    on PyTorch's threads over every core). Half: each busy HTTP
    process takes a core, and the other half goes to the engine process (its event loop, the GPU worker threads and
    their copies), the supervisor and the kernel's network work; on 16 cores and one H100, 8 processes served the
    most (12 and 16 served 16-20% less). ``cores`` and ``gpus`` default to this machine's.
    """
    cores = usable_cores() if cores is None else cores
    gpus = gpu_count(devices) if gpus is None else gpus
    inputs = f"{cores} usable core{'s' if cores != 1 else ''}, {gpus} GPU{'s' if gpus != 1 else ''}"
    if gpus == 0 or cores <= 2:
        return 1, inputs
    return max(1, min(cores // 2, AUTO_HTTP_PROCESSES_PER_GPU * gpus, MAX_HTTP_PROCESSES)), inputs


def memory_bytes() -> int:
    """The memory this process may use: the machine's, or the container's limit (cgroup v2 or v1) when lower."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def inflight_limit(settings: Settings) -> int:
    """``max_inflight_bytes`` (a quarter of ``memory_bytes()`` when 0) for one HTTP process of the server."""
    total = settings.max_inflight_bytes or memory_bytes() // 4
    return max(1, total // settings.http_processes)


def parse_devices(spec: str) -> Literal["auto", "cpu", "all"] | list[int]:
    """``"auto"``/``"cpu"``/``"all"`` as they are, or a comma list of CUDA device indices such as ``"0,1"``.

    Raises:
        ValueError: anything else (an empty list, a negative or repeated index, a word that is not one of those).
    """
    text = spec.strip().lower()
    if text in ("auto", "cpu", "all"):
        return text  # type: ignore[return-value]
    parts = [p.strip().removeprefix("cuda:") for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f'devices must be "auto", "cpu", "all" or GPU indices such as "0,1", got {spec!r}')
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices lists a GPU twice: {spec!r}")
    return indices


def load_settings(**overrides: Any) -> Settings:
    """``Settings`` from the environment (and ``overrides``); exits with the validation errors when invalid."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        sys.exit(f"invalid settings:\n{exc}")


def configure_logging(settings: Settings, role: str = "") -> None:
    """Log lines at the settings' level; ``role`` tags each line in the processes of a multi-process server."""
    tag = f" [{role}]" if role else ""
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
