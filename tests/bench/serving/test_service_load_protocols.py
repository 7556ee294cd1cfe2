"""bench/serving/service_load.py's protocols (``--protocol npy|kserve|shm``) against a local CPU server: the requests it
builds are answered 200 and the output it reads back matches PyTorch; shared-memory regions are gone afterwards,
also when a run is cancelled or a load process left some behind; batching off limits a kernel call to one request."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import pytest

from bench.serving import raw_client, servers, service_load
from bench.serving.wire import check_output, make_input, make_wire, sweep_regions

from ...service.conftest import REPO_ROOT, ServerProcess
from . import test_load_generator

feed = test_load_generator.feed

BATCH = 4  # samples a request; the server's max_batch_size, as in the no-batching scenario


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    for suffix in (".json", ".safetensors"):
        shutil.copy(REPO_ROOT / "layers" / f"demo{suffix}", root)
    return root


def bench_args(repository: Path, protocol: str, clients: int = 3) -> argparse.Namespace:
    return argparse.Namespace(layer="demo", repository=repository, batch=BATCH, height=8, width=8, clients=clients,
                              timeout=30.0, client="raw", protocol=protocol, max_seconds=None, http_processes=1,
                              devices="cpu", max_queue_delay_ms=None)


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One CPU server with the no-batching scenario's batch limit for requests of ``BATCH`` samples."""
    _, env = servers.server_command("no-batching", bench_args(repository, "shm"), 0)
    proc = ServerProcess({"DECONV_LAYER_REPOSITORY": str(repository), "DECONV_LOG_LEVEL": "warning",
                          "DECONV_MAX_BATCH_SIZE": env["DECONV_MAX_BATCH_SIZE"]},
                         tmp_path_factory.mktemp("server") / "server.log")
    try:
        proc.wait_ready()
        yield proc.url
    finally:
        proc.stop()


def my_objects() -> list[str]:
    """This process's shared-memory objects (the SDK names them deconv-client-<pid>-...)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"deconv-client-{os.getpid()}-*"))


def regions(url: str) -> list[dict[str, object]]:
    r = httpx.get(f"{url}/v2/systemsharedmemory/status", timeout=10)
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def test_the_no_batching_limit_is_one_request(repository: Path) -> None:
    for batch in (1, 8):
        args = bench_args(repository, "npy")
        args.batch = batch
        _, env = servers.server_command("no-batching", args, 8000)
        assert env["DECONV_MAX_BATCH_SIZE"] == str(batch)
        _, env = servers.server_command("batching", args, 8000)  # the server's default limit
        assert env.get("DECONV_MAX_BATCH_SIZE") == os.environ.get("DECONV_MAX_BATCH_SIZE")


@pytest.mark.parametrize("protocol", ["npy", "kserve", "shm"])
def test_each_protocol_is_answered_and_checked(repository: Path, server: str,
                                               protocol: str) -> None:
    args = bench_args(repository, protocol)
    x = make_input(args)
    result = asyncio.run(asyncio.wait_for(service_load.drive(server, args, x, 12), 60))
    assert result["statuses"] == {"200": 12}
    assert result["batch_sizes"] == [BATCH] * 12  # every kernel call held exactly one request
    assert check_output(args, x, result["_sample"]) < 1e-5
    assert my_objects() == []
    assert regions(server) == []
    wire = make_wire(args, x)
    assert (wire.in_bytes, wire.out_bytes) == (x.nbytes, 2 * x.nbytes)  # demo: 16 -> 8 channels, twice the size


def test_shm_regions_are_gone_after_a_cancelled_run(repository: Path, server: str) -> None:
    args = bench_args(repository, "shm", clients=2)
    x = make_input(args)

    async def main() -> None:
        # the regions are registered before the run's start time, which is far off: the run waits there
        task = asyncio.create_task(service_load.drive(server, args, x, 1000, start_at=1e12))
        while len(my_objects()) < 2 or len(regions(server)) < 2:
            if task.done():
                task.result()  # the registration's error, if any
                pytest.fail("the run ended before its start time")
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 60))
    assert my_objects() == []
    assert regions(server) == []


def test_regions_a_dead_load_process_left_are_swept(server: str) -> None:
    pid = 2**22 + 12345  # above Linux's default pid_max: no live process of ours has it
    name = f"deconv-client-{pid}-left"
    shm = shared_memory.SharedMemory(name, create=True, size=4096)
    try:
        r = httpx.post(f"{server}/v2/systemsharedmemory/region/{name}/register",
                       json={"key": f"/{name}", "offset": 0, "byte_size": 4096}, timeout=10)
        assert r.status_code == 200
        assert sweep_regions(server, [pid]) == [name]
        assert regions(server) == []
        assert not Path(f"/dev/shm/{name}").exists()
    finally:
        shm.close()
        if Path(f"/dev/shm/{name}").exists():
            shm.unlink()


def test_an_answer_of_the_wrong_size_is_counted(repository: Path) -> None:
    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    args = bench_args(repository, "npy")
    wire = make_wire(args, make_input(args))
    load = raw_client.RawLoad("http://127.0.0.1:9", "", b"", "", 1, 1.0, wire=wire)
    load.remaining = 0
    client = raw_client.RawClient(load)
    client.transport = Transport()
    client.sent_at = 1.0  # a request in flight
    feed(client, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")  # no tensor in it
    assert load.statuses == {"wrong_size": 1}
    assert load.latencies == []


def test_cpu_per_request_by_kind_of_process() -> None:
    cpu = {"1 service": 0.1, "2 service.engine.process": 2.0, "3 service.http.frontend": 1.0,
           "4 service.http.frontend": 3.0}
    assert servers.cpu_per_request(cpu, 1000) == {"engine": 2.0, "http": 4.0, "main": 0.1}
    assert servers.cpu_per_request({"5 naive_server": 0.5}, 100) == {"naive": 5.0}
    assert servers.cpu_per_request(cpu, 0) is None
