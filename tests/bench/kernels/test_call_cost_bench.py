"""bench/kernels/call_cost.py without a GPU: joining partial runs (--merge) and writing them into a zoo file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kernels import call_cost


def _row(name: str, precision: str, layout: str, ratio: float, kernels: int = 1) -> dict:
    call = {"host_us": 10.0, "warm_us": 10.0, "cold_us": 10.0, "kernels": kernels,
            **{f"vs_cudnn_{m}": ratio for m in ("host", "warm", "cold")}}
    cudnn = {"host_us": 10.0 * ratio, "warm_us": 10.0 * ratio, "cold_us": 10.0 * ratio, "kernels": 1}
    return {"name": name, "suite": "zoo", "precision": precision, "layout": layout, "lib": {**call, "gpu_work": []},
            "module": dict(call), "cudnn_nchw": cudnn, "cudnn_cl": cudnn}


def _doc(rows: list[dict], device: str = "NVIDIA H200", measured: bool = True) -> dict:
    return {"device": device, "torch": "2.11", "cudnn": 91900, "measured_choice": measured, "host_calls": 60,
            "warm_calls": 50, "cold_calls": 21, "summary": call_cost.summarize(rows), "rows": rows}


def test_merge_joins_runs_in_zoo_order_and_later_rows_win() -> None:
    a = _doc([_row("unet-up1", "bf16", "nchw", 0.5), _row("dcgan64-up1", "bf16", "nchw", 2.0)])
    b = _doc([_row("unet-up1", "bf16", "nchw", 1.25, kernels=2), _row("dcgan64-z", "tf32", "cl", 4.0)])
    doc = call_cost.merge([a, b])
    assert [(r["name"], r["precision"], r["layout"]) for r in doc["rows"]] == [
        ("dcgan64-z", "tf32", "cl"), ("dcgan64-up1", "bf16", "nchw"), ("unet-up1", "bf16", "nchw")]
    bf16 = doc["summary"]["bf16/nchw"]
    assert bf16["rows"] == 2
    assert bf16["max_lib_kernels"] == 2
    assert bf16["cold"]["min"] == 1.25  # b's unet-up1 replaced a's
    assert bf16["cold"]["at_or_above_1x"] == 2
    assert doc["device"] == "NVIDIA H200"


@pytest.mark.parametrize("other", [dict(device="NVIDIA H100 80GB HBM3"), dict(measured=False)])
def test_merge_refuses_runs_of_another_device_or_choice(other: dict) -> None:
    with pytest.raises(ValueError, match="different"):
        call_cost.merge([_doc([_row("unet-up1", "bf16", "nchw", 1.0)]),
                         _doc([_row("unet-up3", "bf16", "nchw", 1.0)], **other)])
    with pytest.raises(ValueError, match="nothing"):
        call_cost.merge([])


def test_merge_command_writes_the_file_and_the_zoo_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = []
    for i, rows in enumerate(([_row("unet-up1", "bf16", "nchw", 1.5)], [_row("unet-up1", "tf32", "cl", 0.8)])):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(_doc(rows)))
    zoo_file = tmp_path / "layer_zoo-nvidia-h200.json"
    zoo_file.write_text(json.dumps({"rows": [{"name": "unet-up1", "precision": "bf16", "layout": "nchw"},
                                             {"name": "unet-up3", "precision": "bf16", "layout": "nchw"}]}))
    call_cost.main(["--merge", *map(str, parts), "--out", str(tmp_path), "--into", str(zoo_file)])
    doc = json.loads((tmp_path / "call_cost-nvidia-h200.json").read_text())
    assert len(doc["rows"]) == 2
    assert set(doc["summary"]) == {"bf16/nchw", "tf32/cl"}
    zoo_rows = json.loads(zoo_file.read_text())["rows"]
    assert zoo_rows[0]["call_cost"]["lib"]["vs_cudnn_cold"] == 1.5
    assert "gpu_work" not in zoo_rows[0]["call_cost"]["lib"]
    assert "call_cost" not in zoo_rows[1]
    assert "wrote" in capsys.readouterr().out
