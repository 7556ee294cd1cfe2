"""Shared test configuration: GPU tests (``@pytest.mark.cuda``) are skipped on machines without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

# Measured kernel choices are not kept on disk while testing (kernels.choice_store): a test that tunes measures,
# whatever ran before it. The store's own tests give it a directory of their own.
os.environ["DECONV_TUNE_CACHE"] = "off"

import kernels.tuning

# The kernel tests run the dispatcher's rule (each kernel family is asked for by the tests that cover it); the tests
# of measured choice turn it on themselves. A server a test starts follows its own setting (Settings.tune).
kernels.tuning.enable(False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m cuda on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
