"""Measured kernel choices kept on disk (kernels.choice_store) without a GPU: where the files go, what a problem's
id holds, the file's reads and writes (several writers, a bound, damaged files), and the tuner recalling a choice an
earlier process measured instead of measuring again."""

from __future__ import annotations

import json
import logging
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import choice_store, tuning
from kernels.choice_store import ChoiceFile, problem_id
from kernels.functional import ConvArgs
from kernels.tuning import DEFAULT, KernelChoice, Tuner, TuneResult

ARGS = ConvArgs((2, 2), (1, 1), (0, 0), (1, 1), 1)
WEIGHT = torch.empty(16, 8, 4, 4)
GEMM = {"path": "gemm", "config": 1, "split": 2, "staged": None, "rounded": True}


def test_store_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for off in ("off", "0", "False", " no "):
        monkeypatch.setenv("DECONV_TUNE_CACHE", off)
        assert choice_store.store_dir() is None
    monkeypatch.setenv("DECONV_TUNE_CACHE", str(tmp_path / "choices"))
    assert choice_store.store_dir() == tmp_path / "choices"
    monkeypatch.delenv("DECONV_TUNE_CACHE")
    monkeypatch.setenv("DECONV_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert choice_store.store_dir() == tmp_path / "kernels" / "choices"


def test_problem_id_leaves_out_the_device_and_keeps_every_other_part() -> None:
    def key(**kw: Any) -> tuple:
        parts = {"shape": (2, 16, 8, 8), "device": torch.device("cpu"), "bias": True, "precision": "tf32",
                 "aligned": True, "cl": False, "dtype": torch.float32, "args": ARGS, **kw}
        w = torch.empty(16, 8, 4, 4, dtype=parts["dtype"])
        return (torch.Size(parts["shape"]), w.shape, w.stride(), w.dtype, parts["device"], parts["bias"],
                parts["args"], parts["precision"], parts["aligned"], False, parts["cl"])

    base = problem_id(key())
    assert json.loads(base)[0] == [2, 16, 8, 8]
    assert "float32" in base
    assert problem_id(key(device=torch.device("cuda", 1))) == base
    others = [key(shape=(4, 16, 8, 8)), key(bias=False), key(precision="fp32"), key(aligned=False), key(cl=True),
              key(dtype=torch.bfloat16), key(args=ConvArgs((2, 2), (0, 0), (0, 0), (1, 1), 1))]
    ids = {problem_id(k) for k in others}
    assert len(ids) == len(others)
    assert base not in ids


def test_a_choice_written_is_read_back_by_another_file_object(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "gpu.json"
    ChoiceFile(path).write("p1", GEMM)
    ChoiceFile(path).write("p2", {**GEMM, "config": 3})
    assert ChoiceFile(path).read() == {"p1": GEMM, "p2": {**GEMM, "config": 3}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["gpu.json", "gpu.json.lock"]  # no temporary left


def test_the_oldest_choices_go_past_the_bound(tmp_path: Path) -> None:
    file = ChoiceFile(tmp_path / "gpu.json", max_entries=3)
    for i in range(5):
        file.write(f"p{i}", {**GEMM, "config": i})
    file.write("p2", GEMM)  # a refreshed entry becomes the newest
    assert list(file.read()) == ["p3", "p4", "p2"]


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "choices": {}}', '["a list"]', ""])
def test_a_damaged_or_foreign_file_is_ignored_and_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          text: str) -> None:
    path = tmp_path / "gpu.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="deconv.tuning"):
        assert ChoiceFile(path).read() == {}
    assert "is ignored" in caplog.text
    ChoiceFile(path).write("p", GEMM)
    assert ChoiceFile(path).read() == {"p": GEMM}


def test_malformed_entries_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    bad = [{**GEMM, "config": True}, {**GEMM, "staged": 1}, {**GEMM, "extra": 1}, {"path": "gemm"}, "gemm", None,
           {**GEMM, "split": 2.0}]
    path.write_text(json.dumps({"format": 1, "choices": {"good": GEMM, **{f"bad{i}": b for i, b in
                                                                         enumerate(bad)}}}))
    assert ChoiceFile(path).read() == {"good": GEMM}


def _writer(path: str, first: int) -> None:
    file = ChoiceFile(Path(path))
    for i in range(first, first + 20):
        file.write(f"p{i}", {**GEMM, "config": i})


def test_writers_in_several_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), 100 * k)) for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(ChoiceFile(path).read()) == 80


def test_driver_version_from_the_kernel_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = tmp_path / "version"
    report.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs)\n"
                      "GCC version:  gcc version 13.3.0\n")
    monkeypatch.setattr(choice_store, "DRIVER_REPORT", report)
    assert choice_store.driver_version() == "580.159.04"
    report.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\n")
    assert choice_store.driver_version() == "550.54.14"


def test_identity_names_the_device_driver_torch_and_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200 (test)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(choice_store, "driver_version", lambda: "580.159.04")
    name = choice_store.identity(torch.device("cuda", 0), "0123abcd")
    assert name.startswith("NVIDIA_H200_test-sm90-driver580.159.04-torch")
    assert name.endswith("-0123abcd")
    assert "/" not in name
    assert " " not in name


# --- the tuner with a store -----------------------------------------------------------------------------------


class Measures:
    """Stands in for ``Tuner.tune`` (which needs CUDA): counts calls, stores ``answer`` in memory as tune does."""

    def __init__(self, tuner: Tuner, answer: KernelChoice) -> None:
        self.tuner, self.answer, self.calls = tuner, answer, 0

    def __call__(self, shape: Any, weight: torch.Tensor, bias: Any, args: ConvArgs, precision: str,
                 aligned: bool = True, packs: Any = None, channels_last: bool = False) -> TuneResult:
        self.calls += 1
        self.tuner.store(Tuner.key(shape, weight, bias is not None, args, precision, aligned, packs is not None,
                                   channels_last), self.answer)
        return TuneResult(self.answer, 1.0, 2.0, (), 0.0)


def _tuner(monkeypatch: pytest.MonkeyPatch, path: Path, answer: KernelChoice) -> tuple[Tuner, Measures]:
    """An enabled tuner whose choice file, for any device, is ``path``."""
    tuner = Tuner(enabled=True)
    measures = Measures(tuner, answer)
    monkeypatch.setattr(tuner, "tune", measures)
    file = ChoiceFile(path)
    monkeypatch.setattr(tuner, "_file", lambda device: tuner._files.setdefault(0, (file, file.read())))
    return tuner, measures


def test_a_later_process_recalls_a_choice_instead_of_measuring(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    choice = KernelChoice("gemm", 2, 4, rounded=False)
    first, measured = _tuner(monkeypatch, path, choice)
    assert first.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "tf32") == choice
    assert measured.calls == 1
    assert len(ChoiceFile(path).read()) == 1
    later, remeasured = _tuner(monkeypatch, path, DEFAULT)  # would answer the default, were it asked
    assert later.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "tf32") == choice
    assert later.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "tf32") == choice  # now from memory
    assert remeasured.calls == 0
    assert later.choose((4, 16, 8, 8), WEIGHT, None, ARGS, "tf32") == DEFAULT  # another problem is measured
    assert remeasured.calls == 1
    assert len(ChoiceFile(path).read()) == 2


def test_a_store_that_cannot_be_written_leaves_the_choice_in_memory(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    tuner, measured = _tuner(monkeypatch, tmp_path / "gpu.json", KernelChoice("gemm", 0))

    def refuse(problem: str, fields: dict) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.setattr(ChoiceFile, "write", lambda self, problem, fields: refuse(problem, fields))
    with caplog.at_level(logging.WARNING, logger="deconv.tuning"):
        assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == KernelChoice("gemm", 0)
    assert "kept in memory only" in caplog.text
    assert "read-only" in caplog.text
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == KernelChoice("gemm", 0)
    assert measured.calls == 1


def test_no_store_for_cpu_tensors_or_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    tuner = Tuner(enabled=True)
    assert tuner._file(torch.device("cpu")) is None
    monkeypatch.setenv("DECONV_TUNE_CACHE", "off")
    monkeypatch.setattr(tuning, "load_extension", lambda: pytest.fail("the store off must not load the kernels"))
    assert tuner._file(torch.device("cuda", 0)) is None


def test_a_stored_kernel_family_this_code_does_not_know_is_measured(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    tuner, measured = _tuner(monkeypatch, path, KernelChoice("gemm", 1))
    key = Tuner.key((2, 16, 8, 8), WEIGHT, False, ARGS, "fp32", True)
    ChoiceFile(path).write(problem_id(key), {**GEMM, "path": "a_family_of_another_build"})
    tuner._files.clear()
    assert tuner.choose((2, 16, 8, 8), WEIGHT, None, ARGS, "fp32") == KernelChoice("gemm", 1)
    assert measured.calls == 1
