"""Settings: DECONV_* environment variables, defaults, validation; the command line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.config import DEFAULT_LAYER_REPOSITORY, Settings, parse_devices


def test_defaults(monkeypatch):
    for key in ("DECONV_PORT", "DECONV_HOST", "DECONV_DEVICES", "DECONV_LAYER_REPOSITORY", "DECONV_API_KEY",
                "DECONV_HTTP_PROCESSES"):
        monkeypatch.delenv(key, raising=False)
    s = Settings()
    assert (s.host, s.port, s.devices) == ("127.0.0.1", 8000, "auto")
    assert s.layer_repository == DEFAULT_LAYER_REPOSITORY
    assert (DEFAULT_LAYER_REPOSITORY / "demo.json").is_file()
    assert (s.max_batch_size, s.max_queue_delay_ms, s.max_queue_size) == (64, 0.0, 256)
    assert s.api_key is None
    assert s.access_log is True
    assert s.http_processes == 1


def test_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DECONV_PORT", "9001")
    monkeypatch.setenv("DECONV_DEVICES", " 0, 1 ")
    monkeypatch.setenv("DECONV_LAYER_REPOSITORY", str(tmp_path))
    monkeypatch.setenv("DECONV_MAX_BATCH_SIZE", "1")
    monkeypatch.setenv("DECONV_API_KEY", "sekret-value")
    monkeypatch.setenv("DECONV_LOG_LEVEL", "DEBUG")
    s = Settings()
    assert s.port == 9001
    assert parse_devices(s.devices) == [0, 1]
    assert s.layer_repository == tmp_path
    assert s.max_batch_size == 1
    assert s.api_key is not None
    assert s.api_key.get_secret_value() == "sekret-value"
    assert "sekret-value" not in repr(s)  # the key never shows in logs
    assert s.log_level == "debug"
    monkeypatch.setenv("DECONV_ACCESS_LOG", "false")
    assert Settings().access_log is False
    monkeypatch.setenv("DECONV_HTTP_PROCESSES", "4")
    assert Settings().http_processes == 4
    monkeypatch.setenv("DECONV_API_KEY", "")
    assert Settings().api_key is None


@pytest.mark.parametrize("spec", ["gpu", "0,0", "-1", "", "0,x"])
def test_bad_devices(spec):
    with pytest.raises(ValidationError):
        Settings(devices=spec)


@pytest.mark.parametrize("field", [{"max_batch_size": 0}, {"port": 70000}, {"request_timeout_s": 0},
                                   {"log_level": "loud"}, {"http_processes": 0}, {"http_processes": 65}])
def test_bad_values(field):
    with pytest.raises(ValidationError):
        Settings(**field)


def test_parse_devices():
    assert parse_devices("AUTO") == "auto"
    assert parse_devices("cpu") == "cpu"
    assert parse_devices("all") == "all"
    assert parse_devices("cuda:1,2") == [1, 2]
