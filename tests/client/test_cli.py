"""The deconv-client command line: parsing, environment defaults, and each command against a fake server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import safetensors.numpy
from deconv_client.cli import build_parser, main

from .conftest import error_response, npy_bytes
from .test_client import Echo, fake_layer


def test_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DECONV_URL", raising=False)
    monkeypatch.delenv("DECONV_API_KEY", raising=False)
    args = build_parser().parse_args(["layers"])
    assert (args.url, args.api_key, args.timeout, args.no_retry, args.verbose) == (
        "http://127.0.0.1:8000", None, 60.0, False, 0,
    )  # fmt: skip
    monkeypatch.setenv("DECONV_URL", "http://gpu-box:9000")
    monkeypatch.setenv("DECONV_API_KEY", "k1")
    args = build_parser().parse_args(["layers", "--json"])
    assert (args.url, args.api_key, args.json) == ("http://gpu-box:9000", "k1", True)


def test_global_options_go_before_or_after_the_command() -> None:
    parser = build_parser()
    before = parser.parse_args(
        ["--url", "http://a:1", "--timeout", "5", "infer", "--layer", "up1", "i.npy", "-o", "o.npy"]
    )
    after = parser.parse_args(
        ["infer", "--layer", "up1", "i.npy", "-o", "o.npy", "--url", "http://a:1", "--timeout", "5"]
    )
    for args in (before, after):
        assert (args.url, args.timeout, args.layer) == ("http://a:1", 5.0, "up1")
        assert (args.input, args.output) == (Path("i.npy"), Path("o.npy"))
    # A value given before the command is not reset by the command's own (suppressed) defaults.
    assert parser.parse_args(["--api-key", "k", "-v", "bench", "--layer", "x"]).api_key == "k"
    args = parser.parse_args(["bench", "--layer", "x", "-n", "7", "-c", "3", "--no-progress", "--no-retry"])
    assert (args.requests, args.concurrency, args.progress, args.no_retry) == (7, 3, False, True)


@pytest.mark.parametrize(
    "argv",
    [[], ["infer", "x.npy", "-o", "y.npy"], ["infer", "--layer", "up1", "x.npy"], ["bench"], ["nope"]],
)
def test_bad_command_lines_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_layers(capsys: pytest.CaptureFixture[str]) -> None:
    transport = httpx.MockTransport(Echo())
    assert main(["layers"], transport=transport) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "in", "out", "kernel", "stride", "padding", "out_pad", "dilation",
                                "groups", "dtype", "prec"]  # fmt: skip
    assert lines[1].split() == ["up1", "3", "2", "4", "2", "1", "0", "1", "1", "float32", "tf32"]
    assert lines[2].split()[0] == "up2"
    assert main(["layers", "--json"], transport=transport) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["name"] for layer in data["layers"]] == ["up1", "up2"]


def test_infer_npy_and_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    echo = Echo()
    transport = httpx.MockTransport(echo)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    (tmp_path / "in.npy").write_bytes(npy_bytes(np.asfortranarray(x)))  # re-encoded to C order on the way
    argv = ["--api-key", "k", "infer", "--layer", "up1", str(tmp_path / "in.npy"), "-o", str(tmp_path / "out.npy")]
    code = main(argv, transport=transport)
    assert code == 0
    y = np.load(tmp_path / "out.npy", allow_pickle=False)
    np.testing.assert_array_equal(y, fake_layer(x))
    out = capsys.readouterr().out
    assert "float32 [2, 2, 8, 8]" in out
    assert "batch size 1" in out
    assert echo.requests[-1].headers["authorization"] == "Bearer k"

    (tmp_path / "in.safetensors").write_bytes(safetensors.numpy.save({"x": x}))
    code = main(["infer", "--layer", "up1", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "out.safetensors"),
                 "--deadline-ms", "100"], transport=transport)  # fmt: skip
    assert code == 0
    request = echo.requests[-1]
    assert request.headers["content-type"] == "application/vnd.safetensors"
    assert request.headers["accept"] == "application/vnd.safetensors"
    assert request.headers["x-deadline-ms"] == "100"
    loaded = safetensors.numpy.load_file(tmp_path / "out.safetensors")
    np.testing.assert_array_equal(loaded["output"], fake_layer(x))


def test_errors_exit_1_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transport = httpx.MockTransport(lambda request: error_response(404, "unknown_layer", "no layer named 'zz'"))
    (tmp_path / "in.npy").write_bytes(npy_bytes(np.zeros((1, 3, 2, 2), np.float32)))
    assert (
        main(["infer", "--layer", "zz", str(tmp_path / "in.npy"), "-o", str(tmp_path / "o.npy")], transport=transport)
        == 1
    )
    assert "error: no layer named 'zz' (404, unknown_layer)" in capsys.readouterr().err
    assert not (tmp_path / "o.npy").exists()
    assert main(["infer", "--layer", "zz", str(tmp_path / "missing.npy"), "-o", "o.npy"], transport=transport) == 1
    assert "missing.npy" in capsys.readouterr().err
    (tmp_path / "junk.npy").write_bytes(b"junk")
    assert main(["infer", "--layer", "zz", str(tmp_path / "junk.npy"), "-o", "o.npy"], transport=transport) == 1
    assert "junk.npy is not a tensor file: expected .npy or safetensors" in capsys.readouterr().err


def test_a_file_that_is_not_a_tensor_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A PNG's first 8 bytes read as a safetensors header length would claim ~7e17 bytes; that is not the message.
    requests: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: requests.append(request) or httpx.Response(500))
    png = tmp_path / "cat.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64))
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    for path, message in ((png, "cat.png is not a tensor file"), (empty, "empty.npy is empty")):
        assert main(["infer", "--layer", "demo", str(path), "-o", str(tmp_path / "o.npy")], transport=transport) == 1
        err = capsys.readouterr().err
        assert message in err
        assert "header of" not in err
    assert not any(r.method == "POST" for r in requests)


def test_connection_refused_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed")

    assert main(["--no-retry", "layers"], transport=httpx.MockTransport(refuse)) == 1
    assert "error: GET http://127.0.0.1:8000/v1/layers failed after 1 attempt(s)" in capsys.readouterr().err


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    echo = Echo()
    argv = ["bench", "--layer", "up1", "--batch", "2", "--height", "4", "--width", "6", "-n", "30", "-c", "4",
            "--warmup", "2", "--json", "--no-progress"]  # fmt: skip
    assert main(argv, transport=httpx.MockTransport(echo)) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["requests"], result["ok"], result["failed"]) == (30, 30, 0)
    assert result["input_shape"] == [2, 3, 4, 6]
    assert result["input_dtype"] == "float32"
    assert set(result["latency_ms"]) == {"mean", "p50", "p90", "p99", "max"}
    lat = result["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert result["throughput_rps"] > 0
    assert result["throughput_samples_per_s"] == pytest.approx(2 * result["throughput_rps"])
    assert result["server_batch_size_mean"] == 1.0
    assert result["server_queue_ms_mean"] == 0.5
    deconvs = [r for r in echo.requests if r.url.path == "/deconv"]
    assert len(deconvs) == 32  # warm-up included


def test_bench_text_progress_and_failures(capsys: pytest.CaptureFixture[str]) -> None:
    echo = Echo()
    count = {"n": 0}

    def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/deconv":
            count["n"] += 1
            if count["n"] % 5 == 0:
                return error_response(500, "internal", "kernel failed")
        return echo(request)

    argv = ["bench", "--layer", "up1", "-n", "20", "-c", "1", "--warmup", "0", "--progress"]
    assert main(argv, transport=httpx.MockTransport(flaky)) == 1
    captured = capsys.readouterr()
    assert "20/20" in captured.err
    assert "4 failed" in captured.err
    assert "ok 16, failed 4 {'ServerError': 4}" in captured.out
    assert "latency ms: mean" in captured.out
    assert "server: mean batch size 1.00" in captured.out


def test_ready_command(capsys: pytest.CaptureFixture[str]) -> None:
    answers = iter([error_response(503, "not_ready", "starting"), httpx.Response(200, json={"status": "ready"})])
    transport = httpx.MockTransport(lambda request: next(answers))
    assert main(["ready"], transport=transport) == 1
    assert "not ready" in capsys.readouterr().out
    assert main(["ready", "--wait", "5"], transport=transport) == 0
    assert capsys.readouterr().out.strip() == "ready"
