"""Shared test configuration: GPU tests (``@pytest.mark.cuda``) are skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m cuda on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
